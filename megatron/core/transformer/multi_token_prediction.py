"""Multi-token prediction (MTP, DeepSeek-V3): extra depths that each predict one token further.

Depth k (1 <= k <= D = `config.mtp_num_layers`) sees, at position i, the hidden state of depth
k - 1 there (depth 0: the decoder's output, after its final norm) and the embedding of token
i + k, and predicts the token after it, i + k + 1:

    h_k = final_layernorm_k(layer_k(eh_proj_k([enorm_k(Emb(t_{i+k})); hnorm_k(h_{k-1})])))

`eh_proj_k` maps the concatenation (the embedding first, as Megatron-core orders it) back to the
hidden size; `layer_k` is one transformer layer of the decoder's last layer's spec (an MoE layer
when that one is). The embedding and the output layer are the model's own, shared by every
depth. The causal chain stays complete: each depth is a causal layer over the whole sequence.

The training objective gains the depths' losses (`process_mtp_loss`, called by `GPTModel`):
depth k's labels and loss mask are the model's shifted k positions further (the positions
shifted in from past the end are masked), its loss is averaged over its unmasked tokens like the
main loss, and the mean over the depths is weighted by `config.mtp_loss_scaling_factor`. The
losses reach the gradients through `MTPLossAutoScaler` on the decoder's output, whose backward
gives them the main loss's gradient scale, so the model still returns the main (next-token) loss
alone: that is what the training loop reports as "lm loss". Each depth's loss is recorded in
training for the log ("mtp_1 loss", ...: `MTPLossLoggingHelper`).

Names and state-dict layout are Megatron-core's (`mtp.layers.<k-1>.enorm`, `.hnorm`,
`.eh_proj`, `.transformer_layer.*`, `.final_layernorm`: the names of its checkpoints, whose
module attribute is `mtp_model_layer`). Under tensor parallelism `eh_proj` splits its output
features and its output is gathered again before the layer (Megatron-core's layout); under
sequence parallelism each rank holds its part of the sequence, as in the decoder. Under context
parallelism each rank holds two chunks of every sequence: the shifts move tokens across the
chunks' borders (`roll_tensor` with the cp group), and the losses are averaged over the unmasked
tokens of whole sequences, as the main loss is.

With `config.fp8` every depth's linear layers (`eh_proj` and the transformer layer's, the MoE
experts' included) run in FP8, whatever `first_last_layers_bf16` keeps in bf16 (Megatron-core
runs its depths under the global FP8 context too). Under delayed scaling the block owns their
`DelayedScalingState` (`mtp.fp8_state`, saved as `mtp.fp8_state._extra_state`), its passes
ending after the depths' forward and once their backward is done, as the decoder's state does
for the decoder's layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.core.context_parallel import gather_sequence, resolve_cp_group, split_sequence
from megatron.core.fp8.recipe import recipe_from_config
from megatron.core.fp8.scaling import DelayedScalingState
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import group_rank, group_size
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.recompute import is_recomputing
from megatron.core.transformer.recompute import recompute as recompute_checkpoint
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.transformer_block import (
    amax_group,
    enable_fp8_linears,
    end_backward_after,
)
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "MTPLossAutoScaler",
    "MTPLossLoggingHelper",
    "MultiTokenPredictionBlock",
    "MultiTokenPredictionBlockSubmodules",
    "MultiTokenPredictionLayer",
    "MultiTokenPredictionLayerSubmodules",
    "get_mtp_loss_logging_helper",
    "process_mtp_loss",
    "roll_tensor",
]


def roll_tensor(
    tensor: torch.Tensor,
    shifts: int = -1,
    dims: int = -1,
    cp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`tensor` shifted by `shifts` along `dims`, the positions rolled in from the other end
    set to 0 (Megatron-core's `roll_tensor`, which zeroes one position whatever the shift; its
    version also returns the sum, and handles packed sequences, which are not built here).

    Args:
        tensor: e.g. [b, s] token ids, labels or a loss mask.
        shifts: -1 moves every entry one position to the front (position i holds i + 1's).
        dims: The sequence dimension.
        cp_group: The context-parallel group when `tensor` holds this rank's two chunks of the
            sequence: the whole sequence is shifted (gathered, rolled and split again; these
            are small integer or mask tensors), so entries cross the chunks' borders.
    """
    cp_size = group_size(cp_group)
    if cp_size > 1:
        whole = roll_tensor(gather_sequence(tensor, dims, cp_group), shifts, dims)
        return split_sequence(whole, dims, group_rank(cp_group), cp_size)
    rolled = torch.roll(tensor, shifts=shifts, dims=dims)
    length = rolled.shape[dims]
    start, count = (length + shifts, -shifts) if shifts < 0 else (0, shifts)
    rolled.narrow(dims, start, min(count, length)).zero_()
    return rolled


