"""Shape, regularisation, initialisation and recompute settings of a transformer.

`TransformerConfig` uses Megatron-LM's field names so that configs, command-line flags and
checkpoints translate one to one. Derived defaults (`ffn_hidden_size`, `kv_channels`,
`num_query_groups`, the init methods) are filled in by `__post_init__`, which also rejects
inconsistent values with a `ValueError` that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core.context_parallel.all_to_all_attention import check_heads_divisible
from megatron.core.context_parallel.comm_type import CPCommType
from megatron.core.context_parallel.sequence_split import check_divisible
from megatron.core.fp8.recipe import check_fp8_config
from megatron.core.model_parallel_config import ModelParallelConfig, check_positive_int
from megatron.core.pipeline_parallel.layer_split import pipeline_split
from megatron.core.transformer.attention_window import check_window_config
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.moe.moe_config import check_moe_config
from megatron.core.transformer.softmax_sinks import SOFTMAX_TYPES
from megatron.core.value_ranges import (
    FINITE,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    Range,
    check_ranges,
    ranged,
)

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""Values of `recompute_modules` the local layers implement."""
UNBUILT_RECOMPUTE_MODULES = {
    "moe_act": (
        "the output-discarding checkpoint of the expert activation is not built; recompute the "
        "whole MoE layer with 'moe' instead"
    ),
    "gdn_norm_out": "there are no GatedDeltaNet layers",
    "gdp_in_proj": "there are no GatedDeltaProduct layers",
    "gdp_qkv": "there are no GatedDeltaProduct layers",
    "mhc": "there are no hyper-connections",
}
"""Upstream's other `recompute_modules` values, and why they do not apply here."""
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")
BUILT_CUDA_GRAPH_IMPLS = ("none", "full_iteration")
"""The built values of `cuda_graph_impl`."""


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Returns an in-place initialiser drawing from N(0, sigma^2).

    A `functools.partial` rather than a closure so that configs stay picklable (spawned ranks
    receive them through pickling).
    """
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(
    sigma: float, num_layers: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Returns N(0, (sigma / sqrt(2 * num_layers))^2), Megatron's init for residual outputs.

    Each layer adds two residual branches; shrinking their output projections keeps the
    variance of the residual stream independent of depth (GPT-2 / Megatron-LM).
    """
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def recompute_module_refusal(module: str) -> str | None:
    """Why `module` cannot be a `recompute_modules` value here ("is not built: ..." or "is
    unknown"), or None when the local layers implement it."""
    if module in UNBUILT_RECOMPUTE_MODULES:
        return f"is not built: {UNBUILT_RECOMPUTE_MODULES[module]}"
    if module not in RECOMPUTE_MODULES:
        return "is unknown"
    return None


