"""Layer specs for GPT: which classes fill the slots of a `TransformerLayer`.

`get_gpt_layer_local_spec()` needs only PyTorch (apex's fused norms are used when apex is
installed) and splits attention and the MLP over the tensor-parallel group
(`ColumnParallelLinear` / `RowParallelLinear`, which are plain projections at size 1); with
`multi_latent_attention=True` its attention is `MLASelfAttention` (built with the local spec only);
`get_gpt_layer_with_transformer_engine_spec()` uses Transformer Engine's fused norm + linear
modules (tensor-parallel size 1 only) and fails with install instructions when TE is missing.
`get_gpt_decoder_block_spec()` wraps either into a whole-decoder spec whose final norm comes from
the same backend (`TENorm` with Transformer Engine), as in Megatron-LM, makes the layers that
`config.moe_layer_freq` names Mixture of Experts layers when `config.num_moe_experts` is set (MoE
layers are built with the local spec only), and multi-latent attention layers when
`config.multi_latent_attention` is (an `MLATransformerConfig`). `get_gpt_mtp_block_spec()` gives
the multi-token prediction depths of `config.mtp_num_layers` from the same backend.
"""

from __future__ import annotations

import warnings

from megatron.core.fusions.fused_layer_norm import HAVE_APEX, FusedLayerNorm
from megatron.core.pipeline_parallel.stage import pipeline_rank
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.linear import Linear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_config import moe_layer_pattern
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import NORMALIZATIONS, TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)


def _local_mlp_submodules() -> MLPSubmodules:
    """The local spec's MLP projections (the dense MLP's and the shared experts')."""
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def get_moe_module_spec(*, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """Spec of an `MoELayer` from PyTorch modules: `TopKRouter`, `SequentialMLP` experts (or
    `GroupedMLP` with `moe_grouped_gemm`) and `SharedExpertMLP` shared experts."""
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            router=TopKRouter,
            experts=GroupedMLP if moe_grouped_gemm else SequentialMLP,
            shared_experts=ModuleSpec(
                module=SharedExpertMLP,
                submodules=_local_mlp_submodules(),
            ),
        ),
    )


def get_gpt_layer_local_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool | None = None,
    multi_latent_attention: bool = False,
    fp8: str | None = None,
    normalization: str | None = None,
    qk_l2_norm: bool | None = None,
) -> ModuleSpec:
    """Spec of a GPT layer built from PyTorch modules (apex's fused norms when available), with
    Megatron-core's arguments in its order.

    Args:
        num_experts: None: a dense MLP; set: an `MoELayer` (the count itself comes from
            `config.num_moe_experts`, as in Megatron-core).
        moe_grouped_gemm: The MoE experts run grouped GEMMs (`GroupedMLP`).
        qk_layernorm, qk_l2_norm: None (the default here): the query-key norms follow
            `config.qk_layernorm` / `config.qk_l2_norm`. False for both: the spec has none
            (`IdentityOp`), and a config asking for them is refused when the layer is built
            (Megatron-core would silently build none). True: as None. With
            `multi_latent_attention` they are the latent norms (`qk_l2_norm` must not be True).
        multi_latent_attention: The attention is `MLASelfAttention` (the config must be an
            `MLATransformerConfig`): its down-projections replicated `Linear`s, its
            up-projections column-parallel, the output projection row-parallel.
        fp8: Ignored with a warning, as Megatron-core (deprecated there).
        normalization: "LayerNorm" or "RMSNorm" to pin the spec to that normalisation (building
            it with a config that says otherwise raises `ValueError`); None follows
            `config.normalization`.

    Returns:
        A `TransformerLayer` `ModuleSpec`.
    """
    if normalization is not None and normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {NORMALIZATIONS} or None, got {normalization!r}."
        )
    _warn_fp8(fp8)
    norm = ModuleSpec(
        module=FusedLayerNorm if HAVE_APEX else WrappedTorchNorm,
        params={"normalization": normalization},
    )
    qk_norm = _qk_norm_slot(norm, qk_layernorm, qk_l2_norm)
    if multi_latent_attention:
        if qk_l2_norm:
            raise ValueError(
                "qk_l2_norm=True with multi_latent_attention=True: Llama-4's query-key norm "
                "does not apply to multi-latent attention (as in Megatron-core); drop it."
            )
        attention = _local_mla_spec(qk_norm)
    else:
        attention = ModuleSpec(
            module=SelfAttention,
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
                # Built only with config.qk_layernorm (or qk_l2_norm).
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            pre_mlp_layernorm=norm,
            mlp=(
                ModuleSpec(module=MLP, submodules=_local_mlp_submodules())
                if num_experts is None
                else get_moe_module_spec(moe_grouped_gemm=moe_grouped_gemm)
            ),
        ),
    )


