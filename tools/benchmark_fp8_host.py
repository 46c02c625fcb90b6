"""Measures the host time and the aten ops an FP8 linear layer costs, against a bf16 one.

An FP8 linear layer's forward and backward launch more than the bf16 layer's three GEMMs: the
casts of the input and of the output gradient, the weight's transpose, the scales, and the views
around them. Where the GPU's work per layer is small (one GPU, a model of a few billion
parameters) the step is bound by the host, and every aten op dispatched is several microseconds
of it (each one at least a kernel launch or an allocation on CUDA), so the host work per layer
decides FP8's speed. This tool measures that work at shapes where the kernels' own time is
negligible on a GPU (default hidden 16, 16 tokens; on CPU one thread, and its GEMMs
still cost tens of microseconds each), on any device, CPU included:

- a chain of `--linears` FP8 linear layers (`megatron.core.transformer.linear.Linear`, whose
  FP8 path is the parallel linears' at tensor-parallel size 1), forward and backward, their
  weight gradients fused into fp32 `main_grad`s as the engines do, each recipe against bf16:
  host microseconds per layer (the median, or `--statistic min`, of `--bursts` alternating
  bursts, so that the host's drift hits all variants alike) and the aten ops dispatched per layer;
- with `--experts N,M,...`, an MoE projection of that many experts (`Fp8ExpertSlots.
  experts_linear`, grouped GEMMs where the kernel applies, as `--moe-grouped-gemm` asks),
  `--tokens` rows per expert, forward and backward, its weight gradient fused into an fp32
  `main_grad`: host microseconds and aten ops per projection, and its FP8 GEMM calls, for each
  recipe and number of experts. What grows with the number of experts is the work of the GEMMs
  that run one per expert;
- with `--gpt-layers N` (N > 0), a GPT of N layers (the local spec: four linears per layer)
  trained by `--engine` on one rank, bf16 against FP8: host milliseconds and aten ops per step,
  and their difference per FP8 linear layer, which includes the per-step work (the weights'
  casts after each optimizer step, the delayed-scaling updates).

Off CUDA the casts run as torch ops standing in for the Triton kernels (`megatron.core.fp8.
quantize`'s reference quantiser, `blockwise`'s, the dequantised blockwise GEMM): their ops are
counted apart ("stand-in"), with the number of such calls, each one or two kernel launches on
CUDA (two for a current-scaling cast: the amax, then the cast). The ops outside them are what
the layer dispatches on every device. On CPU the stand-ins' time is in the host time; compare
host times on the same device only.

    python tools/benchmark_fp8_host.py                      # CPU or one GPU
    python tools/benchmark_fp8_host.py --ops                # also each op's count per layer
    python tools/benchmark_fp8_host.py --gpt-layers 2 --engine megatron_fsdp_zero3 \\
        --fp8-param-gather
    python tools/benchmark_fp8_host.py --experts 8,64 --format e4m3
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from types import CodeType

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from benchmark_lib.python_calls import count_python_calls

from megatron.core.fp8 import blockwise, gemm, grouped_quantize, quantize
from megatron.core.fp8.experts import Fp8ExpertSlots
from megatron.core.fp8.linear import Fp8LinearSlots
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.fp8.tensor import BlockFp8Tensor
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget, register_main_grad
from megatron.core.transformer.linear import Linear
from megatron.core.transformer.transformer_config import TransformerConfig

RECIPES = ("delayed", "tensorwise", "blockwise")

STAND_INS: frozenset[CodeType] = frozenset(
    function.__code__
    for function in (
        quantize._quantize_reference,
        quantize.record_amax,
        grouped_quantize._quantize_experts_reference,
        blockwise._quantize_reference,
        blockwise._quantize_transposed_reference,
        gemm._block_mm,
        BlockFp8Tensor.dequantize,
    )
)
"""The functions that run off CUDA in place of a Triton kernel (or, `_block_mm`, of torch's
blockwise GEMM): their ops are counted apart."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="rows of each linear's input")
    parser.add_argument("--linears", type=int, default=16, help="linear layers in the chain")
    parser.add_argument(
        "--recipes", default="delayed,tensorwise", help=f"comma-separated, from {RECIPES}"
    )
    parser.add_argument("--format", choices=("e4m3", "hybrid"), default="hybrid")
    parser.add_argument("--bursts", type=int, default=15, help="bursts of each, alternating")
    parser.add_argument("--burst-iters", type=int, default=20, help="fwd+bwd per burst")
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument(
        "--statistic",
        choices=("median", "min"),
        default="median",
        help="of the bursts' times (min: the least disturbed burst, on a shared machine)",
    )
    parser.add_argument("--ops", action="store_true", help="print each op's count per layer")
    parser.add_argument(
        "--experts",
        default="",
        help="also time an MoE projection of each of these numbers of experts (comma-separated)",
    )
    parser.add_argument(
        "--gpt-layers", type=int, default=0, help="also time a GPT of this many layers (0: no)"
    )
    parser.add_argument("--engine", default="single", help="the GPT's engine (benchmark_fsdp)")
    parser.add_argument("--fp8-param-gather", action="store_true", help="for the GPT's engine")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    args.recipes = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown or not args.recipes:
        parser.error(f"--recipes {args.recipes}: choose among {RECIPES}.")
    if "blockwise" in args.recipes and args.format != "e4m3":
        parser.error("--recipes blockwise needs --format e4m3 (E4M3 operands only).")
    try:
        args.experts = [int(count) for count in args.experts.split(",") if count.strip()]
    except ValueError:
        parser.error(f"--experts {args.experts!r}: give comma-separated numbers, e.g. 8,64.")
    if any(count < 1 for count in args.experts):
        parser.error(f"--experts {args.experts}: each number of experts must be at least 1.")
    if args.experts and "blockwise" in args.recipes:
        parser.error("--experts with --recipes blockwise: blockwise FP8 experts are not built.")
    if args.hidden_size % 16 or args.linears < 1 or args.tokens < 1 or args.bursts < 1:
        parser.error("--hidden-size must be a multiple of 16; --linears, --tokens, --bursts >= 1.")
    return args


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, those inside a `STAND_INS` function apart
    (with the number of calls of the outermost such functions)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.stand_in_ops = 0
        self.stand_in_calls = 0
        # Held so that a later call's frame cannot reuse its address.
        self._last_frame = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame, outermost = sys._getframe(1), None
        while frame is not None:
            if frame.f_code in STAND_INS:
                outermost = frame
            frame = frame.f_back
        if outermost is None:
            self.ops[func.overloadpacket.__name__] += 1
        else:
            self.stand_in_ops += 1
            if outermost is not self._last_frame:
                self.stand_in_calls += 1
                self._last_frame = outermost
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """The ops outside the stand-ins."""
        return sum(self.ops.values())


