"""Flags of Megatron-LM features this project does not build, refused by name.

A launch script written for upstream Megatron-LM parses here: each flag below is accepted with
upstream's name, and `validate_unbuilt` refuses every one that is set (a value given, or a switch
turned on) with an error that names the feature, the flags that asked for it and what to do
instead. Nothing here is silently ignored: the few flags that only tune speed, with no effect on
any result, are in `PERFORMANCE_HINTS` and documented as no-ops in `docs/flags.md`.
"""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class Unbuilt:
    """A feature that is not built, and the flags that ask for it.

    Attributes:
        feature: what the flags ask for, as a user would name it.
        instead: what to do instead.
        switches: flags that take no value (`store_true`).
        valued: flags that take one or more values.
    """

    feature: str
    instead: str
    switches: tuple[str, ...] = ()
    valued: tuple[str, ...] = ()


_MOE_SWITCHES = tuple(
    "--moe-" + name
    for name in (
        "shared-expert-gate shared-expert-overlap enable-routing-replay "
        "router-padding-for-quantization router-padding-for-fp8 router-pre-softmax "
        "router-enable-expert-bias router-force-load-balancing grouped-gemm use-grouped-tensor "
        "single-grouped-weight single-grouped-bias token-dropping enable-deepep "
        "permute-fusion-into-hybridep hybridep-pad-uneven-dispatch-inputs per-layer-logging "
        "pad-expert-input-to-capacity pad-experts-for-cuda-graph-inference layer-recompute "
        "permute-fusion router-fusion apply-probs-on-input ncclep-zero-copy paged-stash"
    ).split()
)
_MOE_VALUED = ("--num-experts", "--expert-tensor-parallel-size") + tuple(
    "--moe-" + name
    for name in (
        "shared-expert-intermediate-size shared-expert-glu-interleave-size layer-freq "
        "ffn-hidden-size router-load-balancing-type router-topk router-topk-limited-devices "
        "router-num-groups router-group-topk router-topk-scaling-factor router-score-function "
        "router-dtype router-bias-update-rate router-quantile-balancing-ema router-force-biased "
        "aux-loss-coeff z-loss-coeff input-jitter-eps token-dispatcher-type "
        "flex-dispatcher-backend expert-capacity-factor token-drop-policy latent-size "
        "flex-dispatcher-num-sms deepep-num-sms hybridep-num-sms hybridep-num-blocks-permute "
        "hybridep-num-blocks-unpermute hybridep-num-sms-preprocessing dispatch-fwd-dtype "
        "combine-bwd-dtype mlp-glu-interleave-size expert-rank-capacity-factor "
        "paged-stash-page-size paged-stash-buffer-size-factor-cuda "
        "paged-stash-buffer-size-factor-cpu"
    ).split()
)

UNBUILT: tuple[Unbuilt, ...] = (
    Unbuilt(
        "Mixture of Experts",
        "train a dense model: drop --num-experts and every --moe-* flag",
        _MOE_SWITCHES,
        _MOE_VALUED,
    ),
    Unbuilt(
        "sequence parallelism with tensor parallelism",
        "drop it: the data-parallel engines shard instead (--use-megatron-fsdp)",
        ("--sequence-parallel", "--tp-comm-overlap"),
    ),
    Unbuilt(
        "pipeline parallelism",
        "drop these flags and shard with --use-megatron-fsdp instead",
        ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
        (
            "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank",
            "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers",
            "--pipeline-model-parallel-layout",
        ),
    ),
    Unbuilt(
        "multi-latent attention",
        "use standard attention (optionally --group-query-attention): drop these flags",
        ("--multi-latent-attention",),
        (
            "--q-lora-rank",
            "--kv-lora-rank",
            "--qk-head-dim",
            "--qk-pos-emb-head-dim",
            "--v-head-dim",
            "--rotary-scaling-factor",
            "--mscale",
            "--mscale-all-dim",
        ),
    ),
    Unbuilt(
        "multi-token prediction",
        "drop these flags (one next-token head)",
        (),
        ("--mtp-num-layers", "--mtp-loss-scaling-factor"),
    ),
    Unbuilt(
        "windowed (sliding-window) attention",
        "drop these flags: attention is full causal",
        (),
        ("--window-size", "--window-attn-skip-freq"),
    ),
    Unbuilt(
        "gpt-oss model options",
        "drop these flags: the model is a standard GPT",
        ("--enable-gpt-oss", "--quick-geglu", "--export-force-local-attention"),
        ("--softmax-type", "--glu-linear-offset", "--activation-func-clamp-value"),
    ),
    Unbuilt(
        "hybrid Mamba models",
        "train a transformer: drop these flags",
        (),
        (
            "--hybrid-override-pattern",
            "--hybrid-attention-ratio",
            "--hybrid-mlp-ratio",
            "--mamba-state-dim",
            "--mamba-head-dim",
            "--mamba-num-groups",
            "--mamba-num-heads",
        ),
    ),
    Unbuilt(
        "experimental attention variants",
        "drop --experimental-attention-variant",
        (),
        ("--experimental-attention-variant",),
    ),
    Unbuilt(
        "CUDA graphs in the training loop",
        "drop these flags (tools/benchmark_fsdp.py --cuda-graph captures a benchmark step)",
        ("--enable-cuda-graph", "--external-cuda-graph"),
        ("--cuda-graph-impl", "--cuda-graph-scope", "--cuda-graph-warmup-steps"),
    ),
    Unbuilt(
        "the precision-aware optimizer",
        "drop these flags: main weights, gradients and Adam moments stay fp32",
        ("--use-precision-aware-optimizer",),
        ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"),
    ),
    Unbuilt("progress.txt (tokens and FLOPs per job)", "drop the flag", ("--log-progress",)),
    Unbuilt(
        "the straggler detector (nvidia-resiliency-ext)", "drop the flag", ("--log-straggler",)
    ),
    Unbuilt(
        "Chakra execution traces and NVTX ranges",
        "drop these flags (--profile --use-pytorch-profiler writes a torch.profiler trace)",
        ("--pytorch-profiler-collect-chakra", "--nvtx-ranges"),
    ),
    Unbuilt(
        "Megatron-LM's MultimodalTokenizer (--tokenizer-prompt-format)",
        "drop the flag",
        (),
        ("--tokenizer-prompt-format",),
    ),
)
"""Every refused feature, in the order its flags are listed in `--help`."""