@dataclass
class MultiTokenPredictionLayerSubmodules:
    """Specs of a `MultiTokenPredictionLayer`'s parts.

    Attributes:
        enorm: Norm of the shifted tokens' embeddings.
        hnorm: Norm of the previous depth's hidden states.
        eh_proj: The projection of the concatenated [2h] input to h (a column-parallel
            linear: `input_size, output_size, config=, init_method=, bias=, gather_output=,
            tp_group=`).
        transformer_layer: The depth's transformer layer (Megatron-core's `mtp_model_layer`).
        layer_norm: Norm of the depth's output, before the shared output layer.
    """

    enorm: ModuleSpec | type
    hnorm: ModuleSpec | type
    eh_proj: ModuleSpec | type
    transformer_layer: ModuleSpec | type
    layer_norm: ModuleSpec | type


class MultiTokenPredictionLayer(MegatronModule):
    """One prediction depth (see the module docstring).

    Under full activation recompute (`recompute_granularity="full"`, method "uniform" or
    None) the depth stores only its inputs and runs again in backward, as Megatron-core's;
    "block" recomputes the decoder's first layers only.

    Args:
        config: The transformer configuration.
        submodules: Specs of the parts.
        layer_number: The depth, from 1. Its transformer layer is numbered
            `config.num_layers + layer_number`, after the decoder's (MoE metrics are recorded
            per layer number; Megatron-core numbers them so too).
        pg_collection: Process groups (`tp` splits `eh_proj` and the layer); None means
            parallel_state's.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MultiTokenPredictionLayerSubmodules,
        layer_number: int = 1,
        *,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.tp_group = resolve_tp_group(pg_collection)
        norm_kwargs = dict(
            config=config,
            hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
            # Under sequence parallelism each rank normalises its part of the sequence.
            tp_group=self.tp_group if config.sequence_parallel else None,
        )
        self.enorm = build_module(submodules.enorm, **norm_kwargs)
        self.hnorm = build_module(submodules.hnorm, **norm_kwargs)
        self.eh_proj = build_module(
            submodules.eh_proj,
            2 * config.hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            tp_comm_buffer_name="mtp_eh_proj",
            tp_group=self.tp_group,
        )
        self.transformer_layer = build_module(
            submodules.transformer_layer,
            config=config,
            layer_number=config.num_layers + layer_number,
            pg_collection=pg_collection,
        )
        self.final_layernorm = build_module(submodules.layer_norm, **norm_kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        decoder_input: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the depth.

        Args:
            hidden_states: The previous depth's output [s, b, h] ([s/T, b, h] under sequence
                parallelism).
            decoder_input: The embeddings of the tokens this depth's shift brings to each
                position, the same shape.
            attention_mask: As the decoder's: None (causal) or a boolean mask.
            rotary_pos_emb: As the decoder's rotary angles, or None.

        Returns:
            This depth's hidden states after its final norm, the shape of `hidden_states`.
        """
        recompute = (
            self.config.recompute_granularity == "full"
            and self.config.recompute_method != "block"
            and self.training
            and torch.is_grad_enabled()
        )
        rng_context = (
            get_cuda_rng_tracker().fork()
            if self.config.sequence_parallel and self.training
            else contextlib.nullcontext()
        )
        args = (hidden_states, decoder_input, attention_mask, rotary_pos_emb)
        with rng_context:
            if recompute:
                return recompute_checkpoint(self._forward, *args)
            return self._forward(*args)

    def _forward(
        self,
        hidden_states: torch.Tensor,
        decoder_input: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb: torch.Tensor | None,
    ) -> torch.Tensor:
        combined = torch.cat((self.enorm(decoder_input), self.hnorm(hidden_states)), dim=-1)
        # Column-parallel: [s, b, h/T] on each rank (the whole sequence under sequence
        # parallelism), gathered to [s, b, h] and split again for a sequence-parallel layer.
        hidden_states, _ = self.eh_proj(combined)
        hidden_states = gather_from_tensor_model_parallel_region(hidden_states, self.tp_group)
        if self.config.sequence_parallel:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states, self.tp_group)
        hidden_states, _ = self.transformer_layer(hidden_states, attention_mask, rotary_pos_emb)
        return self.final_layernorm(hidden_states)


