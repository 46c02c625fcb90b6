"""Shape, regularisation, initialisation and recompute settings of a transformer.

`TransformerConfig` uses Megatron-LM's field names so that configs, command-line flags and
checkpoints translate one to one. Derived defaults (`ffn_hidden_size`, `kv_channels`,
`num_query_groups`, the init methods) are filled in by `__post_init__`, which also rejects
inconsistent values with a `ValueError` that names the field and the fix.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core.fp8.recipe import check_fp8_config
from megatron.core.model_parallel_config import ModelParallelConfig, check_positive_int
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.moe.moe_config import check_moe_config
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
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")
"""Values of `recompute_modules` the local layers implement."""
UNBUILT_RECOMPUTE_MODULES = {
    "moe_act": (
        "the output-discarding checkpoint of the expert activation is not built; recompute the "
        "whole MoE layer with 'moe' instead"
    ),
    "mla_up_proj": "there is no multi-latent attention",
    "gdn_norm_out": "there are no GatedDeltaNet layers",
    "gdp_in_proj": "there are no GatedDeltaProduct layers",
    "gdp_qkv": "there are no GatedDeltaProduct layers",
    "mhc": "there are no hyper-connections",
}
"""Upstream's other `recompute_modules` values, and why they do not apply here."""
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")


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
        recompute_granularity: None, "full" (recompute whole transformer layers in backward, as
            `recompute_method` says) or "selective" (recompute the `recompute_modules`).
        recompute_method: With "full": "uniform" (the layers in chunks of `recompute_num_layers`,
            each chunk one checkpoint) or "block" (the first `recompute_num_layers` layers, one
            checkpoint each; the rest store their activations). None: every layer on its own
            (uniform, one layer per chunk); the flags require it, as Megatron-LM's config does.
        recompute_num_layers: Layers per chunk ("uniform") or layers recomputed ("block").
        recompute_modules: With "selective": which parts of each layer are recomputed, among
            `RECOMPUTE_MODULES`; None means `["core_attn"]` (Megatron-LM's default).
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
            engine's) stay outside the compiled code, and linear layers whose weights get
            gradients run between the compiled graphs, so that gradient-accumulation fusion
            keeps working. Compiling costs time at the first steps, and each graph boundary host
            time at every step: it pays where the GPU, not the host, bounds the step (large
            batches, CUDA-graphed steps).
        compile_backend: The `torch.compile` backend of `compile_layers` ("inductor" generates
            Triton and C++ kernels; "aot_eager" traces without generating code, for checking).
        seq_length: Training sequence length, when known when the model is built; lets the
            model check it against its position-embedding table early.
        calculate_per_token_loss: The training loss is a sum over tokens divided by the global
            token count (Megatron-LM's `--calculate-per-token-loss`); the MoE auxiliary losses
            are then scaled by the local token count so that their gradients keep their weight.
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
        fp8_recipe: "delayed" (scales from an amax history) or "tensorwise" (current
            scaling); upstream's "blockwise", "mxfp8" and "custom" are refused.
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
        bias_activation_fusion, masked_softmax_fusion, bias_dropout_fusion, persist_layer_norm,
            memory_efficient_layer_norm: Megatron-core's kernel-fusion switches, accepted with no
            effect (they change speed only; here PyTorch or `torch.compile` picks the kernels).
        fp32_residual_connection, window_size: Megatron-core's fp32 residual stream and sliding
            window attention, not built: their defaults (False, None) only.
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
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"
    compile_layers: bool = False
    compile_backend: str = "inductor"
    seq_length: int | None = None
    calculate_per_token_loss: bool = False

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
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    bias_dropout_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    fp32_residual_connection: bool = False
    window_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            check_positive_int(name, getattr(self, name))

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
        self._check_compile()
        check_moe_config(self)
        check_fp8_config(self)
        self._check_tensor_parallel()
        if not callable(self.activation_func):
            raise ValueError(f"activation_func must be callable, got {self.activation_func!r}.")
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

    def _check_compile(self) -> None:
        if not self.compile_layers:
            return
        if self.compile_backend not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(
                f"compile_backend {self.compile_backend!r} is not a torch.compile backend; use "
                "'inductor' (generates kernels), 'aot_eager' (traces without generating them) "
                "or another of torch.compiler.list_backends(exclude_tags=())."
            )

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
        if self.sequence_parallel and self.seq_length is not None and self.seq_length % tp:
            raise ValueError(
                f"seq_length ({self.seq_length}) must be divisible by tensor_model_parallel_size "
                f"({tp}) with sequence_parallel: each rank keeps seq_length / {tp} positions; "
                "change seq_length or set sequence_parallel=False."
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

    def _check_attention_options(self) -> None:
        if self.fp32_residual_connection or self.window_size is not None:
            raise ValueError(
                f"fp32_residual_connection={self.fp32_residual_connection}, window_size="
                f"{self.window_size}: an fp32 residual stream and sliding-window attention are "
                "not built; leave them False and None."
            )
        if not isinstance(self.attention_backend, AttnBackend):
            raise ValueError(
                f"attention_backend must be an AttnBackend, got {self.attention_backend!r}; "
                f"choose among {[backend.name for backend in AttnBackend]}."
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
