"""Flags of Megatron-LM features this project does not build, refused by name.

A launch script written for upstream Megatron-LM parses here: each flag below is accepted with
upstream's name, and `validate_unbuilt` refuses every one that is set (a value given, or a switch
turned on) with an error that names the feature, the flags that asked for it and what to do
instead; each feature whose flags are set is named in the one error message. Nothing here is
silently ignored: the flags with no effect on any result here (speed hints, or asking for what
this project always does) are in `PERFORMANCE_HINTS` and `VALUED_HINTS` and documented as no-ops
in `docs/flags.md`.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron.training.flag_errors import FlagErrors


@dataclasses.dataclass(frozen=True)
class Unbuilt:
    """A feature that is not built, and the flags that ask for it.

    Attributes:
        feature: what the flags ask for, as a user would name it.
        instead: what to do instead.
        switches: flags that take no value (`store_true`).
        valued: flags that take one or more values.
        values: built flags (defined in their own flag groups) and the values of each that ask
            for the feature; their other values are built.
    """

    feature: str
    instead: str
    switches: tuple[str, ...] = ()
    valued: tuple[str, ...] = ()
    values: tuple[tuple[str, tuple[str, ...]], ...] = ()


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
            "--moe-flex-dispatcher-num-sms",
            "--moe-deepep-num-sms",
            "--moe-hybridep-num-sms",
            "--moe-hybridep-num-blocks-permute",
            "--moe-hybridep-num-blocks-unpermute",
            "--moe-hybridep-num-sms-preprocessing",
            "--moe-expert-rank-capacity-factor",
        ),
        # Upstream reads --moe-flex-dispatcher-backend only with the flex dispatcher, and
        # refuses ncclep without it; deepep and hybridep under allgather or alltoall change
        # nothing there, nor here.
        (
            ("--moe-token-dispatcher-type", ("flex",)),
            ("--moe-flex-dispatcher-backend", ("ncclep",)),
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
        "overlapping the MoE token exchange, or delayed weight gradients, with computation",
        "drop these flags: the shared experts run before the router, and the token exchange "
        "is not overlapped",
        (
            "--moe-shared-expert-overlap",
            "--overlap-moe-expert-parallel-comm",
            "--delay-wgrad-compute",
            "--overlap-dispatch-backward-with-experts-wgrad",
            "--ep-overlap-early-attn-memory-release",
            "--high-priority-a2a-comm-stream",
        ),
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
        "drop these flags: tensor-parallel collectives run unoverlapped",
        (
            "--tp-comm-overlap",
            "--tp-comm-overlap-rs-dgrad",
            "--no-tp-comm-bulk-wgrad",
            "--disable-tp-comm-bulk-wgrad",
            "--no-tp-comm-bulk-dgrad",
            "--disable-tp-comm-bulk-dgrad",
            "--no-tp-comm-overlap-ag",
            "--disable-tp-comm-overlap-ag",
            "--no-tp-comm-overlap-rs",
            "--disable-tp-comm-overlap-rs",
            "--no-tp-comm-split-ag",
            "--disable-tp-comm-split-ag",
            "--no-tp-comm-split-rs",
            "--disable-tp-comm-split-rs",
        ),
        ("--tp-comm-overlap-cfg", "--tp-comm-bootstrap-backend"),
    ),
    Unbuilt(
        "pipeline parallelism's microbatch groups and explicit layouts, the overlap's warm-up "
        "flush, ring p2p and deferred wgrads",
        "drop these flags: --pipeline-model-parallel-size runs 1F1B (interleaved with virtual "
        "stages) with batched p2p",
        (
            "--overlap-p2p-communication-warmup-flush",
            "--use-ring-exchange-p2p",
            "--defer-embedding-wgrad-compute",
            "--no-align-grad-reduce",
            "--disable-align-grad-reduce",
            "--no-align-param-gather",
        ),
        (
            "--microbatch-group-size-per-virtual-pipeline-stage",
            "--wgrad-deferral-limit",
            "--pipeline-model-parallel-comm-backend",
            "--pipeline-model-parallel-layout",
        ),
    ),
    Unbuilt(
        "multi-latent attention's latent cache for inference and its fused down-projection "
        "(Transformer Engine's)",
        "drop these flags: --multi-latent-attention trains with the unfused projections",
        ("--cache-mla-latents", "--mla-down-proj-fusion"),
    ),
    Unbuilt(
        "multi-token prediction variants (standalone stages, one repeated layer, detached heads, "
        "hidden-state mixing, hybrid patterns)",
        "drop these flags: --mtp-num-layers builds one layer per depth, trained with the model",
        ("--mtp-standalone", "--mtp-use-repeated-layer", "--mtp-detach-heads", "--mtp-hsm"),
        ("--mtp-hybrid-override-pattern",),
    ),
    Unbuilt(
        "hybrid Mamba and linear-attention (gated delta) models",
        "train a transformer: drop these flags",
        ("--is-hybrid-model", "--disable-mamba-mem-eff-path", "--gdp-cutedsl-kernel"),
        (
            "--hybrid-layer-pattern",
            "--mamba-inference-conv-states-dtype",
            "--mamba-inference-ssm-states-dtype",
            "--mamba-training-ssm-states-dtype",
            "--gdp-num-householder",
            "--gdp-num-chunk-states-to-recompute",
            "--linear-attention-freq",
            "--linear-conv-kernel-dim",
            "--linear-key-head-dim",
            "--linear-value-head-dim",
            "--linear-num-key-heads",
            "--linear-num-value-heads",
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
        "experimental attention variants (DeepSeek sparse attention, attention output gates)",
        "drop these flags: attention is standard softmax attention over every key",
        (
            "--attention-output-gate",
            "--dsa-indexer-rope-interleaved",
            "--dsa-indexer-k-norm-fp32",
            "--dsa-indexer-use-sparse-loss",
            "--no-dsa-indexer-rotate-activation",
            "--disable-dsa-indexer-rotate-activation",
            "--no-dsa-indexer-scoring-relu",
            "--disable-dsa-indexer-scoring-relu",
        ),
        (
            "--experimental-attention-variant",
            "--dsa-indexer-n-heads",
            "--dsa-indexer-head-dim",
            "--dsa-indexer-topk",
            "--dsa-indexer-topk-freq",
            "--dsa-indexer-skip-topk-offset",
            "--dsa-indexer-loss-coeff",
            "--dsa-indexer-k-norm-epsilon",
            "--dsa-kernel-backend",
        ),
    ),
    Unbuilt(
        "RoPE skipped on some layers, and multimodal RoPE sections",
        "drop these flags: every layer applies the same position embedding",
        (),
        ("--no-rope-freq", "--mrope-section"),
    ),
    Unbuilt(
        "per-layer CUDA graphs",
        "use --cuda-graph-impl full_iteration (the whole training iteration in one graph)",
        ("--enable-cuda-graph", "--external-cuda-graph", "--optimizer-cuda-graph"),
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
        (
            "--async-save",
            "--use-persistent-ckpt-worker",
            "--async-ckpt-use-cpu-shm",
            "--replication",
        ),
        (
            "--async-strategy",
            "--async-ckpt-cpu-priority",
            "--async-ckpt-io-priority",
            "--dist-ckpt-workers",
            "--replication-jump",
            "--replication-factor",
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
        ("--enable-msc",),
        (
            "--data-args-path",
            "--per-split-data-args-path",
            "--per-dataset-sequences-path",
            "--object-storage-cache-path",
        ),
    ),
    Unbuilt("progress.txt (tokens and FLOPs per job)", "drop the flag", ("--log-progress",)),
    Unbuilt(
        "the straggler detector (nvidia-resiliency-ext)",
        "drop these flags",
        ("--log-straggler", "--disable-straggler-on-startup"),
        ("--straggler-ctrlr-port", "--straggler-minmax-count"),
    ),
    Unbuilt(
        "Chakra execution traces and NVTX ranges",
        "drop these flags (--profile --use-pytorch-profiler writes a torch.profiler trace)",
        ("--pytorch-profiler-collect-chakra", "--nvtx-ranges"),
    ),
    Unbuilt(
        "memory, energy, attention-logit and config logging, and MoE routing traces",
        "drop these flags (--log-memory-to-tensorboard logs the memory allocator's statistics)",
        (
            "--log-device-memory-used",
            "--log-energy",
            "--log-max-attention-logit",
            "--moe-routing-trace-capture-logits",
            "--moe-routing-trace-capture-hidden-states",
            "--moe-routing-trace-dump-weights",
        ),
        (
            "--log-memory-interval",
            "--config-logger-dir",
            "--moe-routing-trace-path",
            "--moe-routing-trace-max-training-iters",
        ),
    ),
    Unbuilt(
        "run monitors and trackers (weight-hash checks across data-parallel replicas, GPU "
        "sniff tests, the workload inspector, ADLR autoresume, one-logger, OpenTelemetry)",
        "drop these flags",
        (
            "--run-workload-inspector-server",
            "--adlr-autoresume",
            "--no-one-logger",
            "--one-logger-async",
            "--otel-enabled",
        ),
        (
            "--check-weight-hash-across-dp-replicas-interval",
            "--gpu-sniff-test-interval",
            "--adlr-autoresume-interval",
            "--one-logger-project",
            "--one-logger-run-name",
            "--app-tag-run-name",
            "--app-tag-run-version",
            "--otel-service-name",
            "--otel-span-groups",
        ),
    ),
    Unbuilt(
        "in-process restart, the fault-tolerance package and fault injection "
        "(nvidia-resiliency-ext)",
        "drop these flags: a failed job is restarted by its launcher and resumes from --load",
        (
            "--inprocess-restart",
            "--inprocess-empty-cuda-cache",
            "--enable-ft-package",
            "--calc-ft-timeouts",
        ),
        (
            "--inprocess-max-iterations",
            "--inprocess-monitor-thread-interval",
            "--inprocess-monitor-process-interval",
            "--inprocess-progress-watchdog-interval",
            "--inprocess-heartbeat-interval",
            "--inprocess-soft-timeout",
            "--inprocess-hard-timeout",
            "--inprocess-heartbeat-timeout",
            "--inprocess-barrier-timeout",
            "--inprocess-completion-timeout",
            "--inprocess-last-call-wait",
            "--inprocess-termination-grace-time",
            "--inprocess-granularity",
            "--inprocess-active-world-size",
            "--ft-num-warmup-iters",
            "--fault-injector-ranks",
            "--fault-injector-num-ranks",
            "--fault-injector-fault-types",
            "--fault-injector-fault-probabilities",
            "--fault-injector-fault-delay",
            "--fault-injector-delay-start-iteration",
            "--fault-injector-mtti-seconds",
            "--fault-injector-offset-seconds",
            "--fault-injector-seed",
        ),
    ),
    Unbuilt(
        "the rerun state machine (re-running iterations to validate results, spiky-loss and "
        "large-gradient checks, error injection, skipped iterations)",
        "drop these flags (or pass --rerun-mode disabled): a NaN or infinite loss or gradient "
        "norm stops the run (--check-for-nan-in-loss-and-grad)",
        ("--check-for-large-grads", "--check-for-spiky-loss"),
        (
            "--error-injection-rate",
            "--error-injection-type",
            "--iterations-to-skip",
            "--result-rejected-tracker-filename",
        ),
    ),
    Unbuilt(
        "training-loop options (shrinking the batch to fit, frozen layers, batch-size phases, "
        "CPU-GPU synchronization intervals, per-parameter optimizer groups from a file, "
        "dataloader and training signal handlers, real-time tests)",
        "drop these flags (for a clean stop on a signal use --exit-signal-handler; for batch "
        "sizes that change, --step-batch-size-schedule)",
        (
            "--decrease-batch-size-if-needed",
            "--freeze-all-layers",
            "--exit-signal-handler-for-dataloader",
            "--exit-signal-handler-for-training",
            "--test-mode",
        ),
        (
            "--phase-transition-iterations",
            "--train-sync-interval",
            "--dump-param-to-param-group-map",
        ),
    ),
    Unbuilt(
        "evaluation options (another batch size, a late start, evaluation only, full or "
        "several validation sets)",
        "drop these flags: evaluation runs every --eval-interval iterations on --eval-iters "
        "batches of the training batch size",
        ("--skip-train", "--full-validation", "--multiple-validation-sets"),
        (
            "--eval-global-batch-size",
            "--eval-micro-batch-size",
            "--start-eval-at-iter",
            "--validation-set-names",
        ),
    ),
    Unbuilt(
        "checkpoint retention (deleting all but every Nth checkpoint)",
        "drop the flag: every checkpoint saved is kept; delete the iter_N directories you do "
        "not need yourself",
        (),
        ("--save-retain-interval",),
    ),
    Unbuilt(
        "checkpoint options (conversion while training, a new iteration number, main weights "
        "without the optimizer, tensor dumps, parallelization-group caches, pre-0.14 and "
        "Transformer Engine extra-state formats, partial Megatron-FSDP loads)",
        "drop these flags (tools/convert_checkpoint.py converts checkpoints)",
        (
            "--ckpt-convert-update-legacy-dist-opt-format",
            "--load-main-params-from-ckpt",
            "--ckpt-pg-tensors-cache-create",
            "--dist-ckpt-save-pre-mcore-014",
            "--ckpt-drop-redundant-extra-state",
            "--no-strict-fsdp-dtensor-load",
            "--disable-strict-fsdp-dtensor-load",
        ),
        (
            "--ckpt-convert-format",
            "--ckpt-convert-save",
            "--override-ckpt-iteration",
            "--save-params-interval",
            "--save-activations-interval",
            "--save-tokens-per-expert-interval",
            "--save-wgrads-interval",
            "--save-dgrads-interval",
            "--ckpt-pg-tensors-cache-path",
        ),
    ),
    Unbuilt(
        "initialization options (none, on the CPU, different per data-parallel rank, Xavier, "
        "a separate embedding scale, Transformer Engine's RNG tracker)",
        "drop these flags: weights initialize from --init-method-std and --seed, identically on "
        "every data-parallel rank",
        (
            "--no-initialization",
            "--use-cpu-initialization",
            "--data-parallel-random-init",
            "--init-method-xavier-uniform",
            "--te-rng-tracker",
        ),
        ("--embedding-init-method-std",),
    ),
    Unbuilt(
        "CPU offloading of activations and optimizer state",
        "drop these flags: activations and optimizer state stay on the device (to save memory "
        "use --recompute-granularity, or shard with --use-megatron-fsdp)",
        (
            "--cpu-offloading-retain-pinned-cpu-buffers",
            "--fine-grained-activation-offloading",
            "--delay-offload-until-cuda-graph",
            "--optimizer-cpu-offload",
            "--use-torch-optimizer-for-cpu-offload",
            "--overlap-cpu-optimizer-d2h-h2d",
            "--no-pin-cpu-grads",
            "--no-pin-cpu-params",
        ),
        (
            "--cpu-offloading-num-layers",
            "--offload-modules",
            "--min-offloaded-tensor-size",
            "--delta-offload-bytes-across-pp-ranks",
            "--activation-offload-fraction",
            "--fine-grained-offloading-max-inflight-offloads",
            "--optimizer-offload-fraction",
        ),
    ),
    Unbuilt(
        "hierarchical and hybrid context parallelism",
        "drop these flags and split sequences with --context-parallel-size and --cp-comm-type "
        "p2p, a2a or allgather",
        ("--hybrid-context-parallel",),
        ("--hierarchical-context-parallel-sizes", "--max-seqlen-per-dp-cp-rank"),
    ),
    Unbuilt(
        "generalized tensor parallelism (weight rematerialization over extra shards)",
        "drop these flags and shard with --tensor-model-parallel-size or --use-megatron-fsdp",
        (
            "--gtp-remat-nccl-ub",
            "--gtp-expert-remat-nccl-ub",
            "--gtp-remat-reduce-scatter-with-fp32-accumulation",
        ),
        (
            "--tensor-parallel-num-weight-shards",
            "--expert-tensor-parallel-num-weight-shards",
            "--gtp-remat-opt-in-modules",
        ),
    ),
    Unbuilt(
        "DDP engine options (a bucket count, low-precision reduce-scatters with fp32 "
        "accumulation, fp32 local accumulation by name, an unfused gradient division)",
        "drop these flags (--ddp-bucket-size sizes the buckets; --grad-reduce-in-fp32 reduces "
        "gradients in fp32)",
        ("--ddp-reduce-scatter-with-fp32-accumulation", "--no-gradient-reduce-div-fusion"),
        ("--ddp-num-buckets", "--ddp-param-name-patterns-for-fp32-local-accumulation"),
    ),
    Unbuilt(
        "PyTorch FSDP2 and upstream's Megatron-FSDP versions and HSDP full sharding",
        "use --use-megatron-fsdp (with --outer-dp-sharding-strategy optim to shard across the "
        "outer replicas too) and drop these flags",
        (
            "--use-torch-fsdp2",
            "--torch-fsdp2-no-reshard-after-forward",
            "--enable-full-sharding-in-hsdp",
        ),
        ("--megatron-fsdp-version",),
    ),
    Unbuilt(
        "process-group options (SHARP, NCCL communicator configs, high-priority streams, no "
        "gloo groups, fake or lazily initialized groups, a timeout after initialization)",
        "drop these flags (--distributed-timeout-minutes sets the collectives' timeout)",
        ("--use-sharp", "--disable-gloo-process-groups", "--fake-process-group", "--lazy-mpu-init"),
        (
            "--sharp-enabled-group",
            "--nccl-communicator-config-path",
            "--high-priority-stream-groups",
            "--distributed-timeout-seconds-after-init",
        ),
    ),
    Unbuilt(
        "the NCCL flight recorder settings",
        "drop these flags and set PyTorch's TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_FR_DUMP_TEMP_FILE "
        "and related environment variables instead",
        (
            "--flight-recorder-include-stack-trace",
            "--no-flight-recorder-dump-on-timeout",
            "--disable-flight-recorder-dump-on-timeout",
            "--no-flight-recorder-include-only-active",
            "--disable-flight-recorder-include-only-active",
            "--no-flight-recorder-extra-dump-on-exec",
            "--disable-flight-recorder-extra-dump-on-exec",
        ),
        ("--flight-recorder-dump-path", "--flight-recorder-trace-buffer-size"),
    ),
    Unbuilt(
        "a Transformer Engine, Kitchen or kernel option (per-module precision configs, TE "
        "activations and its operation fuser, grouped GEMMs for dense MLPs and shared experts, "
        "fused squared-ReLU and residual-RMSNorm kernels, batch-invariant kernels, a pinned "
        "FlashAttention version, chunked MLPs, fp16 or other logit dtypes, OpenAI's GeLU, ONNX "
        "workarounds)",
        "drop these flags",
        (
            "--use-te-activation-func",
            "--use-transformer-engine-op-fuser",
            "--use-grouped-gemm-for-dense-mlp",
            "--use-grouped-gemm-for-shared-expert",
            "--use-fused-weighted-squared-relu",
            "--fused-residual-rmsnorm",
            "--use-kitchen-attention",
            "--batch-invariant-mode",
            "--fp16-lm-cross-entropy",
            "--openai-gelu",
        ),
        (
            "--te-precision-config-file",
            "--kitchen-attention-backend",
            "--kitchen-config-file",
            "--kitchen-recipe-number",
            "--flash-attention-version",
            "--batch-invariant-backend",
            "--mlp-chunks-for-training",
            "--output-logit-dtype",
            "--onnx-safe",
        ),
    ),
    Unbuilt(
        "Muon and Lion optimizers, and QK clipping",
        "use --optimizer adam or sgd and drop these flags",
        (
            "--muon-no-split-qkv",
            "--muon-nesterov",
            "--muon-use-syrk",
            "--qk-clip",
            "--no-use-layer-wise-param-layout",
        ),
        (
            "--muon-momentum",
            "--muon-scale-mode",
            "--muon-fp32-matmul-prec",
            "--muon-coefficient-type",
            "--muon-num-ns-steps",
            "--muon-tp-mode",
            "--muon-extra-scale-factor",
            "--muon-scalar-optimizer",
            "--lion-beta1",
            "--lion-beta2",
            "--qk-clip-alpha",
            "--qk-clip-threshold",
        ),
    ),
    Unbuilt(
        "maximal update parameterization (muP)",
        "drop these flags: learning rates and initialization do not scale with width",
        ("--use-mup",),
        (
            "--mup-width-mult",
            "--mup-base-hidden-size",
            "--mup-embedding-mult",
            "--mup-output-mult",
            "--mup-base-head-dim",
            "--mup-attn-scale-power",
        ),
    ),
    Unbuilt(
        "manifold-constrained hyper-connections (mHC)",
        "drop these flags: each layer has one residual stream",
        ("--enable-mhc-connections",),
        (
            "--mhc-num-residual-streams",
            "--mhc-sinkhorn-iterations",
            "--mhc-init-gating-factor",
            "--mhc-recompute-layer-num",
        ),
    ),
    Unbuilt(
        "custom layer specs, YAML configs and heterogeneous layers",
        "describe the model with flags: every layer is the same GPT layer",
        (),
        (
            "--spec",
            "--yaml-cfg",
            "--heterogeneous-layers-config-path",
            "--heterogeneous-layers-config-encoded-json",
        ),
    ),
    Unbuilt(
        "vocabulary padding options",
        "drop these flags: the vocabulary is padded to a multiple of "
        "--make-vocab-size-divisible-by x --tensor-model-parallel-size",
        ("--no-pad-vocab-size", "--disable-pad-vocab-size"),
    ),
    Unbuilt(
        "text generation and inference (the inference engines, dynamic batching, inference "
        "CUDA graphs and kernels)",
        "drop these flags: this project trains (pretrain_gpt.py) and has no inference engine",
        (
            "--use-legacy-static-engine",
            "--inference-dynamic-batching",
            "--inference-dynamic-batching-track-paused-request-events",
            "--inference-dynamic-batching-track-generated-token-events",
            "--decode-only-cuda-graphs",
            "--inference-cuda-graph-all-prefills",
            "--enable-chunked-prefill",
            "--use-same-sampling-seed-across-dp-ranks",
            "--inference-disable-triton-nvls-kernels",
            "--inference-fuse-tp-communication",
            "--inference-moe-disable-fused-quant-kernels",
            "--inference-rng-tracker",
            "--flash-decode",
            "--nccl-all-reduce-for-prefill",
        ),
        (
            "--inference-batch-times-seqlen-threshold",
            "--max-tokens-to-oom",
            "--inference-max-requests",
            "--inference-max-seq-length",
            "--inference-dynamic-batching-buffer-size-gb",
            "--inference-dynamic-batching-paused-buffer-size-gb",
            "--inference-dynamic-batching-mamba-memory-ratio",
            "--inference-dynamic-batching-block-size",
            "--inference-dynamic-batching-max-requests",
            "--inference-dynamic-batching-max-tokens",
            "--inference-dynamic-batching-num-cuda-graphs",
            "--inference-cuda-graph-max-tokens",
            "--inference-dynamic-batching-unified-memory-level",
            "--num-speculative-tokens",
            "--inference-dynamic-batching-prefix-caching",
            "--inference-dynamic-batching-prefix-caching-eviction-policy",
            "--inference-dynamic-batching-prefix-caching-coordinator-policy",
            "--inference-dynamic-batching-prefix-caching-routing-alpha",
            "--inference-dynamic-batching-prefix-caching-mamba-gb",
            "--inference-dynamic-batching-cuda-graph-mixed-prefill-count",
            "--inference-dynamic-batching-cuda-graph-sizing-distribution",
            "--inference-dynamic-batching-sampling-backend",
            "--inference-dynamic-batching-async-sched-mode",
            "--inference-dynamic-batching-logprobs-mode",
            "--inference-logging-step-interval",
            "--inference-text-gen-server-logging",
            "--inference-wandb-logging",
            "--inference-coordinator-port",
            "--inference-use-synchronous-zmq-collectives",
            "--inference-disable-ep-consensus",
            "--inference-shards",
            "--inference-cuda-graph-scope",
            "--inference-grouped-gemm-backend",
            "--inference-moe-token-dispatcher-type",
            "--symmetric-ar-type",
            "--mlp-chunks-for-prefill",
        ),
    ),
    Unbuilt(
        "reinforcement learning (GRPO)",
        "drop these flags: pretrain_gpt.py pretrains with the language-model loss",
        (
            "--perform-rl-step",
            "--grpo-filter-groups-with-same-reward",
            "--rl-durable-rollout-bank",
            "--rl-offload-optimizer-during-inference",
            "--rl-profile",
        ),
        (
            "--rl-prompts-per-eval",
            "--grpo-prompts-per-step",
            "--grpo-group-size",
            "--rl-generation-lag",
            "--rl-max-inflight-requests",
            "--rl-submission-granularity",
            "--rl-consumption-granularity",
            "--rl-rollout-bank-dir",
            "--rl-rollout-bank-max-bytes",
            "--grpo-iterations",
            "--grpo-clamp-eps-lower",
            "--grpo-clamp-eps-upper",
            "--grpo-kl-beta",
            "--grpo-entropy-term-weight",
            "--langrl-env-config",
            "--rl-default-temperature",
            "--rl-default-top-p",
            "--rl-default-top-k",
            "--rl-kv-cache-management-mode",
            "--rl-persist-cuda-graphs",
            "--rl-partial-rollouts",
            "--rl-inference-logprobs-is-correction",
            "--rl-importance-sampling-truncation-coef",
            "--rl-use-sequence-packing",
            "--rl-sequence-packing-max-sequences-per-bin",
            "--rl-sequence-packing-algo",
            "--rl-training-cuda-graphs",
            "--rl-inference-tensor-model-parallel-size",
            "--rl-inference-pipeline-model-parallel-size",
            "--rl-inference-expert-model-parallel-size",
            "--rl-inference-expert-tensor-model-parallel-size",
            "--rl-inference-model-unified-memory-level",
            "--rl-offload-inference-model-weights-when-idle",
            "--refit-method",
            "--rl-verify-model-weights-swap",
            "--rl-skip-bos-token",
            "--rl-profile-dir",
            "--rl-inference-parsers",
        ),
    ),
    Unbuilt(
        "supervised finetuning (SFT) and fill-in-the-middle (FIM) datasets, and document-"
        "masked attention",
        "drop these flags: GPT datasets are plain documents, packed into --seq-length samples",
        ("--sft", "--fim-data", "--dataloader-inter-document-masking"),
        (
            "--sft-tokenizer-prompt-format",
            "--fim-rate",
            "--fim-spm-rate",
            "--fim-split-sample",
            "--fim-fragment-rate",
            "--fim-no-prefix",
            "--fim-prefix-token",
            "--fim-middle-token",
            "--fim-suffix-token",
            "--fim-pad-token",
            "--fim-eod-token",
        ),
    ),
    Unbuilt(
        "logits distillation",
        "drop these flags: the loss is the language-model loss on the data's next tokens",
        ("--logits-load-ignore-errors",),
        (
            "--logits-save-top-k",
            "--logits-save-top-p",
            "--logits-save-top-p-min-k",
            "--logits-save-dir",
            "--logits-save-dtype",
            "--logits-load-dir",
            "--logits-load-decode-threads",
            "--logits-load-prefetch-factor",
            "--logits-load-msc-prefetch-depth",
            "--logits-load-kd-loss-alpha",
        ),
    ),
    Unbuilt(
        "BERT, T5 and retrieval (ICT, REALM, biencoder) models",
        "drop these flags: pretrain_gpt.py trains a decoder-only GPT",
        (
            "--bert-no-binary-head",
            "--output-bert-embeddings",
            "--biencoder-shared-query-context-model",
            "--use-one-sent-docs",
            "--retriever-score-scaling",
        ),
        (
            "--bert-embedder-type",
            "--bert-load",
            "--encoder-num-layers",
            "--decoder-num-layers",
            "--encoder-seq-length",
            "--decoder-seq-length",
            "--sample-rate",
            "--mask-prob",
            "--short-seq-prob",
            "--relative-attention-num-buckets",
            "--relative-attention-max-distance",
            "--ict-head-size",
            "--biencoder-projection-dim",
            "--ict-load",
            "--titles-data-path",
            "--query-in-block-prob",
            "--evidence-data-path",
            "--retriever-report-topk-accuracies",
            "--block-data-path",
            "--embedding-path",
            "--indexer-batch-size",
            "--indexer-log-interval",
        ),
    ),
    Unbuilt(
        "vision models (ViT, Swin, DINO, inpainting)",
        "drop these flags: pretrain_gpt.py trains a language model",
        ("--no-data-sharding", "--vision-pretraining", "--dino-norm-last-layer"),
        (
            "--num-classes",
            "--img-h",
            "--img-w",
            "--num-channels",
            "--patch-dim",
            "--classes-fraction",
            "--data-per-class-fraction",
            "--head-lr-mult",
            "--vision-pretraining-type",
            "--vision-backbone-type",
            "--swin-backbone-type",
            "--mask-type",
            "--mask-factor",
            "--iter-per-epoch",
            "--dino-local-img-size",
            "--dino-local-crops-number",
            "--dino-head-hidden-size",
            "--dino-bottleneck-size",
            "--dino-freeze-last-layer",
            "--dino-warmup-teacher-temp",
            "--dino-teacher-temp",
            "--dino-warmup-teacher-temp-epochs",
        ),
    ),
    Unbuilt(
        "Megatron-LM's removed --batch-size",
        "use --micro-batch-size (upstream refuses --batch-size too)",
        (),
        ("--batch-size",),
    ),
    Unbuilt(
        "Megatron-LM's removed --warmup",
        "use --lr-warmup-fraction or --lr-warmup-iters (upstream refuses --warmup too)",
        (),
        ("--warmup",),
    ),
    Unbuilt(
        "Megatron-LM's removed --model-parallel-size",
        "use --tensor-model-parallel-size (upstream refuses --model-parallel-size too)",
        (),
        ("--model-parallel-size",),
    ),
    Unbuilt(
        "Megatron-LM's removed --checkpoint-activations",
        "use --recompute-activations, or --recompute-granularity and --recompute-method "
        "(upstream refuses --checkpoint-activations too)",
        ("--checkpoint-activations",),
    ),
    Unbuilt(
        "the gigatoken tokenizers",
        "drop the flag: tokenizers are the implementations --tokenizer-type names",
        ("--use-gigatoken",),
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
            "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
        ),
    ),
)
"""Refused tokenizer features: flags of both `pretrain_gpt.py` and `tools/preprocess_data.py`."""

PERFORMANCE_HINTS: tuple[tuple[str, str], ...] = (
    ("--use-nccl-ub", "nccl_ub"),
    ("--disable-symmetric-registration", "disable_symmetric_registration"),
    ("--fsdp-double-buffer", "fsdp_double_buffer"),
    ("--fsdp-manual-registration", "fsdp_manual_registration"),
    ("--fsdp-db-use-persist-buf-on-alloc-fail", "fsdp_db_use_persist_buf_on_alloc_fail"),
    ("--megatron-fsdp-max-pool-double-buffer", "megatron_fsdp_max_pool_double_buffer"),
    (
        "--megatron-fsdp-enable-fine-grained-param-gather",
        "megatron_fsdp_enable_fine_grained_param_gather",
    ),
    ("--overlap-param-gather-with-optimizer-step", "overlap_param_gather_with_optimizer_step"),
    ("--ddp-pad-buckets-for-high-nccl-busbw", "ddp_pad_buckets_for_high_nccl_busbw"),
    ("--enable-experimental", "enable_experimental"),
    ("--disable-jit-fuser", "disable_jit_fuser"),
    ("--export-force-local-attention", "export_force_local_attention"),
    ("--no-persist-layer-norm", "no_persist_layer_norm"),
    ("--no-clone-scatter-output-in-embedding", "no_clone_scatter_output_in_embedding"),
    ("--disable-clone-scatter-output-in-embedding", "no_clone_scatter_output_in_embedding"),
    ("--no-barrier-with-level-1-timing", "no_barrier_with_level_1_timing"),
    ("--use-tp-pp-dp-mapping", "use_tp_pp_dp_mapping"),
    ("--ckpt-fully-parallel-load", "ckpt_fully_parallel_load"),
    ("--ckpt-assume-constant-structure", "ckpt_assume_constant_structure"),
    ("--ckpt-fully-parallel-save", "ckpt_fully_parallel_save_deprecated"),
    ("--no-ckpt-fully-parallel-save", "no_ckpt_fully_parallel_save"),
    ("--ckpt-fully-parallel-load-per-rank-objects", "ckpt_fully_parallel_load_per_rank_objects"),
    ("--no-ckpt-load-validate-sharding-integrity", "no_ckpt_load_validate_sharding_integrity"),
    (
        "--disable-ckpt-load-validate-sharding-integrity",
        "no_ckpt_load_validate_sharding_integrity",
    ),
    ("--dist-ckpt-optim-fully-reshardable", "dist_ckpt_optim_fully_reshardable"),
    (
        "--distrib-optim-fully-reshardable-mem-efficient",
        "distrib_optim_fully_reshardable_mem_efficient",
    ),
    ("--verify-integrity", "verify_integrity"),
    ("--use-dist-ckpt", "use_dist_ckpt_deprecated"),
    ("--no-save-tokenizer-assets", "no_save_tokenizer_assets"),
    ("--disable-save-tokenizer-assets", "no_save_tokenizer_assets"),
    (
        "--no-use-tokenizer-model-from-checkpoint-args",
        "no_use_tokenizer_model_from_checkpoint_args",
    ),
    (
        "--disable-use-tokenizer-model-from-checkpoint-args",
        "no_use_tokenizer_model_from_checkpoint_args",
    ),
    ("--disable-msc", "disable_msc"),
    ("--dataloader-fast-cache-load", "dataloader_fast_cache_load"),
    ("--dataloader-defer-npy-index-mmap", "dataloader_defer_npy_index_mmap"),
)
"""Upstream switches (flag, dest) accepted and ignored, since no result depends on them here:
they tune buffers, registration, kernels, timing barriers or checkpoint saving and loading for
speed, ask for what this project always does (fully reshardable checkpoints, verified
checksums, ranks ordered as upstream's tp-pp-dp mapping orders them without pipeline stages, its
own core attention rather than Transformer Engine's), or turn off what it never does (saving
tokenizer files, reading the tokenizer from checkpoint arguments); upstream deprecates some of
them as no-ops itself. `docs/flags.md` says why for each. Like the refused flags, they are left
out of `--help`."""

VALUED_HINTS: tuple[tuple[str, str, type], ...] = (
    ("--ckpt-fully-parallel-load-exchange-algo", "ckpt_fully_parallel_load_exchange_algo", str),
    ("--ckpt-fully-parallel-save-process-group", "ckpt_fully_parallel_save_process_group", str),
    ("--ckpt-fully-parallel-load-process-group", "ckpt_fully_parallel_load_process_group", str),
    ("--dist-ckpt-format", "dist_ckpt_format_deprecated", str),
    ("--local-rank", "local_rank", int),
)
"""Upstream flags (flag, dest, type) that take a value and are accepted and ignored: how
upstream's fully parallel checkpoint saving and loading exchange data, its deprecated
`--dist-ckpt-format` (a no-op upstream too), and the rank a legacy launcher passes (the
`LOCAL_RANK` environment variable, which every launcher sets, is read instead)."""

RERUN_MODES = ("disabled", "validate_results", "report_stats")
"""Upstream's `--rerun-mode` values; `disabled`, the only one built, is what this project does."""


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
    """Refuses each of `features` any of whose flags is set, naming all of them that are.

    Raises:
        FlagErrors: a `ValueError` with one message for each feature whose flags are set.
    """
    messages = []
    for unbuilt in features:
        given = [flag for flag in unbuilt.switches if getattr(args, _dest(flag))]
        given += [
            f"{flag} {' '.join(values)}"
            for flag in unbuilt.valued
            if (values := getattr(args, _dest(flag))) is not None
        ]
        given += [
            f"{flag} {value}"
            for flag, refused in unbuilt.values
            if (value := getattr(args, _dest(flag))) in refused
        ]
        if given:
            messages.append(
                f"{', '.join(given)}: {unbuilt.feature} is not built in this project; "
                f"{unbuilt.instead}."
            )
    if messages:
        raise FlagErrors(messages)