@dataclass
class MultiTokenPredictionBlockSubmodules:
    """Specs of a `MultiTokenPredictionBlock`.

    Attributes:
        layer_specs: One `MultiTokenPredictionLayer` spec per depth.
    """

    layer_specs: list[ModuleSpec] = field(default_factory=list)


class MultiTokenPredictionBlock(MegatronModule):
    """The `config.mtp_num_layers` prediction depths, run one after the other.

    Args:
        config: The transformer configuration (`mtp_num_layers` set).
        spec: The depths' specs (`get_gpt_mtp_block_spec`), one per depth, or a
            `MultiTokenPredictionBlock` `ModuleSpec` holding them.
        pg_collection: Process groups of the layers; None means parallel_state's.

    Raises:
        ValueError: the spec does not hold `config.mtp_num_layers` layer specs.
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: MultiTokenPredictionBlockSubmodules | ModuleSpec,
        *,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
        if isinstance(spec, ModuleSpec):
            module = get_module(spec)
            if isinstance(module, type) and issubclass(module, MultiTokenPredictionBlock):
                spec = spec.submodules
        if not isinstance(spec, MultiTokenPredictionBlockSubmodules):
            raise ValueError(
                "MultiTokenPredictionBlock needs MultiTokenPredictionBlockSubmodules (from "
                f"get_gpt_mtp_block_spec) or a MultiTokenPredictionBlock ModuleSpec, got "
                f"{type(spec).__name__}."
            )
        if len(spec.layer_specs) != config.mtp_num_layers:
            raise ValueError(
                f"the multi-token prediction spec has {len(spec.layer_specs)} layer specs but "
                f"config.mtp_num_layers is {config.mtp_num_layers}; build the spec with "
                "get_gpt_mtp_block_spec(config, ...) from the same config."
            )
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=depth, pg_collection=pg_collection)
            for depth, layer_spec in enumerate(spec.layer_specs, start=1)
        )
        self.cp_group = resolve_cp_group(None if pg_collection is None else pg_collection.cp)
        self.fp8_state: DelayedScalingState | None = None
        """The depths' delayed-scaling state (`fp8_recipe="delayed"`), else None."""
        recipe = recipe_from_config(config)
        if recipe is not None:
            if recipe.delayed:
                self.fp8_state = DelayedScalingState(recipe, amax_group(pg_collection))
            for index, layer in enumerate(self.layers):
                enable_fp8_linears(layer, f"mtp.layers.{index}", recipe, self.fp8_state)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb: torch.Tensor | None,
        embedding: torch.nn.Module,
    ) -> list[torch.Tensor]:
        """Runs every depth.

        Args:
            input_ids: [b, s] token ids of the decoder's input.
            position_ids: [b, s] their positions (learned position embeddings), or None.
            hidden_states: The decoder's output [s, b, h] ([s/T, b, h] under sequence
                parallelism), after its final norm.
            attention_mask, rotary_pos_emb: As the decoder's.
            embedding: The model's embedding, `embedding(input_ids, position_ids)`.

        Returns:
            Each depth's hidden states, in order (Megatron-core concatenates them along the
            sequence dimension after the decoder's, to hand them between pipeline stages; here
            the depths run on the last stage, with the output layer, and nothing crosses
            stages).
        """
        fp8_state = None if is_recomputing() else self.fp8_state
        hidden_states = end_backward_after(hidden_states, fp8_state, self)
        outputs = []
        for layer in self.layers:
            input_ids = roll_tensor(input_ids, cp_group=self.cp_group)
            if position_ids is not None:
                position_ids = roll_tensor(position_ids, cp_group=self.cp_group)
            hidden_states = layer(
                hidden_states, embedding(input_ids, position_ids), attention_mask, rotary_pos_emb
            )
            outputs.append(hidden_states)
        if fp8_state is not None:
            fp8_state.end_forward()
        return outputs