host_clock = time.perf_counter
"""The clock of host times: wall time on CUDA (a host-bound step waits for nothing else);
`main` makes it this thread's CPU time on CPU, where the single-threaded ops run on this thread
and a shared machine's other processes would otherwise count."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MainGrads:
    """fp32 `main_grad`s the linears' weight gradients accumulate into, as an engine's."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.buffers = {id(p): torch.zeros(p.shape, dtype=torch.float32) for p in params}
        for param in params:
            register_main_grad(param, self.target)

    def target(self, param: torch.nn.Parameter) -> FusionTarget:
        return FusionTarget(self.buffers[id(param)])


class LinearChain:
    """`count` bf16 linear layers in a row, in FP8 under `recipe` (None: bf16)."""

    def __init__(
        self, args: argparse.Namespace, recipe: Fp8Recipe | None, device: torch.device
    ) -> None:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=args.hidden_size,
            num_attention_heads=1,
            params_dtype=torch.bfloat16,
            bf16=True,
            gradient_accumulation_fusion=True,  # into `MainGrads`, as under an engine
        )
        init = torch.nn.init.normal_
        with device:
            self.layers = [
                Linear(args.hidden_size, args.hidden_size, config=config, init_method=init)
                for _ in range(args.linears)
            ]
            self.main_grads = MainGrads([layer.weight for layer in self.layers])
            # [sequence, batch, hidden], as the transformer layers' linears see it.
            shape = (args.tokens, 1, args.hidden_size)
            self.input = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
            self.grad = torch.randn(shape, dtype=torch.bfloat16)
        self.state = None
        if recipe is not None:
            if recipe.delayed:
                self.state = DelayedScalingState(recipe, None)
            for layer in self.layers:
                layer.fp8 = Fp8LinearSlots(recipe, self.state)

    def step(self) -> None:
        """Forward and backward through every layer."""
        hidden = self.input
        for layer in self.layers:
            hidden, _ = layer(hidden)
        backward_ending_passes(hidden, self.grad, self.state)
        self.input.grad = None