def recomputes(config: TransformerConfig, module: str) -> bool:
    """Whether selective recompute covers `module` (a `RECOMPUTE_MODULES` value)."""
    return config.recompute_granularity == "selective" and module in config.recompute_modules


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Configuration of a GPT-style decoder stack.

    The `moe_*` fields and `num_moe_experts` configure Mixture of Experts layers with
    Megatron-core's names and defaults; `check_moe_config` validates them.

    With `tensor_model_parallel_size` T > 1, `num_attention_heads`, `num_query_groups`,
    `ffn_hidden_size` and `moe_shared_expert_intermediate_size` must be multiples of T (each
    rank holds an equal part), `seq_length` too under `sequence_parallel`; MoE layers with T > 1
    need `sequence_parallel` (see `_check_moe_tensor_parallel`).

    Attributes:
        num_layers: Number of transformer layers.
        hidden_size: Width of the residual stream.
        num_attention_heads: Number of query heads.
        num_query_groups: Number of key/value heads (grouped-query attention); None means
            `num_attention_heads` (plain multi-head attention).
        ffn_hidden_size: Width of the MLP (of each half when `gated_linear_unit`); None means
            4 * hidden_size.
        kv_channels: Width of one attention head; None means hidden_size / num_attention_heads.
        hidden_dropout: Dropout on the embeddings and on each residual branch.
        attention_dropout: Dropout on the attention probabilities.
        layernorm_epsilon: Epsilon of the normalisation layers.
        normalization: "LayerNorm" or "RMSNorm".
        gated_linear_unit: Gated MLP: act(x W1) * (x V) (SwiGLU with `activation_func=F.silu`).
        activation_func: MLP activation.
        glu_linear_offset: With `gated_linear_unit`: act(x W1) * (x V + offset) (gpt-oss: 1).
        activation_func_clamp_value: With `gated_linear_unit`: clamp x W1 from above and x V to
            [-c, c] before the activation (gpt-oss's clamped GLU, c = 7); None: no clamp.
        bias_activation_fusion: Run SwiGLU (`gated_linear_unit` with `F.silu`, no offset, no
            clamp) in one Triton kernel per direction where
            `megatron.core.fusions.fused_swiglu.fused_swiglu_supported` allows (Triton, CUDA, no
            `torch.compile` tracing); the PyTorch ops elsewhere and for other activations (each
            of which is one PyTorch kernel per direction; fc1 adds its bias in its GEMM). The
            training flags turn it on for `--swiglu` unless `--no-bias-swiglu-fusion`.
        add_bias_linear: Bias in the linear layers.
        add_qkv_bias: Bias in the QKV projection even when `add_bias_linear` is False.
        init_method_std: Standard deviation of the default weight initialisation.
        init_method: In-place initialiser of weights; None means N(0, init_method_std^2).
        output_layer_init_method: Initialiser of the attention output projection and the second
            MLP linear (the residual-branch outputs); None means
            N(0, (init_method_std / sqrt(2 * num_layers))^2). Both init methods are derived once,
            in `__post_init__`: a `dataclasses.replace` that changes `num_layers` or
            `init_method_std` must also pass None for them to be derived again.
        apply_residual_connection_post_layernorm: Take the residual from the output of the
            layer norm instead of its input.
        layernorm_zero_centered_gamma: Zero-centred norm weights (`--apply-layernorm-1p`): the
            weight is initialised to 0 and the norm multiplies by `1 + weight`.
        qk_layernorm: Normalise each query and key head (`normalization`, over the head width)
            after the QKV projection, before the rotary embedding.
        qk_l2_norm: Llama-4's QK norm instead: each query and key head scaled to unit RMS, with
            no weight (it wins over `qk_layernorm` when both are set, as in Megatron-core).
        rotary_interleaved: Rotate pairs of adjacent channels (RoFormer / GPT-J) instead of the
            first half against the second (GPT-NeoX / Llama).
        apply_rope_fusion: Rotate queries and keys in one Triton kernel per direction where
            `megatron.core.fusions.fused_rope.fused_rope_supported` allows (Triton, CUDA, angles
            without gradient, no `torch.compile` tracing); the PyTorch ops elsewhere. The
            training flags turn it on unless `--no-rope-fusion`.
        apply_query_key_layer_scaling: Divide the attention scores by the layer number before
            the softmax and multiply them back inside it, in fp32 (Megatron's fp16 trick; exact
            in real arithmetic). Read by the `local` attention backend only: the SDPA kernels
            compute the softmax in fp32 in any case.
        attention_softmax_in_fp32: Run the attention softmax in fp32 with half-precision inputs
            (the `local` backend; the SDPA kernels always do, except `unfused` on CUDA); set
            by `apply_query_key_layer_scaling`.
        attention_backend: The attention kernel (`AttnBackend`); `auto` lets SDPA choose.
        cp_comm_type: With `context_parallel_size > 1`, how attention communicates across the
            context-parallel ranks (`CPCommType`): "p2p" (ring attention, the default),
            "a2a" (all-to-all; the heads per tensor-parallel rank must divide by the cp size)
            or "allgather". "p2p" and "allgather" run their own block kernels (the SDPA ones
            that return the log-sum-exp, or explicit scores for the `local` and `unfused`
            backends; not `fused`): no attention dropout, sliding window or softmax sinks
            there (use "a2a", which runs the attention backend on whole sequences).
        recompute_granularity: None, "full" (recompute whole transformer layers in backward, as
            `recompute_method` says) or "selective" (recompute the `recompute_modules`).
        recompute_method: With "full": "uniform" (the layers in chunks of `recompute_num_layers`,
            each chunk one checkpoint) or "block" (the first `recompute_num_layers` layers, one
            checkpoint each; the rest store their activations). None: every layer on its own
            (uniform, one layer per chunk); the flags require it, as Megatron-LM's config does.
        recompute_num_layers: Layers per chunk ("uniform") or layers recomputed ("block").
        recompute_modules: With "selective": which parts of each layer are recomputed, among
            `RECOMPUTE_MODULES`; None means `["core_attn"]` (Megatron-LM's default).
            "mla_up_proj" (multi-latent attention only) recomputes the up-projections and the
            rotary embedding of the queries and keys in backward instead of storing them, as
            upstream; the attention kernel's outputs are kept (see `MLASelfAttention`).
        cross_entropy_loss_fusion: Compute the language-model loss with the chunked
            cross-entropy (`fused_cross_entropy`), which never holds fp32 logits or
            probabilities for the whole vocabulary and batch at once. With tensor parallelism
            the loss is the vocabulary-parallel cross-entropy either way (each rank holds fp32
            statistics of its V/T logits only).
        cross_entropy_fusion_impl: "native" (the chunked PyTorch implementation); "te" is
            refused, as Megatron-LM refuses it (numerically unstable).
        compile_layers: Compile each transformer layer's forward (and with it its backward) with
            `torch.compile`: norms, residual adds, dropout, rotary embeddings, activations and
            attention fuse into generated kernels. The hooks of the modules (a data-parallel
            engine's) stay outside the compiled code. A layer is one graph, with or without
            `gradient_accumulation_fusion` (a fusing linear is an operator of the graph whose
            backward sends its weight gradient where the engine says). Compiling costs time at
            the first steps.
        compile_backend: The `torch.compile` backend of `compile_layers` ("inductor" generates
            Triton and C++ kernels; "aot_eager" traces without generating code, for checking).
        compile_cpp_wrapper: With `compile_layers`, the inductor backend and CUDA inputs, have
            inductor generate each graph's wrapper (the code that allocates buffers and launches
            its kernels, one call per kernel) in C++ instead of Python (inductor's
            `cpp_wrapper`): each kernel is launched without a Python call, which takes the host
            less time per step, and compiling takes longer (a C++ compiler builds each wrapper).
        cuda_graph_impl: How the training captures CUDA graphs (Megatron-core's field): "none",
            or "full_iteration", the whole training iteration in one graph
            (`megatron.training.cuda_graphs`, which `--cuda-graph-impl full_iteration` sets).
            The model reads it where a graph changes what it runs: FP8 experts then run their
            grouped Triton kernels, which take the token counts on the device, at any size,
            where those kernels run (eager, large experts run one GEMM per expert, which reads
            the counts on the host). Upstream's per-layer graphs ("local",
            "transformer_engine") are not built (refused).
        seq_length: Training sequence length, when known when the model is built; lets the
            model check it against its position-embedding table early.
        calculate_per_token_loss: The training loss is a sum over tokens divided by the global
            token count (Megatron-LM's `--calculate-per-token-loss`); the MoE auxiliary losses
            are then scaled by the local token count so that their gradients keep their weight.
        num_layers_in_first_pipeline_stage: Layers of the first pipeline stage (None: the even
            share); `megatron.core.pipeline_parallel.layer_split`.
        num_layers_in_last_pipeline_stage: Layers of the last pipeline stage (None: the even
            share).
        account_for_embedding_in_pipeline_split: The embedding counts as a layer of the first
            pipeline chunk.
        account_for_loss_in_pipeline_split: The output layer and loss count as a layer of the
            last pipeline chunk.
        mtp_num_layers: Multi-token prediction depths (DeepSeek-V3): each adds a transformer
            layer that predicts one token further ahead, sharing the embedding and the output
            layer (`megatron.core.transformer.multi_token_prediction`); None: none.
        mtp_loss_scaling_factor: Weight of the multi-token prediction loss: the mean of the
            depths' losses times this factor is added to the training objective.
        num_moe_experts: Experts per MoE layer; None builds a dense model.
        moe_ffn_hidden_size: Width of each expert's MLP; None means `ffn_hidden_size`.
        moe_router_topk: Experts each token is sent to.
        moe_router_score_function: "softmax" or "sigmoid" over the router logits.
        moe_router_pre_softmax: Softmax over all experts before the top-k (else over the k).
        moe_router_topk_scaling_factor: Multiplies the routing probabilities; None leaves them.
        moe_router_dtype: Router logits and probabilities in None (the input dtype), "fp32" or
            "fp64"; the weight stays in `params_dtype`.
        moe_router_num_groups: Expert groups for group-limited routing (DeepSeek's
            device-limited routing); needs `moe_router_group_topk`.
        moe_router_group_topk: Groups each token may use.
        moe_router_enable_expert_bias: Aux-loss-free balancing: a per-expert bias added to the
            scores for the top-k selection only, moved after each step toward balance.
        moe_router_bias_update_rate: Step of that bias update.
        moe_router_load_balancing_type: "aux_loss" (over the micro-batch), "seq_aux_loss" (per
            sequence) or "none".
        moe_aux_loss_coeff: Weight of the load-balancing loss; 0 disables it.
        moe_z_loss_coeff: Weight of the router z-loss; None disables it.
        moe_input_jitter_eps: Multiplies the router input by U(1 - eps, 1 + eps) in training.
        moe_router_force_load_balancing: Route by random logits (a benchmark aid).
        moe_token_dispatcher_type: "allgather" or "alltoall" exchange of tokens over the
            expert-parallel group.
        moe_expert_capacity_factor: Capacity of each expert as a multiple of the even share of
            the tokens; tokens over it are dropped. None (or a negative value, which becomes
            None, as in Megatron-core): dropless.
        moe_token_drop_policy: Which tokens an expert over capacity keeps: "probs" (the highest
            probabilities) or "position" (the first ones).
        moe_pad_expert_input_to_capacity: Every expert processes exactly its capacity (padding
            with zero-weight tokens).
        moe_pad_dispatch_to_worst_case: This project's own (not in Megatron-core): with several
            ranks per expert group, dropless token exchanges are padded to their largest
            possible size (each rank sends every ep peer tokens x topk rows), so their sizes
            need no host read of the token counts; more bytes travel. Nothing to pad with one
            rank per expert group.
        moe_grouped_gemm: The experts run one grouped GEMM per projection (`torch._grouped_mm`)
            instead of a loop of GEMMs; read by `get_gpt_decoder_block_spec`.
        moe_shared_expert_intermediate_size: Width of the shared experts' MLP (every token goes
            through it); None: no shared experts.
        moe_shared_expert_overlap: Overlap the shared experts with the token exchange; not built
            (refused).
        moe_shared_expert_gate: Scale the shared experts' output by a sigmoid gate (Qwen2-MoE).
        moe_layer_freq: Which layers are MoE layers: an int N (every N-th layer, starting with the
            first) or a list of 0/1 per layer.
        moe_per_layer_logging: Log the MoE metrics of every layer, not only their mean.
        fp8: FP8 format of the linear layers of the transformer layers (`--fp8-format`): None
            (high precision), "e4m3" (E4M3 throughout) or "hybrid" (E5M2 output gradients).
            The embedding, the output layer, the router, norms and attention stay in high
            precision, as upstream (`megatron.core.fp8`).
        fp8_recipe: "delayed" (scales from an amax history), "tensorwise" (current
            scaling) or "blockwise" (a scale per 1x128 / 128x128 block, with fp8="e4m3");
            upstream's "mxfp8" and "custom" are refused.
        fp8_margin: Delayed scaling's scale is `fp8_max * 2**-fp8_margin / amax`.
        fp8_interval: Deprecated upstream and ignored (a warning when not 1).
        fp8_amax_history_len: Delayed scaling's window of absolute maxima.
        fp8_amax_compute_algo: "most_recent" or "max" (over the window).
        fp8_wgrad: The weight-gradient GEMMs run in FP8; False (`--no-fp8-wgrad`): in the
            input's precision.
        first_last_layers_bf16: Keep the first `num_layers_at_start_in_bf16` and the last
            `num_layers_at_end_in_bf16` transformer layers in high precision (not with delayed
            scaling, as upstream).
        num_layers_at_start_in_bf16, num_layers_at_end_in_bf16: See `first_last_layers_bf16`.
        softmax_scale: The attention scores' scale; None means 1 / sqrt(kv_channels).
        softmax_type: The attention softmax (`softmax_sinks`): "vanilla", "off-by-one" (a
            logit 0 added to the denominator) or "learnable" (a learnt sink logit per head,
            gpt-oss's).
        window_size: Sliding-window attention, (left, right) as Megatron-core
            (`attention_window`): each query sees itself and the `left` positions before it (-1:
            all); `right` must be 0 or -1 (the decoder is causal). None: full causal attention.
        window_attn_skip_freq: The layers that keep full attention when `window_size` is set: an
            int N (every N-th layer, counted from 1) or a 0/1 list per layer (1: windowed); None:
            every layer has the window.
        yarn_rotary_scaling_factor: YaRN's context extension factor s for standard attention,
            read where `GPTModel` is built with `position_embedding_type="yarn"` (upstream's
            field names, which its training script sets; multi-latent attention has its own,
            `MLATransformerConfig`): the channel pairs turning fewer than `yarn_beta_slow`
            times over `yarn_original_max_position_embeddings` positions are interpolated (their
            frequency divided by s), those turning more than `yarn_beta_fast` times keep theirs,
            and the pairs between blend the two (`YarnRotaryEmbedding`).
        yarn_original_max_position_embeddings: The context length the RoPE was trained with.
        yarn_beta_fast, yarn_beta_slow: YaRN's band, in rotations over the original context.
        yarn_mscale, yarn_mscale_all_dim: The concentration factor yarn_mscale(s,
            `yarn_mscale`) / yarn_mscale(s, `yarn_mscale_all_dim`) multiplies the rotated queries
            and keys (upstream's attention applies it to cos and sin), where yarn_mscale(s, m) =
            0.1 m ln(s) + 1 (1 for s <= 1): 0.1 ln(s) + 1 at the defaults.
        yarn_correction_range_round_to_int: Round the band's ends outwards to whole channel
            pairs (gpt-oss does not).
        multi_latent_attention: The layers' attention is multi-latent attention; set by
            `MLATransformerConfig`, whose fields describe it (True here alone is refused).
        masked_softmax_fusion, bias_dropout_fusion, persist_layer_norm,
            memory_efficient_layer_norm: Megatron-core's kernel-fusion switches, accepted with no
            effect (they change speed only; here PyTorch or `torch.compile` picks the kernels).
        fp32_residual_connection: Megatron-core's fp32 residual stream, not built: False only.
    """

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    hidden_dropout: float = ranged(0.1, PROBABILITY)
    attention_dropout: float = ranged(0.1, PROBABILITY)
    layernorm_epsilon: float = ranged(1e-5, POSITIVE)
    normalization: str = "LayerNorm"
    gated_linear_unit: bool = False
    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu
    glu_linear_offset: float = ranged(0.0, FINITE)
    activation_func_clamp_value: float | None = ranged(None, POSITIVE)
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    init_method_std: float = ranged(0.02, NON_NEGATIVE)
    init_method: Callable[[torch.Tensor], torch.Tensor] | None = None
    output_layer_init_method: Callable[[torch.Tensor], torch.Tensor] | None = None
    apply_residual_connection_post_layernorm: bool = False
    layernorm_zero_centered_gamma: bool = False
    qk_layernorm: bool = False
    qk_l2_norm: bool = False
    rotary_interleaved: bool = False
    apply_rope_fusion: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    attention_backend: AttnBackend = AttnBackend.auto
    cp_comm_type: str = "p2p"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"
    compile_layers: bool = False
    compile_backend: str = "inductor"
    compile_cpp_wrapper: bool = True
    cuda_graph_impl: str = "none"
    seq_length: int | None = None
    calculate_per_token_loss: bool = False
    mtp_num_layers: int | None = None
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    mtp_loss_scaling_factor: float = ranged(0.1, NON_NEGATIVE)

    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = ranged(None, POSITIVE)
    moe_router_dtype: str | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = ranged(1e-3, FINITE)
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = ranged(0.0, NON_NEGATIVE)
    moe_z_loss_coeff: float | None = ranged(None, NON_NEGATIVE)
    moe_input_jitter_eps: float | None = ranged(None, Range(0, 1, low_open=True, high_open=True))
    moe_router_force_load_balancing: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_expert_capacity_factor: float | None = ranged(None, POSITIVE)
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_pad_dispatch_to_worst_case: bool = False
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    moe_shared_expert_gate: bool = False
    moe_layer_freq: int | list[int] = 1
    moe_per_layer_logging: bool = False

    fp8: str | None = None
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    softmax_scale: float | None = ranged(None, POSITIVE)
    softmax_type: str = "vanilla"
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | list[int] | None = None
    yarn_rotary_scaling_factor: float = ranged(1.0, POSITIVE)
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = ranged(32.0, POSITIVE)
    yarn_beta_slow: float = ranged(1.0, POSITIVE)
    yarn_mscale: float = ranged(1.0, FINITE)
    yarn_mscale_all_dim: float = ranged(0.0, FINITE)
    yarn_correction_range_round_to_int: bool = True
    multi_latent_attention: bool = False
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    bias_dropout_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    fp32_residual_connection: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            check_positive_int(name, getattr(self, name))
        pipeline_split(self).check()

        # The head counts and widths size tensor views, where a float (e.g. 2.0) would only fail
        # deep inside the first forward.
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        check_positive_int("num_query_groups", self.num_query_groups)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_query_groups ({self.num_query_groups}); choose num_query_groups among the "
                "divisors of num_attention_heads."
            )

        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) when kv_channels is None; change one of them "
                    "or set kv_channels explicitly."
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        check_positive_int("kv_channels", self.kv_channels)

        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        check_positive_int("ffn_hidden_size", self.ffn_hidden_size)

        if self.apply_query_key_layer_scaling:  # it needs the fp32 softmax (Megatron-core's rule)
            self.attention_softmax_in_fp32 = True

        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None  # Megatron-core's spelling of dropless
        check_ranges(self)
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}."
            )
        self._check_recompute()
        self._check_attention_options()
        self._check_yarn()
        self._check_context_parallel()
        self._check_compile()
        self._check_cuda_graph()
        self._check_multi_token_prediction()
        check_moe_config(self)
        check_fp8_config(self)
        self._check_tensor_parallel()
        if not callable(self.activation_func):
            raise ValueError(f"activation_func must be callable, got {self.activation_func!r}.")
        self._check_gated_linear_unit()
        if self.seq_length is not None and self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1 or None, got {self.seq_length}.")

        # Megatron-LM semantics: derived once, only when None. `dataclasses.replace(config,
        # num_layers=...)` therefore keeps the old depth's scale unless it also passes None.
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, self.num_layers
            )

    def _check_recompute(self) -> None:
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got "
                f"{self.recompute_granularity!r}."
            )
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(
                f"recompute_method must be one of {RECOMPUTE_METHODS}, got "
                f"{self.recompute_method!r}."
            )
        if self.recompute_granularity != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} applies to recompute_granularity='full' "
                        f"only (got {self.recompute_granularity!r}); set it to None."
                    )
        if self.recompute_num_layers is not None:
            check_positive_int("recompute_num_layers", self.recompute_num_layers)
            if self.recompute_num_layers > self.num_layers:
                raise ValueError(
                    f"recompute_num_layers ({self.recompute_num_layers}) exceeds num_layers "
                    f"({self.num_layers}); choose a value in [1, {self.num_layers}]."
                )
        elif self.recompute_method is not None:
            raise ValueError(
                f"recompute_method={self.recompute_method!r} needs recompute_num_layers (layers "
                "per chunk for 'uniform', layers recomputed for 'block'); set it."
            )
        # Megatron-LM's default, filled whatever the granularity (its config does the same).
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        if self.recompute_granularity == "selective":
            for module in self.recompute_modules:
                refusal = recompute_module_refusal(module)
                if refusal is not None:
                    raise ValueError(
                        f"recompute_modules value {module!r} {refusal}; choose among "
                        f"{RECOMPUTE_MODULES}."
                    )
            if "mla_up_proj" in self.recompute_modules and not self.multi_latent_attention:
                raise ValueError(
                    "recompute_modules value 'mla_up_proj' recomputes multi-latent attention's "
                    "up-projections, but this model has none (multi_latent_attention=False); "
                    "drop it or build the model from an MLATransformerConfig."
                )

    def _check_yarn(self) -> None:
        check_positive_int(
            "yarn_original_max_position_embeddings", self.yarn_original_max_position_embeddings
        )
        for name in ("yarn_mscale", "yarn_mscale_all_dim"):
            if yarn_mscale(self.yarn_rotary_scaling_factor, getattr(self, name)) <= 0:
                raise ValueError(
                    f"{name}={getattr(self, name)} with yarn_rotary_scaling_factor="
                    f"{self.yarn_rotary_scaling_factor} gives a YaRN scale 0.1 * {name} * "
                    "ln(yarn_rotary_scaling_factor) + 1 <= 0; choose a larger value."
                )

    def _check_context_parallel(self) -> None:
        comm_type = CPCommType.parse(self.cp_comm_type)
        cp = self.context_parallel_size
        if cp == 1:
            return
        if self.seq_length is not None:
            check_divisible(self.seq_length, cp)
        if comm_type is CPCommType.a2a:
            heads = self.num_attention_heads // self.tensor_model_parallel_size
            check_heads_divisible(heads, cp)
            return
        unsupported = [
            (self.attention_dropout > 0, "attention_dropout", "--attention-dropout", "0"),
            (self.window_size is not None, "window_size", "--window-size", "None"),
            (self.softmax_type != "vanilla", "softmax_type", "--softmax-type", "vanilla"),
            (
                self.attention_backend == AttnBackend.fused,
                "attention_backend",
                "--attention-backend",
                "auto, flash, unfused or local",
            ),
        ]
        for given, name, flag, instead in unsupported:
            if given:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} ({flag}) with context_parallel_size={cp} and "
                    f"cp_comm_type {comm_type.value}: its block kernels have no attention "
                    "dropout, sliding window, softmax sinks or cuDNN kernel; set it to "
                    f"{instead}, or use cp_comm_type a2a (--cp-comm-type a2a), which runs the "
                    "attention on whole sequences of a share of the heads."
                )

    def _check_compile(self) -> None:
        if not self.compile_layers:
            return
        if self.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(
                f"compile_backend {self.compile_backend!r} is not a torch.compile backend; use "
                "'inductor' (generates kernels), 'aot_eager' (traces without generating them) "
                "or another of torch.compiler.list_backends(exclude_tags=())."
            )
        if self.compile_backend == "inductor" and self.compile_cpp_wrapper:
            _check_cpp_compiler()

    def _check_cuda_graph(self) -> None:
        if self.cuda_graph_impl not in BUILT_CUDA_GRAPH_IMPLS:
            raise ValueError(
                f"cuda_graph_impl {self.cuda_graph_impl!r}: only 'none' and 'full_iteration' (the "
                "whole training iteration in one graph, upstream's 'local' with the "
                "'full_iteration' scope) are built; per-layer graphs ('local', "
                "'transformer_engine') are not."
            )

    def _check_multi_token_prediction(self) -> None:
        if self.mtp_num_layers is None:
            return
        check_positive_int("mtp_num_layers", self.mtp_num_layers)

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_model_parallel_size
        # Each tp rank holds whole heads, whole query groups (the grouped QKV layout splits by
        # group) and an equal slice of every MLP width.
        split_fields = ["num_attention_heads", "num_query_groups", "ffn_hidden_size"]
        if self.moe_shared_expert_intermediate_size is not None:
            split_fields.append("moe_shared_expert_intermediate_size")
        for name in split_fields:
            value = getattr(self, name)
            if value % tp:
                raise ValueError(
                    f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp}): "
                    f"each tensor-parallel rank holds {name} / {tp} of it; change {name} or "
                    "tensor_model_parallel_size."
                )
        cp = self.context_parallel_size
        if self.sequence_parallel and self.seq_length is not None and self.seq_length % (tp * cp):
            raise ValueError(
                f"seq_length ({self.seq_length}) must be divisible by tensor_model_parallel_size "
                f"({tp}) x context_parallel_size ({cp}) with sequence_parallel: each rank keeps "
                f"seq_length / {tp * cp} positions; change seq_length or set "
                "sequence_parallel=False."
            )
        if self.num_moe_experts is not None:
            self._check_moe_tensor_parallel()

    def _check_moe_tensor_parallel(self) -> None:
        tp, ep = self.tensor_model_parallel_size, self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size
        # Each tp rank routes its own part of the sequence (Megatron-core requires it too):
        # without it the tp ranks would route and compute the same tokens twice.
        if tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"MoE layers (num_moe_experts={self.num_moe_experts}) with "
                f"tensor_model_parallel_size={tp} need sequence_parallel=True "
                "(--sequence-parallel), as in Megatron-core; set it, or set "
                "tensor_model_parallel_size=1."
            )
        if self.moe_ffn_hidden_size % etp:
            raise ValueError(
                f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size}) must be divisible by "
                f"expert_tensor_parallel_size ({etp}): each expert's MLP width is split over "
                "the expert tensor-parallel ranks; change one of them."
            )
        # The etp x ep ranks of an expert group hold different parts of the experts, and tp
        # ranks route different tokens. With one rank per expert group every tp rank holds all
        # experts and the layer sums their gradients over tp; with at least tp ranks the tp
        # ranks of one group hold different parts. In between, tp ranks would hold copies of
        # the same part without a group of just those copies to sum over.
        if 1 < etp * ep < tp:
            raise ValueError(
                f"expert_tensor_parallel_size={etp} x expert_model_parallel_size={ep} with "
                f"tensor_model_parallel_size={tp} is not built: the tensor-parallel ranks would "
                "hold copies of the same expert weights; make expert_tensor_parallel_size x "
                f"expert_model_parallel_size 1 or at least {tp}."
            )

    def _check_gated_linear_unit(self) -> None:
        if self.gated_linear_unit:
            return
        for name, off in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
            if getattr(self, name) != off:
                raise ValueError(
                    f"{name}={getattr(self, name)} applies to the gated MLP only "
                    "(gated_linear_unit=True: --swiglu or --quick-geglu); set it or leave "
                    f"{name}={off}."
                )

    def _check_attention_options(self) -> None:
        if self.multi_latent_attention and not isinstance(self, MLATransformerConfig):
            raise ValueError(
                "multi_latent_attention=True needs the fields of multi-latent attention (ranks, "
                "head widths, YaRN): build an MLATransformerConfig instead of a "
                "TransformerConfig."
            )
        if self.fp32_residual_connection:
            raise ValueError(
                "fp32_residual_connection=True: an fp32 residual stream is not built; leave it "
                "False."
            )
        check_window_config(self)
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(
                f"softmax_type must be one of {SOFTMAX_TYPES}, got {self.softmax_type!r}."
            )
        if not isinstance(self.attention_backend, AttnBackend):
            raise ValueError(
                f"attention_backend must be an AttnBackend, got {self.attention_backend!r}; "
                f"choose among {[backend.name for backend in AttnBackend]}."
            )
        sdpa_kernels = (AttnBackend.flash, AttnBackend.fused, AttnBackend.unfused)
        if self.attention_backend in sdpa_kernels and (
            self.window_size is not None or self.softmax_type != "vanilla"
        ):
            raise ValueError(
                f"attention_backend={self.attention_backend.name} pins an SDPA kernel, which "
                "computes no sliding window (window_size) or softmax sink (softmax_type); use "
                "attention_backend=auto (FlexAttention on CUDA) or attention_backend=local "
                "(dense scores)."
            )
        if self.cross_entropy_fusion_impl not in CROSS_ENTROPY_FUSION_IMPLS:
            raise ValueError(
                f"cross_entropy_fusion_impl must be one of {CROSS_ENTROPY_FUSION_IMPLS}, got "
                f"{self.cross_entropy_fusion_impl!r}."
            )
        if self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "te":
            raise ValueError(
                "cross_entropy_fusion_impl='te' is refused, as in Megatron-LM (Transformer "
                "Engine's fused cross-entropy is numerically unstable); use 'native'."
            )


MLA_ROPE_TYPES = ("rope", "yarn")


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Configuration of a transformer whose attention is multi-latent attention (DeepSeek-V2/V3,
    `MLASelfAttention`), with Megatron-core's field names and defaults.

    Queries come from a low-rank projection (`q_lora_rank`; None projects them directly), keys
    and values from one shared latent of `kv_lora_rank` channels. Each query and key head has
    `qk_head_dim` channels without position and `qk_pos_emb_head_dim` rotated ones (the key's
    rotated part shared by all heads); values have `v_head_dim` channels. `kv_channels` and
    `num_query_groups` are not read (there are no query groups: `num_query_groups` must be the
    number of heads, its default). `qk_layernorm` normalises the two latents (`q_layernorm`
    with `q_lora_rank`, `kv_layernorm`), as in Megatron-core.

    The rotary part is rotated by RoPE (`rope_type="rope"`: `rotary_base`, `rotary_percent`) or
    by YaRN (`"yarn"`): frequencies interpolated by `rotary_scaling_factor` outside the band
    `beta_fast` .. `beta_slow` rotations over `original_max_position_embeddings` positions,
    and the rotated channels scaled by yarn_mscale(`mscale`) / yarn_mscale(`mscale_all_dim`),
    where yarn_mscale(m) = 0.1 m ln(`rotary_scaling_factor`) + 1 (1 for a factor <= 1). With
    either, the softmax scale is yarn_mscale(`mscale_all_dim`)^2 / sqrt(qk_head_dim +
    qk_pos_emb_head_dim), as upstream (so `softmax_scale` must stay None).

    Attributes:
        multi_latent_attention: Always True here.
        q_lora_rank: Rank of the query's low-rank projection; None: no query compression.
        kv_lora_rank: Rank of the shared key/value latent.
        qk_head_dim: Channels of each query / key head without position.
        qk_pos_emb_head_dim: Rotated channels of each query / key head (even).
        v_head_dim: Channels of each value head.
        normalization: "RMSNorm" by default here, as upstream.
        rope_type: "yarn" or "rope".
        rotary_base: Base of the RoPE / YaRN frequencies.
        rotary_percent: Share of the rotated channels RoPE rotates ("rope" only).
        rotary_scaling_factor: YaRN's context extension factor s.
        original_max_position_embeddings: YaRN's pre-training context length.
        beta_fast, beta_slow: YaRN's band, in rotations over the original context.
        mscale, mscale_all_dim: YaRN's attention-scale coefficients (see above).
        cache_mla_latents, mla_down_proj_fusion: Upstream's latent cache for inference and its
            fused down-projection: not built, False only.
    """

    multi_latent_attention: bool = True
    q_lora_rank: int | None = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"
    rotary_base: float = 10000
    rotary_percent: float = ranged(1.0, Range(0, 1, low_open=True))
    rotary_scaling_factor: float = ranged(40, POSITIVE)
    original_max_position_embeddings: int = 4096
    beta_fast: float = ranged(32, POSITIVE)
    beta_slow: float = ranged(1, POSITIVE)
    mscale: float = ranged(1.0, FINITE)
    mscale_all_dim: float = ranged(0.0, FINITE)
    cache_mla_latents: bool = False
    mla_down_proj_fusion: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.multi_latent_attention:
            raise ValueError(
                "MLATransformerConfig(multi_latent_attention=False): this config describes "
                "multi-latent attention; use a TransformerConfig for standard attention."
            )
        for name in (
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "original_max_position_embeddings",
        ):
            check_positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            check_positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(
                f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be even: RoPE rotates "
                "channel pairs."
            )
        self._check_mla_rope()
        self._check_mla_attention_options()

    def _check_mla_rope(self) -> None:
        if self.rope_type not in MLA_ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {MLA_ROPE_TYPES}, got {self.rope_type!r}.")
        if not (math.isfinite(self.rotary_base) and self.rotary_base > 0):
            raise ValueError(f"rotary_base must be > 0 and finite, got {self.rotary_base}.")
        if self.rope_type == "yarn" and self.rotary_percent != 1.0:
            raise ValueError(
                f"rotary_percent={self.rotary_percent} applies to rope_type='rope'; YaRN "
                "rotates every qk_pos_emb_head_dim channel: leave it 1.0."
            )
        for name in ("mscale", "mscale_all_dim"):
            if yarn_mscale(self.rotary_scaling_factor, getattr(self, name)) <= 0:
                raise ValueError(
                    f"{name}={getattr(self, name)} with rotary_scaling_factor="
                    f"{self.rotary_scaling_factor} gives a YaRN scale 0.1 * {name} * "
                    "ln(rotary_scaling_factor) + 1 <= 0; choose a larger value."
                )

    def _check_mla_attention_options(self) -> None:
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError(
                f"num_query_groups={self.num_query_groups}: multi-latent attention has no query "
                "groups (every head has its key and value); leave num_query_groups None."
            )
        refused = {
            "qk_l2_norm": "Llama-4's query-key norm does not apply to the latents",
            "rotary_interleaved": "MLA rotates adjacent channel pairs already, as upstream",
            "softmax_scale": "MLA's scale is YaRN's (see MLATransformerConfig)",
            "cache_mla_latents": "the latent cache of upstream's inference is not built",
            "mla_down_proj_fusion": "the fused down-projection (Transformer Engine's) is not built",
        }
        standard_yarn = yarn_fields_set(self)
        if standard_yarn:
            raise ValueError(
                f"{', '.join(standard_yarn)}: the yarn_* fields set standard attention's YaRN; "
                "multi-latent attention's is rotary_scaling_factor, "
                "original_max_position_embeddings, beta_fast, beta_slow, mscale and "
                "mscale_all_dim: set those and leave the yarn_* fields at their defaults."
            )
        given = [name for name in refused if getattr(self, name) not in (None, False)]
        if given:
            reasons = "; ".join(
                f"{name}={getattr(self, name)!r}: {refused[name]}" for name in given
            )
            raise ValueError(
                f"{reasons}. Leave {', '.join(given)} at the default with multi-latent attention."
            )


def yarn_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale 0.1 * mscale * ln(scaling_factor) + 1 (1 when the factor is at
    most 1), upstream's `_yarn_get_mscale`."""
    if scaling_factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_concentration_factor(
    scaling_factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0
) -> float:
    """YaRN's concentration factor yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim), which
    multiplies the rotated queries and keys (upstream's `_yarn_get_concentration_factor`,
    Hugging Face's `attention_factor`): 0.1 ln(s) + 1 at the defaults, 1 for s <= 1."""
    return yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim)


YARN_FIELDS = (
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
)
"""`TransformerConfig`'s YaRN fields (standard attention's; read with
`position_embedding_type="yarn"`)."""


def yarn_fields_set(config: TransformerConfig) -> list[str]:
    """The YaRN fields of `config` that differ from their defaults, as `field=value`."""
    defaults = {field.name: field.default for field in dataclasses.fields(TransformerConfig)}
    return [
        f"{name}={getattr(config, name)!r}"
        for name in YARN_FIELDS
        if getattr(config, name) != defaults[name]
    ]


@functools.cache
def _check_cpp_compiler() -> None:
    """Where CUDA is present (where layers ask for the C++ wrapper), checks that inductor finds
    its C++ compiler, which the wrapper needs and the Python one does not: when the config is
    built, on every rank, rather than inside inductor at the first forward. Once per process
    where the compiler is found (finding it runs it).

    Raises:
        ValueError: no compiler that inductor looks for runs here.
    """
    if torch.cuda.is_available() and not inductor_finds_cpp_compiler():
        from torch._inductor import config

        raise ValueError(
            "compile_layers with compile_cpp_wrapper on CUDA needs a C++ compiler to build "
            "inductor's C++ wrappers, and none that inductor looks for runs here "
            f"(torch._inductor.config.cpp.cxx: {config.cpp.cxx!r}, from $CXX, else g++): "
            "install one or point $CXX at one, or have the wrappers generated in Python with "
            "--no-compile-cpp-wrapper (compile_cpp_wrapper=False)."
        )


def inductor_finds_cpp_compiler() -> bool:
    """Whether inductor's C++ compiler (`torch._inductor.config.cpp.cxx`: `$CXX`, else g++)
    runs here: inductor needs it for CPU kernels and for C++ wrappers."""
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except (exc.InvalidCxxCompiler, OSError):
        return False
    return True