class MTPLossAutoScaler(MoEAuxLossAutoScaler):
    """Identity on the decoder's output that backpropagates the depths' losses (Megatron-core's
    name). Its gradient scale is the main loss's, shared with the MoE auxiliary losses:
    `MTPLossAutoScaler.set_loss_scale` and `MoEAuxLossAutoScaler.set_loss_scale` set the one
    value (the training loop's loss scale over the step's microbatches)."""


class MTPLossLoggingHelper:
    """Each depth's loss in a step's training forwards, averaged for the log (Megatron-core's
    name; here one process-wide instance, `get_mtp_loss_logging_helper()`).

    The values stay on the device until `report`, so recording synchronises nothing (a CUDA
    graph can capture it).
    """

    _METRIC = "mtp loss"

    def __init__(self) -> None:
        # The MoE layers' per-layer tracker, with one "layer" per depth.
        self._tracker = MoEMetricsTracker()
        self._num_depths: int | None = None

    def record(self, loss: torch.Tensor, depth: int, num_depths: int) -> None:
        """Adds `loss` (a scalar tensor: a micro-batch's mean) to depth `depth` (from 1) of a
        model of `num_depths` depths (a model of another depth count starts afresh)."""
        self._tracker_of(num_depths).record(self._METRIC, loss, depth, num_depths)

    def report(
        self, num_depths: int, num_microbatches: int, device: torch.device | None = None
    ) -> dict[str, float]:
        """`reduce`'s losses read to the host: {"mtp_1 loss": ..., "mtp_2 loss": ...},
        Megatron-core's names."""
        values = self.reduce(num_depths, num_microbatches, device).tolist()
        return dict(zip(self.names(num_depths), values))

    def reduce(
        self, num_depths: int, num_microbatches: int, device: torch.device | None = None
    ) -> torch.Tensor:
        """The recorded losses averaged over the step's microbatches and the data-parallel
        ranks (on every pipeline stage: the last stage's, where the depths run), on the device
        (no host synchronisation), then cleared. Every rank must call it (or `report`) once per
        training step (it all-reduces).

        Args:
            num_depths: `config.mtp_num_layers`.
            num_microbatches: The step's microbatches (the recorded values are their sums).
            device: Where zeros stand for a step that recorded nothing (default: CPU).

        Returns:
            `[num_depths]`, the losses in the order of `names`.
        """
        rows = self._tracker_of(num_depths).reduce(
            [self._METRIC], num_depths, num_depths, 1 / num_microbatches, device
        )
        return rows[0, 1:]

    @staticmethod
    def names(num_depths: int) -> list[str]:
        """The depths' loss names, Megatron-core's: "mtp_1 loss", "mtp_2 loss", ..."""
        return [f"mtp_{depth} loss" for depth in range(1, num_depths + 1)]

    def clear(self) -> None:
        """Forgets what was recorded since the last report."""
        self._tracker.clear()

    def _tracker_of(self, num_depths: int) -> MoEMetricsTracker:
        if num_depths != self._num_depths:
            self._tracker = MoEMetricsTracker()
            self._num_depths = num_depths
        return self._tracker