def backward_ending_passes(
    out: torch.Tensor, grad: torch.Tensor, state: DelayedScalingState | None
) -> None:
    """Runs the backward of `out` from `grad`, with the delayed-scaling updates that a
    transformer block makes once per pass (`state`: None under current scaling)."""
    if state is not None:
        state.end_forward()
    out.backward(grad)
    if state is not None:
        state.end_backward()


class ExpertProjection:
    """An MoE projection of `experts` experts (hidden to hidden) in FP8 under `recipe`, each
    expert getting `--tokens` rows, its weight gradient fused into an fp32 `main_grad`."""

    def __init__(
        self, args: argparse.Namespace, experts: int, recipe: Fp8Recipe, device: torch.device
    ) -> None:
        hidden, rows = args.hidden_size, args.tokens * experts
        with device:
            weight = torch.randn(experts, hidden, hidden, dtype=torch.bfloat16) * 0.02
            self.weight = torch.nn.Parameter(weight)
            self.main_grads = MainGrads([self.weight])
            self.input = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
            self.grad = torch.randn(rows, hidden, dtype=torch.bfloat16)
        self.state = DelayedScalingState(recipe, None) if recipe.delayed else None
        self.slots = Fp8ExpertSlots(
            recipe, self.state, num_experts=experts, first_expert=0, num_local_experts=experts
        )
        self.counts = [args.tokens] * experts

    def step(self) -> None:
        """Forward and backward."""
        out = self.slots.experts_linear(self.input, self.weight, self.counts, grouped=True)
        backward_ending_passes(out, self.grad, self.state)
        self.input.grad = None


