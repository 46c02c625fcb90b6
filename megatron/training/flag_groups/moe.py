"""Mixture-of-Experts flags: Megatron-LM's `--num-experts` and `--moe-*` flags that are built.

Names, types, defaults and choices are upstream's (its flags generated from `TransformerConfig`'s
`moe_*` fields, and its "moe" group). `validate_moe` applies upstream's conventions and refuses
what only the flags can tell (MoE flags on a dense model, an expert-parallel size the ranks do
not allow); `TransformerConfig` checks the values themselves, unbuilt choices included. The MoE
flags of features not built are refused by name in `flag_groups/unbuilt.py`.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Mapping
from typing import Any

from megatron.core.transformer.moe.moe_config import layer_pattern
from megatron.training.configs_from_args import flag

_MAX_PATTERN_LENGTH = 100_000
"""Longest `--moe-layer-freq` pattern parsed: far more layers than any model, and a bound on
what a mistyped expression can make the parser allocate."""


def moe_layer_freq_type(text: str) -> int | list[int]:
    """Parses `--moe-layer-freq`: an int N (every N-th layer is an MoE layer, from the first)
    or upstream's list expression, such as "([1]*3+[0]*1)*3" -> [1,1,1,0,1,1,1,0,1,1,1,0].

    The expression is evaluated without `eval`: only int literals, list displays of ints,
    parentheses, `+` of lists and `*` of a list by an int are allowed.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse reports it with the flag's name).
    """
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f'{text!r} is neither an int nor a list expression such as "([1]*3+[0]*1)*3"'
            ) from None
    try:
        value = _evaluate_pattern(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as error:
        raise argparse.ArgumentTypeError(
            f'{text!r} is not a list expression of 0/1 such as "([1]*3+[0]*1)*3": {error}'
        ) from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"{text!r} does not give a list.")
    return value


def _evaluate_pattern(node: ast.expr) -> int | list[int]:
    """The value of an int / list-of-int expression of `+`, `*`, literals and list displays."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_int(_evaluate_pattern(element)) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate_pattern(node.left), _evaluate_pattern(node.right)
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) != isinstance(right, list):
                raise ValueError("+ needs two lists or two ints")
        elif isinstance(left, list) and isinstance(right, list):
            raise ValueError("* needs an int on one side")
        elif isinstance(left, list) or isinstance(right, list):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * max(times, 0) > _MAX_PATTERN_LENGTH:
                raise ValueError(f"the pattern is longer than {_MAX_PATTERN_LENGTH} layers")
        result = left + right if isinstance(node.op, ast.Add) else left * right
        if isinstance(result, list) and len(result) > _MAX_PATTERN_LENGTH:
            raise ValueError(f"the pattern is longer than {_MAX_PATTERN_LENGTH} layers")
        return result
    raise ValueError(f"{ast.unparse(node)!r} is not allowed (only ints, [..], +, * and (..))")


def _int(value: int | list[int]) -> int:
    if isinstance(value, list):
        raise ValueError("a list inside a list")
    return value


