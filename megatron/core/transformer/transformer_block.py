"""The decoder stack: `num_layers` transformer layers followed by a final norm.

Full activation recompute (`recompute_granularity="full"`) is applied here, with Megatron-LM's
two methods: "uniform" checkpoints the layers in chunks of `recompute_num_layers`, "block" the
first `recompute_num_layers` layers one by one.

Under sequence parallelism the layers run in training in the RNG tracker's tensor-parallel state
(as in Megatron-core; seed it with `model_parallel_cuda_manual_seed`): each rank holds a
different part of the sequence, so its dropout masks must differ from the other ranks'.

With `config.fp8` the block gives the linear layers of its FP8 layers (all but the high-precision
first / last ones of `first_last_layers_bf16`), the MoE experts' projections and shared experts
included, their FP8 settings as it builds them, and under
delayed scaling owns the decoder's `DelayedScalingState` (the submodule `fp8_state`, whose
histories and scales the model's state dict holds as `decoder.fp8_state._extra_state`): its
forward slots are reduced and updated after the layer loop, its backward slots once the backward
of every layer is done (Transformer Engine's autocast exit and end of backward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fp8.experts import Fp8ExpertSlots
from megatron.core.fp8.linear import Fp8LinearSlots, check_fp8_dims
from megatron.core.fp8.recipe import Fp8Recipe, is_first_last_bf16_layer, recipe_from_config
from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.fusions.fused_layer_norm import HAVE_APEX, FusedLayerNorm
from megatron.core.pipeline_parallel.layer_split import pipeline_split
from megatron.core.pipeline_parallel.stage import pipeline_rank
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.linear import Linear
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_config import moe_layer_pattern
from megatron.core.transformer.recompute import is_recomputing
from megatron.core.transformer.recompute import recompute as recompute_checkpoint
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

LayerNormImpl = FusedLayerNorm if HAVE_APEX else WrappedTorchNorm
"""Norm of the final layer norm when the spec names none: apex's fused one when available."""

FP8_LINEARS = (ColumnParallelLinear, RowParallelLinear, Linear)
"""The linear layers that run in FP8 inside an FP8 transformer layer."""


@dataclass
class TransformerBlockSubmodules:
    """Specs of a `TransformerBlock`: one per layer, and the final norm.

    Attributes:
        layer_specs: One `TransformerLayer` spec per layer.
        layer_norm: Spec of the final norm; None means `LayerNormImpl`.
    """

    layer_specs: list[ModuleSpec] = field(default_factory=list)
    layer_norm: ModuleSpec | type | None = None


def _get_block_submodules(
    config: TransformerConfig, spec: TransformerBlockSubmodules | ModuleSpec
) -> TransformerBlockSubmodules:
    """Turns a single layer spec into a block spec repeating it `config.num_layers` times."""
    if isinstance(spec, TransformerBlockSubmodules):
        submodules = spec
    elif isinstance(spec, ModuleSpec) and issubclass(get_module(spec), TransformerLayer):
        submodules = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers)
    else:
        raise ValueError(
            "TransformerBlock needs a TransformerLayer ModuleSpec or TransformerBlockSubmodules, "
            f"got {spec!r}."
        )
    if len(submodules.layer_specs) != config.num_layers:
        raise ValueError(
            f"the block spec has {len(submodules.layer_specs)} layer specs but "
            f"config.num_layers is {config.num_layers}; make them equal."
        )
    if submodules.layer_norm is None:
        submodules = TransformerBlockSubmodules(submodules.layer_specs, LayerNormImpl)
    return submodules