def experts_table(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(args.seed)
    projections = {
        (experts, name): ExpertProjection(args, experts, recipe_of(name, args.format), device)
        for experts in args.experts
        for name in args.recipes
    }
    times = alternate({key: p.step for key, p in projections.items()}, args, device)
    print(
        f"MoE expert projections in FP8, forward + backward, hidden {args.hidden_size}, "
        f"{args.tokens} tokens per expert, {args.format} format, {device.type}; per projection:"
    )
    print(
        f"{'experts':>7} {'recipe':<11} {'host us':>9} {'aten ops':>9} {'scaled_mm':>9} "
        f"{'grouped':>7}  stand-ins (ops)"
    )
    for (experts, name), projection in projections.items():
        counter = count_ops(projection.step)
        stand_in = ""
        if counter.stand_in_calls:
            stand_in = f"  {counter.stand_in_calls} ({counter.stand_in_ops})"
        print(
            f"{experts:7d} {name:<11} {times[experts, name]:9.1f} {counter.total:9d} "
            f"{counter.ops['_scaled_mm']:9d} {counter.ops['_scaled_grouped_mm']:7d}{stand_in}"
        )
    print(
        "scaled_mm, grouped: FP8 GEMM calls, one per expert and grouped; stand-ins: casts of "
        "all the experts' rows at once run as torch ops off CUDA (one or two kernel launches "
        "on CUDA), and their ops"
    )


def host_us(step: Callable[[], None], device: torch.device, iters: int) -> float:
    """Mean host microseconds of `iters` calls of `step`, started on an idle GPU."""
    synchronize(device)
    start = host_clock()
    for _ in range(iters):
        step()
    elapsed = host_clock() - start
    synchronize(device)
    return elapsed / iters * 1e6


def alternate(
    steps: dict[str, Callable[[], None]], args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
    """Host microseconds per call of each step (`--statistic` of alternating bursts)."""
    for step in steps.values():
        host_us(step, device, args.warmup_iters)
    bursts: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.bursts):
        for name, step in steps.items():
            bursts[name].append(host_us(step, device, args.burst_iters))
    statistic = min if args.statistic == "min" else statistics.median
    return {name: statistic(times) for name, times in bursts.items()}


def count_ops(step: Callable[[], None]) -> OpCounter:
    """The ops of one call of `step` (after the warm-up calls made its caches)."""
    counter = OpCounter()
    with counter:
        step()
    return counter


def recipe_of(name: str, fmt: str) -> Fp8Recipe:
    return Fp8Recipe(format=fmt, kind=name)


def linear_table(args: argparse.Namespace, device: torch.device) -> None:
    variants: dict[str, Fp8Recipe | None] = {"bf16": None}
    variants.update({f"fp8 {name}": recipe_of(name, args.format) for name in args.recipes})
    torch.manual_seed(args.seed)
    chains = {name: LinearChain(args, recipe, device) for name, recipe in variants.items()}
    times = alternate({name: chain.step for name, chain in chains.items()}, args, device)
    n = args.linears
    print(
        f"linear layers, forward + backward, hidden {args.hidden_size}, {args.tokens} tokens, "
        f"{args.format} format, {device.type}, torch {torch.__version__}; per layer:"
    )
    print(
        f"{'variant':<16} {'host us':>8} {'+ vs bf16':>9} {'aten ops':>9} {'py calls':>9}  "
        "stand-ins (ops)"
    )
    for name, chain in chains.items():
        counter = count_ops(chain.step)
        calls = count_python_calls(chain.step, skip=STAND_INS) / n
        stand_in = ""
        if counter.stand_in_calls:
            stand_in = f"{counter.stand_in_calls / n:.1f} ({counter.stand_in_ops / n:.0f})"
        us = times[name] / n
        row = (
            f"{name:<16} {us:8.1f} {us - times['bf16'] / n:9.1f} {counter.total / n:9.1f} "
            f"{calls:9.1f}"
        )
        print(f"{row}  {stand_in}" if stand_in else row)
        if args.ops:
            listed = ", ".join(f"{op} {c / n:g}" for op, c in counter.ops.most_common())
            print(f"    {listed}")
    print(
        "py calls: Python calls (of Python and C functions); stand-ins: calls per layer of the "
        "torch ops standing in for GPU kernels off CUDA, and their ops (in neither 'aten ops' "
        "nor 'py calls'); on CPU the host time includes their time and the GEMMs'"
    )


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    from benchmark_fsdp import init_distributed

    from megatron.core import parallel_state

    init_distributed(device.type)
    try:
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def gpt_table(args: argparse.Namespace, device: torch.device) -> None:
    from benchmark_fsdp import build_parser, make_batches
    from benchmark_lib.engines import build_engine
    from benchmark_lib.gpt_model import set_parallel_state

    flags = [
        "--num-layers", str(args.gpt_layers),
        "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", "4",
        "--vocab-size", "256",
        "--seq-length", str(args.tokens),
        "--micro-batch-size", "1",
        "--bf16",
        "--device", device.type,
        "--seed", str(args.seed),
    ]  # fmt: skip
    if args.fp8_param_gather:
        flags.append("--fp8-param-gather")
    base = build_parser().parse_args(flags)
    base.num_microbatches = 1
    fp8_linears = 4 * args.gpt_layers
    with world_of_one(device):
        set_parallel_state(base.create_all_gather_group)
        batches = make_batches(base, device)
        steps = {}
        for name in ["bf16", *args.recipes]:
            variant = argparse.Namespace(**vars(base))
            variant.fp8_format = None if name == "bf16" else args.format
            variant.fp8_recipe = "delayed" if name == "bf16" else name
            torch.manual_seed(args.seed)
            with device:
                engine_step = build_engine(args.engine, variant)
            steps[name] = lambda step=engine_step: step(batches)
        times = alternate(steps, args, device)
        print(
            f"GPT of {args.gpt_layers} layers ({fp8_linears} FP8 linears), hidden "
            f"{args.hidden_size}, {args.tokens} tokens, engine {args.engine}"
            f"{', FP8 param gather' if args.fp8_param_gather else ''}; per training step:"
        )
        print(f"{'variant':<16} {'host ms':>8} {'aten ops':>9} {'stand-ins':>9}  per FP8 linear")
        counters = {}
        for name, step in steps.items():
            counter = counters[name] = count_ops(step)
            extra = ""
            if name != "bf16":
                extra_us = (times[name] - times["bf16"]) / fp8_linears
                extra_ops = (counter.total - counters["bf16"].total) / fp8_linears
                extra = f"  +{extra_us:.0f} us, +{extra_ops:.1f} ops"
            print(
                f"{name:<16} {times[name] / 1e3:8.2f} {counter.total:9d} "
                f"{counter.stand_in_calls:9d}{extra}"
            )
            if args.ops and name != "bf16":
                more = counter.ops.copy()
                more.subtract(counters["bf16"].ops)
                listed = ", ".join(
                    f"{op} {c / fp8_linears:+g}" for op, c in more.most_common() if c
                )
                print(f"    per FP8 linear: {listed}")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        # `--device cuda` means the current GPU, as in torch.
        device = torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
        torch.cuda.set_device(device)
    else:
        # One thread, as a host-bound GPU step runs its ops: several threads on small tensors
        # spend their time waking each other (and on a shared machine, waiting for cores).
        torch.set_num_threads(1)
        global host_clock
        host_clock = time.thread_time
    linear_table(args, device)
    if args.experts:
        experts_table(args, device)
    if args.gpt_layers > 0:
        gpt_table(args, device)


if __name__ == "__main__":
    main()
