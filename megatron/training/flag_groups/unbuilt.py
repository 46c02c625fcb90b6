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


UNBUILT: tuple[Unbuilt, ...] = (
    Unbuilt(
        "the flex token dispatcher (DeepEP / HybridEP / NCCL EP)",
        "use --moe-token-dispatcher-type alltoall (or allgather) and drop these flags",
        (
            "--moe-enable-deepep",
            "--moe-permute-fusion-into-hybridep",
            "--moe-hybridep-pad-uneven-dispatch-inputs",
            "--moe-ncclep-static-shape",
            "--moe-ncclep-zero-copy",
        ),
        (
            "--moe-flex-dispatcher-backend",
            "--moe-flex-dispatcher-num-sms",
            "--moe-deepep-num-sms",
            "--moe-hybridep-num-sms",
            "--moe-hybridep-num-blocks-permute",
            "--moe-hybridep-num-blocks-unpermute",
            "--moe-hybridep-num-sms-preprocessing",
            "--moe-expert-rank-capacity-factor",
        ),
    ),
    Unbuilt(
        "MoE quantization padding and low-precision token dispatch",
        "drop these flags: tokens are dispatched in the model's dtype, unpadded",
        ("--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8"),
        ("--moe-dispatch-fwd-dtype", "--moe-combine-bwd-dtype"),
    ),
    Unbuilt(
        "Transformer Engine grouped-tensor expert weights",
        "drop these flags: --moe-grouped-gemm runs the experts as grouped GEMMs over one "
        "stacked weight per projection",
        ("--moe-use-grouped-tensor", "--moe-single-grouped-weight", "--moe-single-grouped-bias"),
        ("--moe-mlp-glu-interleave-size", "--moe-shared-expert-glu-interleave-size"),
    ),
    Unbuilt(
        "overlapping the MoE token exchange with computation",
        "drop these flags: the shared experts run before the router, and the token exchange "
        "is not overlapped",
        ("--moe-shared-expert-overlap", "--overlap-moe-expert-parallel-comm"),
    ),
    Unbuilt(
        "upstream's switch for recomputing MoE layers",
        "use --recompute-granularity selective --recompute-modules moe",
        ("--moe-layer-recompute",),
    ),
    Unbuilt(
        "an fp32 residual stream",
        "drop the flag: the residual stream is in the parameters' dtype",
        ("--fp32-residual-connection",),
    ),
    Unbuilt(
        "distributing the saved inputs of recomputed layers over tensor-parallel ranks",
        "drop the flag (with --sequence-parallel those inputs are split over the ranks already)",
        ("--distribute-saved-activations",),
    ),
    Unbuilt(
        "MoE latent projections",
        "drop the flag: the experts work at --hidden-size",
        (),
        ("--moe-latent-size",),
    ),
    Unbuilt(
        "the MoE paged stash",
        "drop these flags",
        ("--moe-paged-stash",),
        (
            "--moe-paged-stash-page-size",
            "--moe-paged-stash-buffer-size-factor-cuda",
            "--moe-paged-stash-buffer-size-factor-cpu",
        ),
    ),
    Unbuilt(
        "upcycling a dense checkpoint into an MoE model",
        "drop these flags and train the MoE model from scratch",
        ("--moe-use-upcycling",),
        ("--moe-upcycling-granularity",),
    ),
    Unbuilt(
        "an MoE routing option (routing replay, token dropping without a capacity, biased or "
        "quantile-balanced routing, device-limited top-k, probabilities on the expert input, "
        "or CUDA-graph inference padding)",
        "drop them (for device-limited routing use --moe-router-num-groups with "
        "--moe-router-group-topk; for dropping, --moe-expert-capacity-factor)",
        (
            "--moe-enable-routing-replay",
            "--moe-token-dropping",
            "--moe-apply-probs-on-input",
            "--moe-pad-experts-for-cuda-graph-inference",
        ),
        (
            "--moe-router-topk-limited-devices",
            "--moe-router-force-biased",
            "--moe-router-quantile-balancing-ema",
        ),
    ),
    Unbuilt(
        "tensor-parallel communication overlap (Transformer Engine userbuffers)",
        "drop it: tensor-parallel collectives run unoverlapped",
        ("--tp-comm-overlap",),
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
        "per-layer CUDA graphs",
        "use --cuda-graph-impl full_iteration (the whole training iteration in one graph)",
        ("--enable-cuda-graph", "--external-cuda-graph"),
        ("--cuda-graph-modules",),
    ),
    Unbuilt(
        "the precision-aware optimizer",
        "drop these flags: main weights, gradients and Adam moments stay fp32",
        ("--use-precision-aware-optimizer",),
        ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"),
    ),
    Unbuilt(
        "checkpoints without the optimizer or RNG states",
        "drop these flags: a checkpoint holds both, and --no-load-optim and --no-load-rng skip "
        "them when loading",
        ("--no-save-optim", "--no-save-rng"),
    ),
    Unbuilt(
        "asynchronous and non-persistent (local) checkpoints",
        "drop these flags: --save-interval saves to --save, synchronously",
        ("--async-save", "--use-persistent-ckpt-worker"),
        (
            "--non-persistent-save-interval",
            "--non-persistent-ckpt-type",
            "--non-persistent-global-ckpt-dir",
            "--non-persistent-local-ckpt-dir",
            "--non-persistent-local-ckpt-algo",
        ),
    ),
    Unbuilt(
        "model flags taken from the checkpoint",
        "pass the model flags on the command line (tools/convert_hf.py --flags-file writes "
        "them for an import); loading refuses, by name, flags that differ from the "
        "checkpoint's",
        (
            "--use-checkpoint-args",
            "--use-mp-args-from-checkpoint-args",
            "--use-tokenizer-model-from-checkpoint-args",
        ),
    ),
    Unbuilt(
        "data paths read from files, and object-storage data",
        "give the datasets on the command line (--data-path, or --train-data-path, "
        "--valid-data-path and --test-data-path), on a file system",
        (),
        ("--data-args-path", "--per-split-data-args-path", "--object-storage-cache-path"),
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
)
"""Every refused feature of training (and `TOKENIZER_UNBUILT`), in the order its flags are
listed in `--help`."""

TOKENIZER_UNBUILT: tuple[Unbuilt, ...] = (
    Unbuilt(
        "Megatron-LM's MultimodalTokenizer (--tokenizer-prompt-format)",
        "drop the flag",
        (),
        ("--tokenizer-prompt-format",),
    ),
    Unbuilt(
        "remote code of HuggingFace tokenizers",
        "drop the flag: tokenizers load from local files and never run remote code",
        ("--trust-remote-code",),
    ),
    Unbuilt(
        "slow or special-token-free HuggingFace tokenizers",
        "drop these flags: HuggingFaceTokenizer loads the fast tokenizer and adds its special "
        "tokens (upstream's defaults)",
        ("--tokenizer-hf-no-use-fast", "--tokenizer-hf-no-include-special-tokens"),
    ),
    Unbuilt(
        "chat templates and tokenizer metadata files",
        "drop these flags: GPT pretraining tokenizes plain text with the tokenizer's files",
        (),
        ("--chat-template", "--tokenizer-metadata"),
    ),
    Unbuilt(
        "SentencePiece's legacy and whitespace options",
        "drop these flags: SentencePiece models encode with the settings they were trained with",
        (
            "--tokenizer-sentencepiece-legacy",
            "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        ),
    ),
)
"""Refused tokenizer features: flags of both `pretrain_gpt.py` and `tools/preprocess_data.py`."""

PERFORMANCE_HINTS: tuple[tuple[str, str], ...] = (
    ("--use-nccl-ub", "nccl_ub"),
    ("--fsdp-double-buffer", "fsdp_double_buffer"),
    ("--fsdp-manual-registration", "fsdp_manual_registration"),
    ("--fsdp-db-use-persist-buf-on-alloc-fail", "fsdp_db_use_persist_buf_on_alloc_fail"),
    ("--megatron-fsdp-max-pool-double-buffer", "megatron_fsdp_max_pool_double_buffer"),
    ("--enable-experimental", "enable_experimental"),
    ("--ckpt-fully-parallel-load", "ckpt_fully_parallel_load"),
    ("--ckpt-assume-constant-structure", "ckpt_assume_constant_structure"),
)
"""Upstream switches (flag, dest) that only tune buffers, registration or checkpoint loading
for speed, or enable experimental code paths this project does not have: accepted and ignored,
since no result depends on them."""


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_unbuilt_flags(
    parser: argparse.ArgumentParser,
    features: tuple[Unbuilt, ...],
    listed_in: str = "docs/flags.md ('Not built: refused by name')",
) -> argparse._ArgumentGroup:
    """Adds a "not built" group of the flags of `features` (`refuse_unbuilt` refuses them),
    left out of `--help` and the usage, where they would outnumber the built flags; returns
    the group, whose description says they exist and that `listed_in` (a docs page) lists them."""
    group = parser.add_argument_group(
        title="not built",
        description=f"{sum(len(u.switches) + len(u.valued) for u in features)} upstream "
        "Megatron-LM flags of features this project does not build are recognised but not "
        f"listed here; {listed_in} lists them. Setting one is an error that names the feature "
        "and says what to do instead.",
    )
    for unbuilt in features:
        for flag in unbuilt.switches:
            group.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        for flag in unbuilt.valued:
            group.add_argument(flag, nargs="+", help=argparse.SUPPRESS)
    return group


def unbuilt_dests(features: tuple[Unbuilt, ...]) -> frozenset[str]:
    """The argument names (dests) of the flags of `features`."""
    return frozenset(_dest(flag) for u in features for flag in (*u.switches, *u.valued))


def refuse_unbuilt(args: argparse.Namespace, features: tuple[Unbuilt, ...]) -> None:
    """Refuses the first of `features` any of whose flags is set, naming all of them that are.

    Raises:
        ValueError: a flag of a feature that is not built is set.
    """
    for unbuilt in features:
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


def add_unbuilt_args(parser: argparse.ArgumentParser) -> None:
    """The "not built" group: upstream flags refused by `validate_unbuilt`, and the accepted
    performance hints."""
    group = add_unbuilt_flags(parser, UNBUILT + TOKENIZER_UNBUILT)
    group.add_argument(
        "--rope-type",
        choices=("rope", "yarn"),
        help="rope: the RoPE of --position-embedding-type rope; yarn: not built.",
    )
    for flag, dest in PERFORMANCE_HINTS:
        group.add_argument(flag, action="store_true", dest=dest, help="Accepted; no effect here.")


def validate_unbuilt(args: argparse.Namespace) -> None:
    """Refuses the first feature any of whose flags is set, naming all of them that are.

    Raises:
        ValueError: a flag of a feature that is not built is set.
    """
    if args.rope_type == "yarn":
        raise ValueError(
            "--rope-type yarn: YaRN RoPE scaling (multi-latent attention's) is not built in this "
            "project; use --rope-type rope (or --use-rope-scaling for Llama 3's)."
        )
    refuse_unbuilt(args, UNBUILT + TOKENIZER_UNBUILT)