def _local_mla_spec(latent_norm: ModuleSpec | type) -> ModuleSpec:
    """The local spec's `MLASelfAttention`: replicated down-projections (module docstring of
    `multi_latent_attention`), column-parallel up-projections, its latent norms
    `latent_norm` (built with `config.qk_layernorm`)."""
    return ModuleSpec(
        module=MLASelfAttention,
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=Linear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=Linear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool | None = None,
    multi_latent_attention: bool = False,
    fp8: str | None = None,
    qk_l2_norm: bool | None = None,
) -> ModuleSpec:
    """Spec of a GPT layer using Transformer Engine's fused norm + linear modules, with
    Megatron-core's leading arguments in its order.

    The norms are fused into the QKV projection and fc1 (`TELayerNormLinear`), so the layer's
    own norm slots hold `IdentityOp`. The core attention stays PyTorch SDPA.

    Args:
        num_experts: Must be None: MoE layers with Transformer Engine are not built.
        moe_grouped_gemm: Must be False (likewise).
        qk_layernorm, qk_l2_norm, fp8: as `get_gpt_layer_local_spec`.
        multi_latent_attention: Must be False: multi-latent attention is built with the local
            spec only.

    Returns:
        A `TransformerLayer` `ModuleSpec`.

    Raises:
        ImportError: transformer-engine is not installed; the message says how to install it
            and how to fall back to the local spec.
        ValueError: `num_experts`, `moe_grouped_gemm` or `multi_latent_attention` is set.
    """
    _refuse_te_moe(num_experts is not None or moe_grouped_gemm)
    _refuse_te_mla(multi_latent_attention)
    _warn_fp8(fp8)
    # Imported here so that importing this module never pays for (or trips over) TE.
    from megatron.core.extensions.transformer_engine import (
        TELayerNormLinear,
        TELinear,
        TENorm,
        require_te,
    )

    require_te()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=TELayerNormLinear,
                    core_attention=DotProductAttention,
                    linear_proj=TELinear,
                    q_layernorm=_qk_norm_slot(TENorm, qk_layernorm, qk_l2_norm),
                    k_layernorm=_qk_norm_slot(TENorm, qk_layernorm, qk_l2_norm),
                ),
            ),
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=TELayerNormLinear, linear_fc2=TELinear),
            ),
        ),
    )


def get_gpt_decoder_block_spec(
    config: TransformerConfig, use_transformer_engine: bool
) -> TransformerBlockSubmodules:
    """Spec of the whole GPT decoder: `config.num_layers` layer specs and the final norm.

    A bare layer spec gives `TransformerBlock` the default final norm (`LayerNormImpl`); this one
    takes the final norm from the layers' backend, so a Transformer Engine model normalises its
    output with TE too (`TENorm`), as Megatron-LM's `get_gpt_decoder_block_spec` does.

    With `config.num_moe_experts`, the layers `config.moe_layer_freq` names (an int N: layers
    0, N, 2N, ...; a list: its 1s) get an `MoELayer` (`GroupedMLP` experts with
    `config.moe_grouped_gemm`), the others the dense MLP. With `config.multi_latent_attention`
    every layer's attention is `MLASelfAttention`.

    Args:
        config: The transformer configuration (`num_layers`, the MoE fields).
        use_transformer_engine: Build from `get_gpt_layer_with_transformer_engine_spec()` and
            `TENorm` instead of `get_gpt_layer_local_spec()` and `LayerNormImpl`.

    Returns:
        A `TransformerBlockSubmodules`, accepted by `GPTModel` and `TransformerBlock` in place of
        a layer spec.

    Raises:
        ImportError: `use_transformer_engine` without transformer-engine installed.
        ValueError: `use_transformer_engine` with MoE layers or multi-latent attention (not
            built).
    """
    mla = config.multi_latent_attention
    if use_transformer_engine:
        _refuse_te_moe(config.num_moe_experts is not None)
        _refuse_te_mla(mla)
        from megatron.core.extensions.transformer_engine import TENorm

        dense_spec, layer_norm = get_gpt_layer_with_transformer_engine_spec(), TENorm
        moe_spec = None
    else:
        dense_spec = get_gpt_layer_local_spec(multi_latent_attention=mla)
        layer_norm = LayerNormImpl
        moe_spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            multi_latent_attention=mla,
        )
    return TransformerBlockSubmodules(
        layer_specs=[moe_spec if moe else dense_spec for moe in moe_layer_pattern(config)],
        layer_norm=layer_norm,
    )


