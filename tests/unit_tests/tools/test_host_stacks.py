"""`tools/host_stacks.py`: py-spy's sampled stacks per thread, as a tree of shares and as the
frames the samples were in, for the samples its filters select; C++ frames merged by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit_tests.tools.conftest import usage_error

# Two threads as py-spy `record --native --threads --format raw` writes them: the main thread
# builds (10 samples) then steps (8: a C++ GEMM under a linear layer 6, a hook 2), autograd's
# thread runs an extension's node (3: two template instances of one function) and a Python hook
# (1). A trailing space, as a hand-edited file may have, is no part of the count.
_STACKS = """\
thread (1): MainThread;<module> (run.py:1);time_loop (bench.py:10);step (bench.py:20);\
linear (layers.py:5);at::_ops::mm::call(at::Tensor const&, at::Tensor const&) (libtorch_cpu.so) 6
thread (1): MainThread;<module> (run.py:1);time_loop (bench.py:10);step (bench.py:20);\
pre_forward (hooks.py:7) 2
thread (1): MainThread;<module> (run.py:1);build (bench.py:3) 10 \n\
thread (2);torch::autograd::Engine::evaluate_function(torch::autograd::GraphTask&) \
(libtorch_cpu.so);torch::autograd::CppNode<megatron::(anonymous namespace)::Linear<float> >::apply\
(std::vector<at::Tensor, std::allocator<at::Tensor> >&&) (ext.so);cublasLtMatmul (libcublasLt.so) 2
thread (2);torch::autograd::Engine::evaluate_function(torch::autograd::GraphTask&) \
(libtorch_cpu.so);torch::autograd::CppNode<megatron::Linear<c10::BFloat16> >::apply\
(std::vector<at::Tensor, std::allocator<at::Tensor> >&&) (ext.so);cublasLtMatmul (libcublasLt.so) 1
thread (2);torch::autograd::Engine::evaluate_function(torch::autograd::GraphTask&) \
(libtorch_cpu.so);post_backward (hooks.py:9) 1
"""


@pytest.fixture
def host_stacks(import_tool):
    return import_tool("host_stacks")


def write_stacks(tmp_path: Path, text: str = _STACKS) -> str:
    """`text` as a file of stacks under `tmp_path`; its path."""
    path = tmp_path / "stacks.txt"
    path.write_text(text)
    return str(path)


def rows(stdout: str) -> list[tuple[float, int, str]]:
    """(share %, samples, frame with its indentation) of each printed row."""
    found = re.findall(r"^\s*(\d+\.\d)% +(\d+)(?: +\d+\.\d+)?  (.+)$", stdout, flags=re.M)
    return [(float(share), int(count), frame) for share, count, frame in found]


def run(host_stacks, capsys, *argv: str) -> str:
    """The tool's output for `argv`."""
    host_stacks.main(list(argv))
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "frame, short",
    [
        (
            "torch::autograd::CppNode<megatron_fp8::(anonymous namespace)::Fp8Linear>::apply"
            "(std::vector<at::Tensor, std::allocator<at::Tensor> >&&) (ext.so)",
            "torch::autograd::CppNode<..>::apply (ext.so)",
        ),
        (
            "megatron_fp8::(anonymous namespace)::cast_impl(at::Tensor const&) (ext.so)",
            "megatron_fp8::{anon}::cast_impl (ext.so)",
        ),
        ("at::Tensor::sizes() const (libtorch_cpu.so)", "at::Tensor::sizes (libtorch_cpu.so)"),
        (
            "torch::autograd::Node::operator()(std::vector<at::Tensor>&&) (libtorch_cpu.so)",
            "torch::autograd::Node::operator() (libtorch_cpu.so)",
        ),
        (
            "{lambda(c10::ArrayRef<at::Tensor> const&)#1}::operator()(c10::ArrayRef<at::Tensor> "
            "const&) const (lib.so)",
            "{lambda(c10::ArrayRef<..> const&)#1}::operator() (lib.so)",
        ),
        (
            "std::operator<< <char>(std::basic_ostream<char>&, char const*) (libstdc++.so.6)",
            "std::operator<< <..> (libstdc++.so.6)",
        ),
        (
            "std::vector<at::Tensor, std::allocator<at::Tensor> >::~vector() (libtorch_cpu.so)",
            "std::vector<..>::~vector (libtorch_cpu.so)",
        ),
        ("c10::operator&(c10::DispatchKeySet) (libc10.so)", "c10::operator& (libc10.so)"),
        ("at::native::add<float>(at::Tensor&) (add.cpp:123)", "at::native::add<..> (add.cpp:123)"),
        ("0x7f6759529ecc (libc.so.6)", "0x.. (libc.so.6)"),
        ("cublasLtMatmul (libcublasLt.so.13)", "cublasLtMatmul (libcublasLt.so.13)"),
        # Python frames stay whole: with a line, without one (py-spy's --nolineno), frozen.
        ("_flatten.<locals>.<genexpr> (unit_boundaries.py:107)", None),
        ("<listcomp> (unit_boundaries.py)", None),
        ("_find_and_load (<frozen importlib._bootstrap>:1176)", None),
    ],
)
def test_shorten_merges_cpp_names_and_keeps_python_frames(host_stacks, frame, short):
    assert host_stacks.shorten(frame) == (frame if short is None else short)