def add_unbuilt_args(parser: argparse.ArgumentParser) -> None:
    """The "not built" group: upstream flags refused by `validate_unbuilt`, `--rerun-mode` (its
    built value accepted), and the accepted no-ops (`PERFORMANCE_HINTS`, `VALUED_HINTS`)."""
    group = add_unbuilt_flags(parser, UNBUILT + TOKENIZER_UNBUILT)
    group.description += (
        f" {len(PERFORMANCE_HINTS) + len(VALUED_HINTS)} more, which change no result here, are "
        "accepted and ignored (docs/flags.md, 'Accepted with no effect')."
    )
    # Not in `UNBUILT`: its dest is the derived value validation sets.
    group.add_argument(
        "--padded-vocab-size",
        type=int,
        dest="upstream_padded_vocab_size",
        help="Not built: the vocabulary is padded to a multiple of "
        "--make-vocab-size-divisible-by x --tensor-model-parallel-size.",
    )
    group.add_argument(
        "--rerun-mode",
        choices=RERUN_MODES,
        help="disabled: no iteration is re-run (the only mode built); upstream's default, "
        "validate_results, and report_stats are refused. None: disabled.",
    )
    for flag, dest in PERFORMANCE_HINTS:
        group.add_argument(flag, action="store_true", dest=dest, help=argparse.SUPPRESS)
    for flag, dest, kind in VALUED_HINTS:
        group.add_argument(flag, type=kind, dest=dest, help=argparse.SUPPRESS)


def validate_unbuilt(args: argparse.Namespace) -> None:
    """Refuses every feature any of whose flags is set, naming all of them that are.

    Raises:
        FlagErrors: a `ValueError` with one message for each feature asked for.
    """
    messages = []
    if args.rerun_mode not in (None, "disabled"):
        messages.append(
            f"--rerun-mode {args.rerun_mode}: the rerun state machine (re-running iterations to "
            "validate results or measure their variability) is not built in this project; pass "
            "--rerun-mode disabled or drop the flag: a NaN or infinite loss or gradient norm "
            "stops the run (--check-for-nan-in-loss-and-grad)."
        )
    if args.upstream_padded_vocab_size is not None:
        messages.append(
            f"--padded-vocab-size {args.upstream_padded_vocab_size}: a vocabulary size given "
            "directly is not built in this project; drop it: the vocabulary is padded to a "
            "multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size."
        )
    try:
        refuse_unbuilt(args, UNBUILT + TOKENIZER_UNBUILT)
    except FlagErrors as errors:
        messages += errors.messages
    if messages:
        raise FlagErrors(messages)
