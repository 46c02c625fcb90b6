"""Measures the host time of this project's C++ extensions against their Python paths, and
against the feature off, in one GPU's training step.

Three features run as C++ autograd nodes on CUDA where their extensions build:
gradient-accumulation fusion's linear layers (`--extension linear`:
`megatron.core.tensor_parallel.native_linear`, against their Python autograd function and
against `--no-gradient-accumulation-fusion`), the FP8 linear layers (`--extension fp8` with
`--fp8-format`: `megatron.core.fp8.cpp_linear`, against their Python autograd function; no
feature-off row: bf16 runs other GEMMs) and the fused rotary embedding (`--extension rope`:
`megatron.core.fusions.native_rope`, against the Triton kernel launched from Python and against
`--no-rope-fusion`); Megatron-FSDP's gather casts launch their kernel from C++
(`--extension segment_copy`: `megatron.core.fusions.native_segment_copy`, against the Triton
kernel launched from Python; an engine that gathers weights, and no feature-off row). Their
Python paths cost the host more per layer, which shows where the step is bound by the host. This
tool builds the engine with the feature and without it on the same model, runs the former with
the C++ extension and with its Python path, and times them in alternating bursts of steps in one
process (`tools/benchmark_engine_host.py` says why):

    torchrun --nproc-per-node 1 tools/benchmark_native_host.py --bf16 [--extension rope]
        [--engine NAME]

Rank 0 prints each one's median host ms per step and its median per-burst difference to the
Python path's, with quartiles.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_engine_host import alternation_parser, check_bursts, host_ms, with_engine_defaults
from benchmark_fsdp import init_distributed, make_batches
from benchmark_lib.engines import ENGINES, build_engine
from benchmark_lib.gpt_model import set_parallel_state

from megatron.core import parallel_state
from megatron.core.fp8 import cpp_linear
from megatron.core.fusions import native_rope, native_segment_copy
from megatron.core.tensor_parallel import native_linear


class FeatureOff(NamedTuple):
    """The row of the feature turned off: the flag's attribute that turns it off, the row's
    name."""

    flag: str
    name: str


class Extension(NamedTuple):
    """A feature's C++ extension: whether it built (asked with a CUDA tensor), its Python path,
    the feature turned off (None: no such row), the engines whose steps run it (None: all), the
    flag that turns the feature on (None: on by default)."""

    built: Callable[[torch.Tensor], object]
    python_path: Callable[[], contextlib.AbstractContextManager]
    python_name: str
    off: FeatureOff | None
    engines: tuple[str, ...] | None = None
    on_flag: str | None = None


EXTENSIONS = {
    "linear": Extension(
        native_linear.native_linear_into_main_grad,
        native_linear.python_function,
        "Python function",
        FeatureOff("gradient_accumulation_fusion", "no fusion"),
    ),
    "fp8": Extension(
        cpp_linear.native_linear,
        cpp_linear.python_function,
        "Python function",
        None,
        on_flag="fp8_format",
    ),
    "rope": Extension(
        native_rope.native_rope,
        native_rope.triton_kernel,
        "Triton kernel",
        FeatureOff("apply_rope_fusion", "no rope fusion"),
    ),
    "segment_copy": Extension(
        lambda _: native_segment_copy.native_segment_copy(),
        native_segment_copy.triton_kernel,
        "Triton kernel",
        None,
        engines=("megatron_fsdp_zero3",),  # the engines that gather weights
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = alternation_parser(__doc__, bursts=12, burst_steps=10, warmup_steps=3)
    parser.add_argument("--extension", default="linear", choices=list(EXTENSIONS))
    parser.add_argument("--engine", default="single", choices=list(ENGINES))
    args = parser.parse_args(argv)
    check_bursts(parser, args, min_warmup_steps=1)
    if args.device != "cuda":
        parser.error("the C++ nodes run on CUDA tensors: run it on a GPU (--device cuda).")
    args = with_engine_defaults(parser, args, engines=args.engine)
    extension = EXTENSIONS[args.extension]
    if extension.engines is not None and args.engine not in extension.engines:
        parser.error(
            f"--extension {args.extension} times Megatron-FSDP's gathers: use --engine "
            f"{' or '.join(extension.engines)}."
        )
    if extension.on_flag is not None and not getattr(args, extension.on_flag):
        parser.error(
            f"--extension {args.extension} times a feature that is off: set "
            f"--{extension.on_flag.replace('_', '-')}."
        )
    if extension.off is not None and not getattr(args, extension.off.flag):
        parser.error(
            f"--extension {args.extension} compares the feature on and off: leave "
            f"{extension.off.flag} on (drop the flag that turns it off)."
        )
    return args


def _in_python_path(step, python_path):
    """`step` with the feature's Python path."""

    def python_step(batches):
        with python_path():
            step(batches)

    return python_step


def main() -> None:
    args = parse_args()
    extension = EXTENSIONS[args.extension]
    device = init_distributed("cuda")
    set_parallel_state(args.create_all_gather_group)
    if extension.built(torch.empty(1, device=device)) is None:
        sys.exit("The C++ extension is not in use (the warning above says why, or its switch).")
    batches = make_batches(args, device)
    with device:
        torch.manual_seed(args.seed)
        with_feature = build_engine(args.engine, args)
        steps = {
            "C++": with_feature,
            extension.python_name: _in_python_path(with_feature, extension.python_path),
        }
        if extension.off is not None:
            off = copy.deepcopy(args)
            setattr(off, extension.off.flag, False)
            torch.manual_seed(args.seed)
            steps[extension.off.name] = build_engine(args.engine, off)
    for step in steps.values():
        host_ms(step, batches, device, args.warmup_steps)
    bursts = {name: [] for name in steps}
    for _ in range(args.bursts):
        for name, step in steps.items():
            bursts[name].append(host_ms(step, batches, device, args.burst_steps))
    del steps, with_feature  # before the process group they use
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    reference = bursts[extension.python_name]
    print(f"{args.engine}, {args.num_layers} layers: host ms per step (median difference)")
    for name, times in bursts.items():
        differences = [t - r for t, r in zip(times, reference)]
        quartiles = statistics.quantiles(differences)
        print(
            f"  {name:16s} {statistics.median(times):7.2f}  {statistics.median(differences):+6.2f}"
            f" (quartiles {quartiles[0]:+.2f} / {quartiles[2]:+.2f})"
        )


if __name__ == "__main__":
    main()