_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--num-experts", dict(type=int, help="Experts per MoE layer; None (or 0): a dense model.")),
    (
        "--moe-layer-freq",
        dict(
            type=moe_layer_freq_type,
            default=1,
            help="MoE layers: an int N (every N-th layer, from the first) or a 0/1 list "
            'expression per layer, e.g. "([1]*3+[0]*1)*3".',
        ),
    ),
    ("--moe-ffn-hidden-size", dict(type=int, help="Width of each expert (--ffn-hidden-size).")),
    (
        "--moe-router-load-balancing-type",
        dict(
            nargs="+",
            default="aux_loss",
            choices=(
                "aux_loss",
                "seq_aux_loss",
                "global_aux_loss",
                "sinkhorn",
                "quantile_balancing",
                "none",
            ),
            help="aux_loss (per micro-batch), seq_aux_loss (per sequence) or none.",
        ),
    ),
    ("--moe-router-topk", dict(type=int, default=2, help="Experts each token goes to.")),
    (
        "--moe-router-score-function",
        dict(
            default="softmax",
            choices=("softmax", "sigmoid", "sqrtsoftplus"),
            help="Router scores: softmax or sigmoid.",
        ),
    ),
    ("--moe-router-pre-softmax", dict(action="store_true", help="Softmax before the top-k.")),
    ("--moe-router-topk-scaling-factor", dict(type=float, help="Scales the routing weights.")),
    ("--moe-router-dtype", dict(choices=("fp32", "fp64"), help="Router precision.")),
    ("--moe-router-num-groups", dict(type=int, help="Expert groups (group-limited routing).")),
    ("--moe-router-group-topk", dict(type=int, help="Groups each token may use.")),
    (
        "--moe-router-enable-expert-bias",
        dict(action="store_true", help="Aux-loss-free balancing: a per-expert routing bias."),
    ),
    (
        "--moe-router-bias-update-rate",
        dict(type=float, default=1e-3, help="Step of the expert-bias update."),
    ),
    (
        "--moe-router-force-load-balancing",
        dict(action="store_true", help="Route by random logits (benchmarks only)."),
    ),
    (
        "--moe-aux-loss-coeff",
        dict(type=float, nargs="+", default=0.0, help="Load-balancing loss weight (1e-2)."),
    ),
    ("--moe-z-loss-coeff", dict(type=float, help="Router z-loss weight (1e-3); None: off.")),
    ("--moe-input-jitter-eps", dict(type=float, help="Router input jitter; None: off.")),
    (
        "--moe-token-dispatcher-type",
        dict(
            default="allgather",
            choices=("allgather", "alltoall", "flex"),
            help="Token exchange over the expert-parallel group: allgather or alltoall.",
        ),
    ),
    (
        "--moe-expert-capacity-factor",
        dict(type=float, help="Expert capacity (x the even share); None: dropless."),
    ),
    (
        "--moe-token-drop-policy",
        dict(default="probs", choices=("probs", "position"), help="Tokens an expert drops."),
    ),
    (
        "--moe-pad-expert-input-to-capacity",
        dict(action="store_true", help="Pad each expert's input to its capacity."),
    ),
    (
        "--moe-pad-dispatch-to-worst-case",
        dict(
            action="store_true",
            help="This project's own flag (not in Megatron-LM): with expert parallelism, pad the "
            "dropless token exchange to its worst case (tokens x topk rows to every peer), so "
            "that no MoE layer reads its token counts on the host; more bytes travel.",
        ),
    ),
    ("--moe-grouped-gemm", dict(action="store_true", help="One grouped GEMM per projection.")),
    (
        "--moe-shared-expert-intermediate-size",
        dict(type=int, help="Width of the shared experts; None: none."),
    ),
    (
        "--moe-shared-expert-gate",
        dict(action="store_true", help="Sigmoid gate on the shared experts (Qwen2-MoE)."),
    ),
    (
        "--moe-per-layer-logging",
        dict(action="store_true", help="Also write each layer's MoE losses to TensorBoard."),
    ),
)
"""The built MoE flags and their argparse settings (upstream's)."""

KERNEL_TOGGLES: tuple[tuple[str, str], ...] = (
    ("--moe-permute-fusion", "moe_permute_fusion"),
    ("--moe-router-fusion", "moe_router_fusion"),
)
"""Upstream switches (flag, dest) that pick fused kernels for the same result: accepted and
ignored (the PyTorch code computes the same)."""


FLEX_DISPATCHER_BACKENDS = ("deepep", "hybridep", "ncclep")
"""Upstream's `--moe-flex-dispatcher-backend` choices (its default first). Only the flex
dispatcher reads the flag: allgather and alltoall ignore it, here as upstream. The flex
dispatcher, and ncclep without it (which upstream refuses too), are refused by name in
`flag_groups/unbuilt.py`."""


def _dest(flag_name: str) -> str:
    return flag_name[2:].replace("-", "_")


DEFAULTS: dict[str, Any] = {
    _dest(name): settings.get("default", False if settings.get("action") else None)
    for name, settings in _FLAGS
}
"""Each built MoE flag's destination and default."""


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """The "moe" group: the built MoE flags, the kernel toggles and the flex dispatcher's
    backend."""
    group = parser.add_argument_group(title="moe")
    for name, settings in _FLAGS:
        group.add_argument(name, **settings)
    for name, dest in KERNEL_TOGGLES:
        group.add_argument(name, action="store_true", dest=dest, help="Accepted; no effect here.")
    group.add_argument(
        "--moe-flex-dispatcher-backend",
        default=FLEX_DISPATCHER_BACKENDS[0],
        choices=FLEX_DISPATCHER_BACKENDS,
        help="The flex dispatcher's backend (not built); allgather and alltoall ignore it.",
    )