class TransformerBlock(MegatronModule):
    """`config.num_layers` transformer layers, then (optionally) a final norm.

    Args:
        config: The transformer configuration.
        spec: A `TransformerLayer` spec (repeated for every layer) or `TransformerBlockSubmodules`.
        post_layer_norm: Whether to apply the final norm (`final_layernorm`).
        pg_collection: Process groups of the layers (`tp`, and `ep` of the MoE layers; `tp_dp_cp`
            reduces FP8 amaxes; `pp` places this stage); None means parallel_state's.
        vp_stage: This model chunk's virtual stage (None: the only one).

    Under pipeline parallelism (`config.pipeline_model_parallel_size` > 1) the block builds only
    its stage's layers (`megatron.core.pipeline_parallel.layer_split`), numbered as in the whole
    model; the spec still describes every layer.

    Raises:
        ValueError: with `config.num_moe_experts`, the layers that are MoE layers differ from
            those `config.moe_layer_freq` names (e.g. a dense layer spec was given); with
            `config.fp8`, a linear layer's sizes are not multiples of 16.
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: TransformerBlockSubmodules | ModuleSpec,
        post_layer_norm: bool = True,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
    ):
        super().__init__(config)
        self.submodules = _get_block_submodules(config, spec)
        self.post_layer_norm = post_layer_norm
        self.layer_range = pipeline_split(config).layers(
            pipeline_rank(config, pg_collection), vp_stage
        )
        """The 0-based global indices of the layers this block builds."""
        self.layers = torch.nn.ModuleList(
            build_module(
                self.submodules.layer_specs[number],
                config=config,
                layer_number=number + 1,
                pg_collection=pg_collection,
            )
            for number in self.layer_range
        )
        self._check_moe_layers()
        self.fp8_state: DelayedScalingState | None = None
        """The model's delayed-scaling state (`fp8_recipe="delayed"`, a submodule: checkpoints
        hold it), else None."""
        recipe = recipe_from_config(config)
        if recipe is not None:
            self.fp8_state = self._enable_fp8(recipe, pg_collection)
        if post_layer_norm:
            self.final_layernorm = build_module(
                self.submodules.layer_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
                tp_group=resolve_tp_group(pg_collection) if config.sequence_parallel else None,
            )
        else:
            self.final_layernorm = None

    def _check_moe_layers(self) -> None:
        if self.config.num_moe_experts is None:
            return
        expected = [moe_layer_pattern(self.config)[i] for i in self.layer_range]
        built = [getattr(layer, "is_moe_layer", False) for layer in self.layers]
        if built != expected:
            raise ValueError(
                f"config.num_moe_experts={self.config.num_moe_experts} with moe_layer_freq="
                f"{self.config.moe_layer_freq} asks for MoE layers at {_ones(expected)}, but "
                f"the layer spec builds them at {_ones(built)}; build the model with "
                "get_gpt_decoder_block_spec(config, use_transformer_engine=False), which follows "
                "the config."
            )

    def _enable_fp8(
        self, recipe: Fp8Recipe, pg_collection: ProcessGroupCollection | None
    ) -> DelayedScalingState | None:
        """Gives the linear layers of each FP8 layer their FP8 settings; returns the
        delayed-scaling state they share (None for current scaling)."""
        state = DelayedScalingState(recipe, amax_group(pg_collection)) if recipe.delayed else None
        for index, layer in enumerate(self.layers):
            if not is_first_last_bf16_layer(self.config, layer.layer_number - 1):
                enable_fp8_linears(layer, f"layers.{index}", recipe, state)
        return state

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs every layer, then the final norm.

        With `recompute_granularity="full"` (in training, with autograd on) the layers of each
        recompute chunk (`recompute_chunks`) run inside one `torch.utils.checkpoint`
        (non-reentrant): only the chunk's input is stored, and its layers, forward hooks
        included, run again in backward. Dropout masks are replayed.

        Args:
            hidden_states: [s, b, h] ([s/T, b, h] under sequence parallelism).
            attention_mask: None for causal attention, or a boolean mask (True = masked out).
            rotary_pos_emb: Rotary angles [s, 1, 1, rot_dim], or None.

        Returns:
            Hidden states of the input's shape.
        """
        recompute = (
            self.config.recompute_granularity == "full"
            and self.training
            and torch.is_grad_enabled()
        )
        chunks = self.recompute_chunks() if recompute else [(0, len(self.layers), False)]
        fp8_state = None if is_recomputing() else self.fp8_state
        hidden_states = end_backward_after(hidden_states, fp8_state, self)
        rng_context = (
            get_cuda_rng_tracker().fork()
            if self.config.sequence_parallel and self.training
            else contextlib.nullcontext()
        )
        with rng_context:
            for start, end, checkpointed in chunks:
                args = (start, end, hidden_states, attention_mask, rotary_pos_emb)
                if checkpointed:
                    hidden_states = recompute_checkpoint(self._run_layers, *args)
                else:
                    hidden_states = self._run_layers(*args)
        if fp8_state is not None:
            fp8_state.end_forward()
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def recompute_chunks(self) -> list[tuple[int, int, bool]]:
        """The layers as `(start, end, checkpointed)` runs under full recompute.

        "uniform" (or no method): consecutive chunks of `recompute_num_layers` layers (1 when
        None), each checkpointed; "block": the first `recompute_num_layers` layers checkpointed
        one by one, then the rest in one run that stores its activations.
        """
        num_layers = len(self.layers)
        per_chunk = self.config.recompute_num_layers or 1
        if self.config.recompute_method == "block":
            chunks = [(i, i + 1, True) for i in range(min(per_chunk, num_layers))]
            if per_chunk < num_layers:
                chunks.append((per_chunk, num_layers, False))
            return chunks
        return [
            (start, min(start + per_chunk, num_layers), True)
            for start in range(0, num_layers, per_chunk)
        ]

    def _run_layers(
        self,
        start: int,
        end: int,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb: torch.Tensor | None,
    ) -> torch.Tensor:
        for layer in self.layers[start:end]:
            # Layers return Megatron's (hidden_states, context); context is None without
            # cross-attention, so only the hidden states go on to the next layer.
            hidden_states, _ = layer(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states


def _ones(pattern: list[bool]) -> list[int]:
    return [index for index, flag in enumerate(pattern) if flag]


def enable_fp8_linears(
    module: torch.nn.Module, name: str, recipe: Fp8Recipe, state: DelayedScalingState | None
) -> None:
    """Gives every linear layer inside `module` (named `name` in messages), the MoE experts'
    projections included, its FP8 settings, with `state` the delayed-scaling state they share
    (None for current scaling).

    Raises:
        ValueError: a weight's sizes are not multiples of 16 (`check_fp8_dims`).
    """
    for inner_name, inner in module.named_modules():
        path = f"{name}.{inner_name}" if inner_name else name
        if isinstance(inner, FP8_LINEARS) and inner.weight is not None:
            check_fp8_dims(path, inner.weight.shape)
            inner.fp8 = Fp8LinearSlots(recipe, state)
        elif isinstance(inner, SequentialMLP):
            slots = []
            for part in ("linear_fc1", "linear_fc2"):
                linear = getattr(inner, part)
                # Each expert's weight is one linear layer's.
                check_fp8_dims(f"{path}.{part}", linear.weight.shape[1:])
                slots.append(
                    Fp8ExpertSlots(
                        recipe,
                        state,
                        num_experts=inner.config.num_moe_experts,
                        first_expert=linear.first_expert,
                        num_local_experts=linear.weight.shape[0],
                        graphed=inner.config.cuda_graph_impl == "full_iteration",
                    )
                )
            inner.enable_fp8(*slots)


def amax_group(pg_collection: ProcessGroupCollection | None) -> dist.ProcessGroup | None:
    """Where FP8 amaxes are reduced: every rank of the pipeline stage (tensor x data x context
    parallel, Megatron-LM's amax reduction group), from `pg_collection`, else parallel_state,
    else the default group (one stage); None without torch.distributed."""
    if pg_collection is not None and pg_collection.tp_dp_cp is not None:
        return pg_collection.tp_dp_cp
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


class _EndOfBackward(torch.autograd.Function):
    """Identity whose backward ends the delayed-scaling backward pass: at the block's input, it
    runs after the backward of every layer."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, anchor: torch.Tensor | None, state: DelayedScalingState
    ) -> torch.Tensor:
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.state.end_backward()
        return grad, None, None


def end_backward_after(
    x: torch.Tensor, state: DelayedScalingState | None, module: torch.nn.Module
) -> torch.Tensor:
    """`x`, the input of `module`'s FP8 layers whose delayed-scaling state is `state`, through
    `_EndOfBackward` where a backward through them can come; else `x` itself (without a state,
    without autograd, or where neither `x` nor any weight of `module` needs a gradient: a frozen
    model's outputs must not start needing one). An input that needs no gradient (the weights
    do) gets an empty anchor that does, so that the node is part of the backward."""
    if state is None or not torch.is_grad_enabled():
        return x
    if not x.requires_grad and not any(p.requires_grad for p in module.parameters()):
        return x
    anchor = None if x.requires_grad else torch.empty(0, device=x.device, requires_grad=True)
    return _EndOfBackward.apply(x, anchor, state)
