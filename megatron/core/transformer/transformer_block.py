"""The decoder stack: `num_layers` transformer layers followed by a final norm.

Full activation recompute (`recompute_granularity="full"`) is applied here, with Megatron-LM's
two methods: "uniform" checkpoints the layers in chunks of `recompute_num_layers`, "block" the
first `recompute_num_layers` layers one by one.

Under sequence parallelism the layers run in training in the RNG tracker's tensor-parallel state
(as in Megatron-core; seed it with `model_parallel_cuda_manual_seed`): each rank holds a
different part of the sequence, so its dropout masks must differ from the other ranks'.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from megatron.core.fusions.fused_layer_norm import HAVE_APEX, FusedLayerNorm
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.moe.moe_config import moe_layer_pattern
from megatron.core.transformer.recompute import recompute as recompute_checkpoint
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

LayerNormImpl = FusedLayerNorm if HAVE_APEX else WrappedTorchNorm
"""Norm of the final layer norm when the spec names none: apex's fused one when available."""


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
        pg_collection: Process groups of the layers (`tp`, and `ep` of the MoE layers); None
            means parallel_state's.

    Raises:
        ValueError: with `config.num_moe_experts`, the layers that are MoE layers differ from
            those `config.moe_layer_freq` names (e.g. a dense layer spec was given).
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: TransformerBlockSubmodules | ModuleSpec,
        post_layer_norm: bool = True,
        *,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
        self.submodules = _get_block_submodules(config, spec)
        self.post_layer_norm = post_layer_norm
        self.layers = torch.nn.ModuleList(
            build_module(
                layer_spec, config=config, layer_number=number + 1, pg_collection=pg_collection
            )
            for number, layer_spec in enumerate(self.submodules.layer_specs)
        )
        self._check_moe_layers()
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
        expected = moe_layer_pattern(self.config)
        built = [getattr(layer, "is_moe_layer", False) for layer in self.layers]
        if built != expected:
            raise ValueError(
                f"config.num_moe_experts={self.config.num_moe_experts} with moe_layer_freq="
                f"{self.config.moe_layer_freq} asks for MoE layers at {_ones(expected)}, but "
                f"the layer spec builds them at {_ones(built)}; build the model with "
                "get_gpt_decoder_block_spec(config, use_transformer_engine=False), which follows "
                "the config."
            )

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