_LOGGING_HELPER: MTPLossLoggingHelper | None = None


def get_mtp_loss_logging_helper() -> MTPLossLoggingHelper:
    """The process-wide `MTPLossLoggingHelper`, created on first use (the depths are deep
    inside the model and the training loop holds no reference to them)."""
    global _LOGGING_HELPER
    if _LOGGING_HELPER is None:
        _LOGGING_HELPER = MTPLossLoggingHelper()
    return _LOGGING_HELPER


def process_mtp_loss(
    hidden_states: torch.Tensor,
    mtp_hidden_states: list[torch.Tensor],
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    language_model_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    config: TransformerConfig,
    record: bool,
    cp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Attaches the depths' losses to `hidden_states` (Megatron-core's function of this name).

    Depth k's labels and loss mask are `labels` and `loss_mask` shifted k positions to the
    front, 0 where shifted in. Its loss L_k is the masked sum of its per-token losses over its
    unmasked tokens N_k (at least 1). The backward of the returned tensor adds the gradient of
    `mtp_loss_scaling_factor / D * sum_k L_k`, times the main loss's backward scale (which
    `MTPLossAutoScaler.set_loss_scale` sets). With `config.calculate_per_token_loss` the losses
    are sums, as the main loss is then: depth k's masked sum times N_0 / N_k (N_0: the
    micro-batch's unmasked tokens), so that dividing every gradient by the global batch's token
    count gives each depth the weight of a per-token mean.

    Args:
        hidden_states: The decoder's output, which the main loss is computed from.
        mtp_hidden_states: Each depth's output (`MultiTokenPredictionBlock`).
        labels: [b, s] the main loss's labels (the next tokens).
        loss_mask: [b, s] 1 where the main loss counts a token, 0 elsewhere; None: all ones.
        language_model_loss: `(hidden_states, labels) -> [b, s]` per-token loss through the
            shared output layer (the model's own loss function).
        config: `mtp_num_layers`, `mtp_loss_scaling_factor`, `calculate_per_token_loss`.
        record: Record each depth's mean loss for the training log (in training forwards).
        cp_group: The context-parallel group when the tensors hold this rank's two chunks of
            the sequences: the token counts N_k (and the recorded means) are the whole
            sequences' (this rank's losses then carry its share of each depth's loss; the
            training loop's loss scale multiplies by the cp size, as for the main loss).

    Returns:
        `hidden_states`, unchanged in forward, carrying the depths' losses in backward.
    """
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    num_depths = config.mtp_num_layers
    scale = config.mtp_loss_scaling_factor / num_depths
    main_num_tokens = _sum_over(loss_mask.sum(), cp_group)
    for depth, depth_hidden_states in enumerate(mtp_hidden_states, start=1):
        labels = roll_tensor(labels, cp_group=cp_group)
        loss_mask = roll_tensor(loss_mask, cp_group=cp_group)
        losses = loss_mask * language_model_loss(depth_hidden_states, labels)
        # One reduction for the count and the logged sum.
        num_tokens, loss_sum = _sum_over(torch.stack([loss_mask.sum(), losses.sum()]), cp_group)
        num_tokens = num_tokens.clamp(min=1)
        if record:
            get_mtp_loss_logging_helper().record(loss_sum / num_tokens, depth, num_depths)
        if config.calculate_per_token_loss:
            weighted = scale * losses * (main_num_tokens / num_tokens)
        else:
            weighted = scale * losses / num_tokens
        hidden_states = MTPLossAutoScaler.apply(hidden_states, weighted)
    return hidden_states


def _sum_over(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`values` (detached) summed over `group`'s ranks; `values` itself without a group."""
    values = values.detach()
    if group_size(group) == 1:
        return values
    summed = values.clone()
    dist.all_reduce(summed, group=group)
    return summed
