"""`tools/host_stacks.py`: py-spy's sampled stacks per thread, as a tree of shares and as the
frames the samples were in, for the samples its filters select."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit_tests.tools.test_benchmark_fsdp import REPO, run_tool

TOOL = REPO / "tools" / "host_stacks.py"

# Two threads as py-spy `record --native --threads --format raw` writes them: the main thread
# builds (10 samples) then steps (8: a C++ GEMM under a linear layer 6, a hook 2), autograd's
# thread runs an extension's node (3) and a Python hook (1).
_STACKS = """\
thread (1): MainThread;<module> (run.py:1);time_loop (bench.py:10);step (bench.py:20);\
linear (layers.py:5);at::_ops::mm::call(at::Tensor const&, at::Tensor const&) (libtorch_cpu.so) 6
thread (1): MainThread;<module> (run.py:1);time_loop (bench.py:10);step (bench.py:20);\
pre_forward (hooks.py:7) 2
thread (1): MainThread;<module> (run.py:1);build (bench.py:3) 10
thread (2);torch::autograd::Engine::evaluate_function(torch::autograd::GraphTask&) \
(libtorch_cpu.so);torch::autograd::CppNode<megatron::(anonymous namespace)::Linear<float> >::apply\
(std::vector<at::Tensor, std::allocator<at::Tensor> >&&) (ext.so);cublasLtMatmul (libcublasLt.so) 3
thread (2);torch::autograd::Engine::evaluate_function(torch::autograd::GraphTask&) \
(libtorch_cpu.so);post_backward (hooks.py:9) 1
"""


def write_stacks(tmp_path: Path, text: str = _STACKS) -> str:
    path = tmp_path / "stacks.txt"
    path.write_text(text)
    return str(path)


def rows(stdout: str) -> list[tuple[float, int, str]]:
    """(share %, samples, frame with its indentation) of each printed row."""
    found = re.findall(r"^\s*(\d+\.\d)% +(\d+)(?: +\d+\.\d+)?  (.+)$", stdout, flags=re.M)
    return [(float(share), int(count), frame) for share, count, frame in found]


def test_threads_and_the_tree_of_the_steps_on_the_main_thread(tmp_path):
    stacks = write_stacks(tmp_path)
    proc = run_tool(
        stacks,
        "--thread",
        "MainThread",
        "--with",
        "time_loop",
        "--root",
        "step (",
        nproc=None,
        tool=TOOL,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\s+18  thread \(1\): MainThread$", proc.stdout, flags=re.M)
    assert re.search(r"^\s+4  thread \(2\)$", proc.stdout, flags=re.M)
    assert "selected: 8 samples" in proc.stdout
    assert rows(proc.stdout) == [
        (100.0, 8, "step (bench.py:20)"),
        (75.0, 6, "  linear (layers.py:5)"),
        (75.0, 6, "    at::_ops::mm::call (libtorch_cpu.so)"),
        (25.0, 2, "  pre_forward (hooks.py:7)"),
    ]


def test_other_threads_shortened_cpp_frames_and_ms_per_step(tmp_path):
    stacks = write_stacks(tmp_path)
    proc = run_tool(
        stacks,
        "--skip-thread",
        "MainThread",
        "--root",
        "evaluate_function",
        "--rate",
        "40",
        "--steps",
        "2",
        nproc=None,
        tool=TOOL,
    )
    assert proc.returncode == 0, proc.stderr
    assert rows(proc.stdout) == [
        (100.0, 4, "torch::autograd::Engine::evaluate_function (libtorch_cpu.so)"),
        (75.0, 3, "  torch::autograd::CppNode<..>::apply (ext.so)"),
        (75.0, 3, "    cublasLtMatmul (libcublasLt.so)"),
        (25.0, 1, "  post_backward (hooks.py:9)"),
    ]
    # 3 samples at 40 a second over 2 steps: 37.5 ms per step.
    assert re.search(r"75\.0% +3 +37\.50  +torch::autograd::CppNode", proc.stdout)


def test_leaves_depth_and_without(tmp_path):
    stacks = write_stacks(tmp_path)
    proc = run_tool(stacks, "--leaves", "--without", "build", nproc=None, tool=TOOL)
    assert proc.returncode == 0, proc.stderr
    assert "selected: 12 samples" in proc.stdout
    assert rows(proc.stdout) == [
        (50.0, 6, "at::_ops::mm::call (libtorch_cpu.so)"),
        (25.0, 3, "cublasLtMatmul (libcublasLt.so)"),
        (16.7, 2, "pre_forward (hooks.py:7)"),
        (8.3, 1, "post_backward (hooks.py:9)"),
    ]
    proc = run_tool(stacks, "--thread", "MainThread", "--depth", "1", nproc=None, tool=TOOL)
    assert rows(proc.stdout) == [(100.0, 18, "<module> (run.py:1)")]


def test_bad_input_is_refused_with_the_fix(tmp_path):
    proc = run_tool(write_stacks(tmp_path, "not a stack\n"), nproc=None, tool=TOOL)
    assert proc.returncode != 0
    assert "stacks.txt:1: not a py-spy raw stack" in proc.stderr
    assert "--format raw" in proc.stderr
    proc = run_tool(write_stacks(tmp_path), "--rate", "40", nproc=None, tool=TOOL)
    assert proc.returncode == 2
    assert "--rate and --steps go together" in proc.stderr