def get_gpt_mtp_block_spec(
    config: TransformerConfig,
    spec: TransformerBlockSubmodules | ModuleSpec,
    use_transformer_engine: bool,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> MultiTokenPredictionBlockSubmodules | None:
    """Spec of the multi-token prediction depths (Megatron-core's arguments, in its order).

    Each of the `config.mtp_num_layers` depths gets the transformer layer spec of the decoder's
    last layer, and norms and the `eh_proj` projection from that backend: the local spec's norm
    and `ColumnParallelLinear`, or `TENorm` and `TELinear`.

    Args:
        config: The transformer configuration.
        spec: The decoder's spec: `get_gpt_decoder_block_spec()`'s, or one layer spec.
        use_transformer_engine: Take the norms and the projection from Transformer Engine.
        vp_stage, pp_rank: The model chunk's pipeline placement: its virtual stage (None
            without virtual stages) and pipeline rank (None: this rank's, from
            parallel_state). The depths live on the last chunk of the last stage, as
            Megatron-core places them by default.

    Returns:
        The block spec for `GPTModel(mtp_block_spec=...)`, or None when
        `config.mtp_num_layers` is None or the chunk is not the model's last.

    Raises:
        ValueError: `spec` is neither; `pp_rank` is None and parallel_state's pipeline size
            is not the config's; or `vp_stage` is None with several virtual stages.
        ImportError: `use_transformer_engine` without transformer-engine installed.
    """
    if config.mtp_num_layers is None:
        return None
    if pp_rank is None:
        pp_rank = pipeline_rank(config, None)
    last_chunk = (config.virtual_pipeline_model_parallel_size or 1) - 1
    if vp_stage is None and last_chunk > 0:
        raise ValueError(
            f"{last_chunk + 1} virtual pipeline stages: pass the chunk's vp_stage, the depths "
            "live on the last chunk only."
        )
    if pp_rank != config.pipeline_model_parallel_size - 1 or vp_stage not in (None, last_chunk):
        return None
    if isinstance(spec, TransformerBlockSubmodules):
        layer_spec = spec.layer_specs[-1]
    elif isinstance(spec, ModuleSpec) and issubclass(spec.module, TransformerLayer):
        layer_spec = spec
    else:
        raise ValueError(
            "get_gpt_mtp_block_spec needs the decoder's TransformerBlockSubmodules or a "
            f"TransformerLayer ModuleSpec, got {spec!r}."
        )
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TELinear, TENorm

        norm, projection = TENorm, TELinear
    else:
        norm, projection = LayerNormImpl, ColumnParallelLinear
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm,
            hnorm=norm,
            eh_proj=projection,
            transformer_layer=layer_spec,
            layer_norm=norm,
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)


def _qk_norm_slot(
    norm: ModuleSpec | type, qk_layernorm: bool | None, qk_l2_norm: bool | None
) -> ModuleSpec | type:
    """What the query-key norm slots hold: `IdentityOp` where the caller said no norm (both
    False, or one False and the other left None), else `norm` (built if the config asks)."""
    if qk_layernorm is None and qk_l2_norm is None:
        return norm
    return norm if (qk_layernorm or qk_l2_norm) else IdentityOp


def _refuse_te_mla(multi_latent_attention: bool) -> None:
    if multi_latent_attention:
        raise ValueError(
            "Multi-latent attention with Transformer Engine is not built; build it with the "
            "local spec (--transformer-impl local, get_gpt_layer_local_spec("
            "multi_latent_attention=True) or get_gpt_decoder_block_spec(config, "
            "use_transformer_engine=False))."
        )


def _warn_fp8(fp8: str | None) -> None:
    if fp8 is not None:
        warnings.warn(
            "The fp8 argument of the GPT layer specs is ignored, as Megatron-core ignores it "
            "(deprecated there).",
            stacklevel=3,
        )


def _refuse_te_moe(moe: bool) -> None:
    if moe:
        raise ValueError(
            "Mixture of Experts layers with Transformer Engine are not built; build them with "
            "the local spec (--transformer-impl local, get_gpt_layer_local_spec(num_experts=...) "
            "or get_gpt_decoder_block_spec(config, use_transformer_engine=False))."
        )
