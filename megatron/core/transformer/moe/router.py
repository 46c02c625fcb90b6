"""The MoE router: which experts each token goes to, with which weight, and its balancing losses.

`TopKRouter` follows Megatron-core 0.19's `TopKRouter` with these parts:

- logits = x W^T (+ b) in `moe_router_dtype` (the input and weight are cast for the GEMM, the
  weight stays in `params_dtype`);
- scores by softmax (after the top-k, or before it with `moe_router_pre_softmax`) or sigmoid
  (renormalised over the k), optional group-limited selection and `topk_scaling_factor`;
- aux-loss-free balancing: the expert bias shifts the sigmoid scores for the selection only,
  the weights stay unbiased; routed-token counts are kept for `update_expert_bias`;
- the load-balancing loss ("aux_loss" per micro-batch, "seq_aux_loss" per sequence) and the
  z-loss, attached to the outputs with `MoEAuxLossAutoScaler` and recorded in the metrics
  tracker (as value / coefficient, per layer);
- capacity: with `moe_expert_capacity_factor`, each expert keeps at most
  ceil(tokens * topk / experts * factor) tokens (by probability or by position), optionally
  padded up to exactly that many.

Under sequence parallelism each tensor-parallel (tp) rank routes its own part of the sequence,
as in Megatron-core: the weight's gradient is summed over tp (`grad_sum_over_tp`), the
load-balancing statistics (routed-token counts, token totals) are those of the whole sequence
(summed over tp), and each rank's share of a balancing loss is summed over tp in forward, so every
rank attaches and records the loss a TP 1 router computes; its gradient reaches each rank's own
tokens only. The capacity is applied to each rank's tokens (Megatron-core does the same).
Under context parallelism each context-parallel rank holds two chunks of every sequence: the
balancing statistics and losses are summed over the tensor x context-parallel group
(`tp_cp_group`, upstream's reduction group) instead, and are again the whole sequence's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import (
    grad_sum_over_tp,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import get_tensor_model_parallel_group_if_none, group_size
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    switch_load_balancing_loss_func,
    z_loss_func,
)
from megatron.core.transformer.recompute import is_recomputing
from megatron.core.transformer.transformer_config import TransformerConfig

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
LOAD_BALANCING_METRICS = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
}
"""The tracker name of each load-balancing loss (Megatron-LM's log names)."""
Z_LOSS_METRIC = "z_loss"


def tracked_metrics(load_balancing_type: str, z_loss_coeff: float | None) -> list[str]:
    """The metrics the routers of a model with these settings record (`moe_logging`), for the
    training log to report on every rank alike."""
    names = [LOAD_BALANCING_METRICS[load_balancing_type]] if load_balancing_type != "none" else []
    return names + ([Z_LOSS_METRIC] if z_loss_coeff is not None else [])


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the experts of each token's best `group_topk` groups (DeepSeek-V2/V3).

    A group's score is the sum of its best `topk // group_topk` expert scores.

    Returns:
        `(values, indices)` of the k selected experts, [tokens, topk] each.
    """
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.repeat_interleave(experts // num_groups, dim=1)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _select(scores: torch.Tensor, config: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if config.moe_router_group_topk:
        return group_limited_topk(
            scores,
            config.moe_router_topk,
            config.moe_router_num_groups,
            config.moe_router_group_topk,
        )
    return torch.topk(scores, k=config.moe_router_topk, dim=1)


def topk_routing(
    logits: torch.Tensor, config: TransformerConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights and map from [tokens, experts] logits, as the config says.

    Scores are computed in fp32 whatever the logits' dtype; the weights come back in it.

    Returns:
        `(probs, routing_map)`: [tokens, experts] weights (zero off the selected experts) and
        the boolean selection.
    """
    topk = config.moe_router_topk
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            probs, indices = _select(torch.softmax(logits, dim=-1, dtype=torch.float32), config)
        else:
            top_logits, indices = _select(logits, config)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            _, indices = _select(scores + expert_bias.float(), config)
            scores = torch.gather(scores, 1, indices)
        else:
            scores, indices = _select(scores, config)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unbiased, ungrouped routing the balancing losses measure.

    Returns:
        `(routing_map, scores)`: the top-k map of the scores and the fp32 scores over all
        experts (softmax, or sigmoid normalised per token).
    """
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = torch.topk(scores, k=topk, dim=1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True), scores


def expert_capacity(num_tokens: int, config: TransformerConfig) -> int:
    """Tokens each expert may keep out of `num_tokens` routed tokens."""
    share = num_tokens * config.moe_router_topk / config.num_moe_experts
    return math.ceil(share * config.moe_expert_capacity_factor)


def drop_tokens_over_capacity(
    probs: torch.Tensor, routing_map: torch.Tensor, config: TransformerConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies the expert capacity to a routing (`moe_expert_capacity_factor`).

    "probs" keeps each expert's `capacity` highest-weight tokens, "position" its first ones.
    With `moe_pad_expert_input_to_capacity` every expert gets exactly `capacity` tokens: the
    kept ones, then others with weight 0.

    Returns:
        `(probs, routing_map)` after dropping (and padding).
    """
    num_tokens = probs.shape[0]
    capacity = expert_capacity(num_tokens, config)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    elif config.moe_token_drop_policy == "probs":
        # Unrouted tokens have weight 0, so they come last unless an expert is short of tokens
        # (then they fill the capacity mask but the routing map excludes them again).
        top = torch.topk(probs, k=capacity, dim=0, sorted=False).indices
        keep = torch.zeros_like(routing_map).scatter(0, top, True)
    else:
        position = torch.cumsum(routing_map.int(), dim=0)
        keep = routing_map & (position <= capacity)
        if config.moe_pad_expert_input_to_capacity:
            # Fill up with the first unrouted tokens.
            free = torch.cumsum((~routing_map).int(), dim=0)
            short = capacity - keep.sum(dim=0, keepdim=True)
            keep = keep | (~routing_map & (free <= short))
    routing_map = keep if config.moe_pad_expert_input_to_capacity else routing_map & keep
    return probs * routing_map, routing_map


class TopKRouter(MegatronModule):
    """Routes each token to its top-k experts (see the module docstring).

    Parameters: `weight` [num_experts, hidden] (and `bias` [num_experts] with
    `add_bias_linear`, as Megatron-core), initialised with `config.init_method` in fp32 and
    stored in `params_dtype` (`reset_parameters`). Buffers with `moe_router_enable_expert_bias`:
    `expert_bias` (fp32, saved in checkpoints) and `local_tokens_per_expert` (fp32, the counts
    of this rank's routed tokens since the last `update_expert_bias`, which sums them; not
    saved), zero after `reset_parameters`.

    Args:
        config: The transformer configuration (`num_moe_experts` set).
        layer_number: 1-based layer number, under which the metrics are recorded.
        tp_group: The tensor-parallel group the tokens are split over (sequence parallelism);
            None resolves to parallel_state's when initialised, else no split.
        tp_cp_group: The ranks that hold parts of the same sequences (tensor x context
            parallel), over which the balancing statistics and losses are summed; None means
            `tp_group` (no context parallelism).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int = 1,
        *,
        tp_group: dist.ProcessGroup | None = None,
        tp_cp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        self.sequence_group = self.tp_group if tp_cp_group is None else tp_cp_group
        experts = config.num_moe_experts
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(experts, config.hidden_size, dtype=dtype))
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.empty(experts, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32))
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(experts, dtype=torch.float32),
                persistent=False,
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weight (and bias) from `config.init_method`, drawn in fp32 and stored in
        `params_dtype`; the expert bias and the token counts zero."""
        for param in (self.weight, self.bias):
            if param is not None:
                drawn = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                self.config.init_method(drawn)
                param.copy_(drawn)
        for buffer in (self.expert_bias, self.local_tokens_per_expert):
            if buffer is not None:
                buffer.zero_()

    def _apply(self, fn, recurse=True):
        # `model.bfloat16()` / `.half()` would round the bias and the counts; they stay fp32.
        super()._apply(fn, recurse)
        for name in ("expert_bias", "local_tokens_per_expert"):
            buffer = getattr(self, name)
            if buffer is not None and buffer.dtype != torch.float32:
                setattr(self, name, buffer.float())
        return self

    def gating(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Router logits [..., num_experts] in `moe_router_dtype` (else the input's dtype)."""
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, hidden_states.dtype)
        weight = grad_sum_over_tp(self.weight, self.tp_group)
        bias = None if self.bias is None else grad_sum_over_tp(self.bias, self.tp_group).to(dtype)
        return F.linear(hidden_states.to(dtype), weight.to(dtype), bias)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routes [s, b, h] hidden states.

        Returns:
            `(probs, routing_map)`: [s * b, num_experts] routing weights (the logits' dtype,
            zero where a token is not routed) and the boolean routing map, tokens in
            [s, b] row-major order.
        """
        config = self.config
        eps = config.moe_input_jitter_eps
        if eps is not None and self.training:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - eps, 1.0 + eps)
            hidden_states = hidden_states * noise
        logits = self.gating(hidden_states)
        if config.moe_router_force_load_balancing:
            # Random logits forward, the gradient of the real ones backward.
            logits = logits + (torch.randn_like(logits) - logits).detach()
        seq_length, batch = logits.shape[:2]
        logits = logits.reshape(-1, config.num_moe_experts)
        training = self.training and torch.is_grad_enabled()
        if training and config.moe_z_loss_coeff is not None:
            logits = self._attach_z_loss(logits)
        probs, routing_map = topk_routing(logits, config, self.expert_bias)
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens_over_capacity(probs, routing_map, config)
        if training and config.moe_aux_loss_coeff > 0:
            probs = self._attach_load_balancing_loss(probs, logits, seq_length, batch)
        if self.local_tokens_per_expert is not None and training:
            if not is_recomputing():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _sum_over_sequence(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the tp (x cp) ranks (each holds its part of the sequences'); the
        gradient passes through to this rank's part."""
        return reduce_from_tensor_model_parallel_region(value, self.sequence_group)

    def _attach_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        # This rank's tokens' share of the mean over the whole sequence.
        z_loss = self._sum_over_sequence(
            z_loss_func(logits, coeff) / group_size(self.sequence_group)
        )
        self._record(Z_LOSS_METRIC, z_loss, coeff)
        return MoEAuxLossAutoScaler.apply(logits, self._per_token_scaled(z_loss, logits))

    def _attach_load_balancing_loss(
        self, probs: torch.Tensor, logits: torch.Tensor, seq_length: int, batch: int
    ) -> torch.Tensor:
        config = self.config
        topk, experts = config.moe_router_topk, config.num_moe_experts
        aux_map, scores = scores_for_aux_loss(logits, topk, config.moe_router_score_function)
        coeff = config.moe_aux_loss_coeff
        name = LOAD_BALANCING_METRICS[config.moe_router_load_balancing_type]
        parts = group_size(self.sequence_group)
        if config.moe_router_load_balancing_type == "aux_loss":
            aux_loss = switch_load_balancing_loss_func(
                scores,
                self._sum_over_sequence(aux_map.sum(dim=0)),
                logits.shape[0] * parts,
                topk,
                experts,
                coeff,
            )
        else:
            # Each sequence of the micro-batch on its own: [s, b * E] columns are
            # (sequence, expert) pairs, so one call sums the per-sequence losses.
            aux_loss = (
                switch_load_balancing_loss_func(
                    scores.reshape(seq_length, -1),
                    self._sum_over_sequence(aux_map.reshape(seq_length, -1).sum(dim=0)),
                    seq_length * parts,
                    topk,
                    experts,
                    coeff,
                )
                / batch
            )
        # Linear in the scores: the tp (x cp) ranks' parts add up to the whole sequence's loss.
        aux_loss = self._sum_over_sequence(aux_loss)
        self._record(name, aux_loss, coeff)
        return MoEAuxLossAutoScaler.apply(probs, self._per_token_scaled(aux_loss, logits))

    def _per_token_scaled(self, loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # With per-token losses every gradient is divided by the global token count later;
        # multiplying by the micro-batch's count (all tp x cp ranks' tokens) keeps the auxiliary
        # loss a per-micro-batch mean.
        if self.config.calculate_per_token_loss:
            return loss * (logits.shape[0] * group_size(self.sequence_group))
        return loss

    def _record(self, name: str, loss: torch.Tensor, coeff: float) -> None:
        if not is_recomputing():
            # Multi-token prediction depths' layers are numbered after the decoder's.
            num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
            get_moe_metrics_tracker().record(name, loss / coeff, self.layer_number, num_layers)