PERFORMANCE_HINTS: tuple[tuple[str, str], ...] = (
    ("--use-nccl-ub", "nccl_ub"),
    ("--fsdp-double-buffer", "fsdp_double_buffer"),
    ("--fsdp-manual-registration", "fsdp_manual_registration"),
    ("--fsdp-db-use-persist-buf-on-alloc-fail", "fsdp_db_use_persist_buf_on_alloc_fail"),
    ("--megatron-fsdp-max-pool-double-buffer", "megatron_fsdp_max_pool_double_buffer"),
    ("--enable-experimental", "enable_experimental"),
)
"""Upstream switches (flag, dest) that only tune buffers or registration for speed, or enable
experimental code paths this project does not have: accepted and ignored, since no result
depends on them."""


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_unbuilt_args(parser: argparse.ArgumentParser) -> None:
    """The "not built" group: upstream flags refused by `validate_unbuilt`, and the accepted
    performance hints."""
    group = parser.add_argument_group(
        title="not built",
        description="Upstream Megatron-LM flags of features this project does not build: "
        "setting one is an error that says what to do instead.",
    )
    for unbuilt in UNBUILT:
        for flag in unbuilt.switches:
            group.add_argument(flag, action="store_true", help=f"Not built: {unbuilt.feature}.")
        for flag in unbuilt.valued:
            group.add_argument(flag, nargs="+", help=f"Not built: {unbuilt.feature}.")
    group.add_argument(
        "--rope-type",
        choices=("rope", "yarn"),
        help="rope: the RoPE of --position-embedding-type rope; yarn: not built.",
    )
    for flag, dest in PERFORMANCE_HINTS:
        group.add_argument(flag, action="store_true", dest=dest, help="Accepted; no effect here.")


def validate_unbuilt(args: argparse.Namespace) -> None:
    """Refuses the first feature any of whose flags is set, naming all of them that are.
    `--sequence-parallel` without tensor parallelism is turned off, as upstream does.

    Raises:
        ValueError: a flag of a feature that is not built is set.
    """
    if args.rope_type == "yarn":
        raise ValueError(
            "--rope-type yarn: YaRN RoPE scaling (multi-latent attention's) is not built in this "
            "project; use --rope-type rope (or --use-rope-scaling for Llama 3's)."
        )
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # As upstream: sequence parallelism splits what tensor parallelism shares, so without
        # it there is nothing to split and the flag changes no result.
        args.sequence_parallel = False
    for unbuilt in UNBUILT:
        given = [flag for flag in unbuilt.switches if getattr(args, _dest(flag))]
        given += [
            f"{flag} {' '.join(values)}"
            for flag in unbuilt.valued
            if (values := getattr(args, _dest(flag))) is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: {unbuilt.feature} is not built in this project; "
                f"{unbuilt.instead}."
            )