def test_threads_and_the_tree_of_the_steps_on_the_main_thread(host_stacks, capsys, tmp_path):
    stacks = write_stacks(tmp_path)
    out = run(
        host_stacks,
        capsys,
        stacks,
        "--thread",
        "MainThread",
        "--with",
        "time_loop",
        "--root",
        "step (",
    )
    assert re.search(r"^\s+18  thread \(1\): MainThread$", out, flags=re.M)
    assert re.search(r"^\s+4  thread \(2\)$", out, flags=re.M)
    assert "selected: 8 samples" in out
    assert rows(out) == [
        (100.0, 8, "step (bench.py:20)"),
        (75.0, 6, "  linear (layers.py:5)"),
        (75.0, 6, "    at::_ops::mm::call (libtorch_cpu.so)"),
        (25.0, 2, "  pre_forward (hooks.py:7)"),
    ]


def test_other_threads_merged_templates_and_ms_per_step(host_stacks, capsys, tmp_path):
    stacks = write_stacks(tmp_path)
    out = run(
        host_stacks,
        capsys,
        stacks,
        "--skip-thread",
        "MainThread",
        "--root",
        "evaluate_function",
        "--rate",
        "40",
        "--steps",
        "2",
    )
    # The node's two template instances are one frame of the tree.
    assert rows(out) == [
        (100.0, 4, "torch::autograd::Engine::evaluate_function (libtorch_cpu.so)"),
        (75.0, 3, "  torch::autograd::CppNode<..>::apply (ext.so)"),
        (75.0, 3, "    cublasLtMatmul (libcublasLt.so)"),
        (25.0, 1, "  post_backward (hooks.py:9)"),
    ]
    # 3 samples at 40 a second over 2 steps: 37.5 ms per step.
    assert re.search(r"75\.0% +3 +37\.50  +torch::autograd::CppNode", out)


def test_leaves_depth_min_hide_and_repeated_filters(host_stacks, capsys, tmp_path):
    stacks = write_stacks(tmp_path)
    out = run(host_stacks, capsys, stacks, "--leaves", "--without", "build")
    assert "selected: 12 samples" in out
    assert rows(out) == [
        (50.0, 6, "at::_ops::mm::call (libtorch_cpu.so)"),
        (25.0, 3, "cublasLtMatmul (libcublasLt.so)"),
        (16.7, 2, "pre_forward (hooks.py:7)"),
        (8.3, 1, "post_backward (hooks.py:9)"),
    ]
    out = run(host_stacks, capsys, stacks, "--thread", "MainThread", "--depth", "1")
    assert rows(out) == [(100.0, 18, "<module> (run.py:1)")]
    # Every --with must match; --hide drops frames (a stack left empty counts nowhere); --min
    # hides the rows under its share.
    out = run(
        host_stacks,
        capsys,
        stacks,
        "--with",
        "time_loop",
        "--with",
        "linear",
        "--hide",
        "<module>",
        "--hide",
        "time_loop",
        "--depth",
        "2",
    )
    assert rows(out) == [
        (100.0, 6, "step (bench.py:20)"),
        (100.0, 6, "  linear (layers.py:5)"),
    ]
    out = run(host_stacks, capsys, stacks, "--root", "mm::call", "--hide", "mm::call")
    assert "selected: 0 samples" in out and not rows(out)
    out = run(host_stacks, capsys, stacks, "--root", "step (", "--min", "50")
    assert [row[2] for row in rows(out)] == [
        "step (bench.py:20)",
        "  linear (layers.py:5)",
        "    at::_ops::mm::call (libtorch_cpu.so)",
    ]


def test_a_count_without_a_stack_is_left_out(host_stacks, tmp_path):
    """py-spy writes the samples of a process with no stack to show (recorded without
    `--threads`) as a count alone: they say nothing of where the time went."""
    path = write_stacks(tmp_path, "<module> (run.py:1);step (bench.py:20) 3\n 398\n")
    samples = host_stacks.read_samples(path)
    assert [(s.frames, s.count) for s in samples] == [
        (("<module> (run.py:1)", "step (bench.py:20)"), 3)
    ]


def test_bad_input_is_refused_with_the_fix(host_stacks, capsys, tmp_path):
    with pytest.raises(SystemExit, match=r"stacks.txt:1: not a py-spy raw stack.*--format raw"):
        host_stacks.main([write_stacks(tmp_path, "not a stack\n")])
    with pytest.raises(SystemExit, match=r"stacks.txt:1: not a py-spy raw stack"):
        host_stacks.main([write_stacks(tmp_path, "398\n")])
    unthreaded = write_stacks(tmp_path, "<module> (run.py:1);step (bench.py:20) 3\n")
    with pytest.raises(SystemExit, match=r"names no threads.*py-spy record --threads"):
        host_stacks.main([unthreaded, "--thread", "MainThread"])
    stacks = write_stacks(tmp_path)
    err = usage_error(lambda: host_stacks.parse_args([stacks, "--rate", "40"]), capsys)
    assert "--rate and --steps go together" in err