def validate_moe(args: argparse.Namespace) -> None:
    """Checks what the MoE and expert-parallel flags ask of the job and of each other.

    Upstream's conventions: `--num-experts 0` means a dense model (None), and a one-element
    `--moe-router-load-balancing-type` / `--moe-aux-loss-coeff` becomes its element. The values
    themselves (unbuilt choices, top-k, groups, `--moe-layer-freq` against `--num-layers`, the
    experts against `--expert-model-parallel-size`) are checked by `TransformerConfig`, whose
    errors `validate_args` reports with these flags' names.

    `--expert-tensor-parallel-size` unset (None) becomes the tensor-parallel size, as upstream;
    another size without `--num-experts` is refused with the MoE flags.

    Raises:
        ValueError: an MoE flag without `--num-experts`, several load-balancing losses, or
            expert-parallel sizes the ranks do not allow.
    """
    if args.num_experts == 0:
        args.num_experts = None
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list):
            if len(value) > 1:
                raise ValueError(
                    f"{flag(dest)} {' '.join(map(str, value))}: combining several "
                    "load-balancing losses is not built in this project; give one value."
                )
            setattr(args, dest, value[0])
    if args.num_experts is None:
        given = [
            flag(dest)
            for dest, default in DEFAULTS.items()
            if dest != "num_experts" and getattr(args, dest) != default
        ]
        given += [name for name, dest in KERNEL_TOGGLES if getattr(args, dest)]
        if args.moe_flex_dispatcher_backend != FLEX_DISPATCHER_BACKENDS[0]:
            given.append(f"--moe-flex-dispatcher-backend {args.moe_flex_dispatcher_backend}")
        etp = args.expert_tensor_parallel_size
        if etp not in (None, args.tensor_model_parallel_size):
            given.append(f"--expert-tensor-parallel-size {etp}")
        if given:
            raise ValueError(
                f"{', '.join(given)}: MoE flags without --num-experts (the model is dense, so "
                "they would be ignored); add --num-experts or drop them."
            )
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    _validate_expert_parallelism(args)


def _validate_expert_parallelism(args: argparse.Namespace) -> None:
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    # The experts split the ranks of one pipeline stage (a --pipeline-model-parallel-size that
    # does not divide the world size is the parallelism check's to name).
    stages = args.pipeline_model_parallel_size
    if stages < 1 or args.world_size % stages:
        return
    ranks = args.world_size // stages
    where = f"world size {ranks}" if stages == 1 else f"{ranks} ranks of a pipeline stage"
    if etp < 1 or ranks % (etp * ep):
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} does not "
            f"divide the {where}; choose sizes whose product divides {ranks}."
        )
    expert_data_parallel = ranks // (etp * ep)
    instances = args.num_distributed_optimizer_instances
    if expert_data_parallel % instances:
        raise ValueError(
            f"--num-distributed-optimizer-instances {instances} does not divide the expert "
            f"data-parallel size {expert_data_parallel} ({where} / "
            f"(--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep})); "
            "lower one of them."
        )


def resolved_moe_args(values: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE model flags among the validated flags `values` that several spellings can give,
    as the model reads them, so that two runs of one model compare equal: the expert width
    (`moe_ffn_hidden_size` None is `ffn_hidden_size`, as `TransformerConfig` resolves it), the
    MoE layers (`moe_layer_freq` as its per-layer 0/1 list) and the routing weights' scale
    (`moe_router_topk_scaling_factor` None scales nothing, as 1 does). Empty for a dense model,
    and each left out where `values` lacks what it derives from (an older checkpoint's)."""
    experts = values.get("num_experts")
    if experts is None:
        return {}
    resolved: dict[str, Any] = {}
    if "ffn_hidden_size" in values and _unset(values, "moe_ffn_hidden_size"):
        resolved["moe_ffn_hidden_size"] = values["ffn_hidden_size"]
    if "moe_layer_freq" in values and "num_layers" in values:
        pattern = layer_pattern(values["num_layers"], experts, values["moe_layer_freq"])
        resolved["moe_layer_freq"] = [int(is_moe) for is_moe in pattern]
    if _unset(values, "moe_router_topk_scaling_factor"):
        resolved["moe_router_topk_scaling_factor"] = 1.0
    return resolved


def _unset(values: Mapping[str, Any], dest: str) -> bool:
    """Whether `values` holds `dest` as None."""
    return dest in values and values[dest] is None
