"""The Mixture of Experts layer, in the MLP slot of a transformer layer.

`MoELayer`: router -> token dispatch over the expert groups -> this rank's experts -> combine,
plus the shared experts when configured. Its state dict names the router (`router.weight`,
`router.expert_bias`) and the shared experts (`shared_experts.*`) as Megatron-core does; the
routed experts' projections are each one tensor stacked over the local experts
(`experts.linear_fc1.weight` [num_local_experts, ...], see `experts.py`), where Megatron-core
names each expert's apart (`experts.local_experts.<i>.linear_fc1.weight`, or
`experts.linear_fc1.weight<i>` with Transformer Engine). `load_state_dict` takes either:
Megatron-core's per-expert entries are stacked as they load (`upstream_names.py`), so a state
dict saved by Megatron-core's `MoELayer` loads and computes the same outputs.

The experts follow Megatron-core's expert rank order (etp-ep-dp): the expert tensor-parallel
group `expt_tp` (`expert_tensor_parallel_size`, ETP; Megatron's default is the tp size) splits
each expert's weights, the expert-parallel group `ep` splits the experts, and the tokens travel
in `tp_ep`, the etp x ep ranks of both. Under tensor parallelism (which needs sequence
parallelism) each tp rank routes and dispatches its own [s/T, b, h] tokens; the shared experts
are split over tp as the dense MLP is. With ETP x EP = 1 every tp rank holds all experts whole
and their gradients are summed over tp; the config refuses 1 < ETP x EP < TP (tp ranks would
hold copies of the same expert parts with no group of just those copies).

The token counts per expert stay on the device where the layer allows it: with
`moe_grouped_gemm` the experts take them as device offsets (`ExpertGemm.GROUPED`; in FP8 where
the grouped FP8 kernels run: `experts.reads_counts_on_host`), and
a dropless layer with one rank per expert group sizes its rows from the shapes
(`DispatchSizing.FIXED`), so its forward and backward read nothing on the host (and a CUDA graph
can hold them). With expert parallelism `moe_pad_dispatch_to_worst_case` pads the exchanges to
their worst case (`DispatchSizing.WORST_CASE`). Otherwise (a capacity, expert parallelism
without that flag, or experts that read the counts on the host anyway: the loop of GEMMs, the
other FP8 GEMMs) the exchanges are sized by the counts read on the host once per forward. The
choices are made at construction (`token_dispatcher.sizing`, `experts.reads_counts_on_host`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.utils import group_size
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    DispatchSizing,
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.transformer.moe.upstream_names import (
    drop_empty_extra_states,
    stack_upstream_experts,
)
from megatron.core.transformer.recompute import recompute
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig, recomputes

_DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}


@dataclass
class MoESubmodules:
    """Specs of the parts of an `MoELayer`.

    Attributes:
        router: The router (`TopKRouter`).
        experts: The routed experts (`SequentialMLP` or `GroupedMLP`).
        shared_experts: The shared experts (`SharedExpertMLP` spec); built only with
            `moe_shared_expert_intermediate_size`.
    """

    router: ModuleSpec | type = TopKRouter
    experts: ModuleSpec | type | None = None
    shared_experts: ModuleSpec | type | None = None


def _resolve_group(
    pg_collection: ProcessGroupCollection | None,
    name: str,
    getter: Callable[[], dist.ProcessGroup | None],
) -> dist.ProcessGroup | None:
    """`pg_collection.<name>` when a collection is given (None where it has none: a group of
    one rank), else parallel_state's (`getter`) when initialised, else None. The groups of a
    layer come from one source: a collection's groups are never mixed with parallel_state's."""
    if pg_collection is not None:
        return getattr(pg_collection, name)
    return getter() if parallel_state.model_parallel_is_initialized() else None


def resolve_ep_group(pg_collection: ProcessGroupCollection | None) -> dist.ProcessGroup | None:
    """The expert-parallel group: `pg_collection.ep`, else parallel_state's when initialised,
    else None (expert-parallel size 1)."""
    return _resolve_group(pg_collection, "ep", parallel_state.get_expert_model_parallel_group)


def resolve_expt_tp_group(
    pg_collection: ProcessGroupCollection | None,
) -> dist.ProcessGroup | None:
    """The expert tensor-parallel group: `pg_collection.expt_tp`, else parallel_state's when
    initialised, else None (expert tensor-parallel size 1)."""
    getter = parallel_state.get_expert_tensor_parallel_group
    return _resolve_group(pg_collection, "expt_tp", getter)


def resolve_tp_ep_group(pg_collection: ProcessGroupCollection | None) -> dist.ProcessGroup | None:
    """The group of the etp x ep ranks of an expert group: `pg_collection.tp_ep`, else
    parallel_state's when initialised, else None (see `token_exchange_group` for when it may be
    left out)."""
    getter = parallel_state.get_expert_tensor_and_model_parallel_group
    return _resolve_group(pg_collection, "tp_ep", getter)


def resolve_tp_cp_group(
    pg_collection: ProcessGroupCollection | None,
    tp_group: dist.ProcessGroup | None,
    context_parallel_size: int,
) -> dist.ProcessGroup | None:
    """The ranks holding parts of the same sequences, over which the router sums its balancing
    statistics: `tp_group` without context parallelism, else the tensor x context-parallel
    group (`pg_collection.tp_cp`, else parallel_state's).

    Raises:
        ValueError: With context parallelism, no such group of tp x cp ranks.
    """
    if context_parallel_size == 1:
        return tp_group
    getter = parallel_state.get_tensor_and_context_parallel_group
    group = _resolve_group(pg_collection, "tp_cp", getter)
    expected = group_size(tp_group) * context_parallel_size
    if group_size(group) != expected:
        raise ValueError(
            f"context_parallel_size={context_parallel_size}: the MoE router sums its balancing "
            f"statistics over the tensor x context-parallel group of {expected} ranks, but the "
            f"tp_cp group has {group_size(group)}; pass a pg_collection with tp_cp (or "
            "initialise parallel_state with the same context_parallel_size)."
        )
    return group


class MoELayer(MegatronModule):
    """Routes each token to its top-k experts and sums their weighted outputs.

    Each rank of the expert-parallel (EP) group holds `num_moe_experts / EP` experts, global
    experts `ep_rank * num_local_experts + i`, each split over the expert tensor-parallel
    (ETP) group; the router and the shared experts are replicated. Selective recompute: "moe"
    checkpoints the whole layer, "shared_experts" the shared experts.

    Args:
        config: The transformer configuration (`num_moe_experts` set).
        submodules: Specs of the router, experts and shared experts.
        layer_number: 1-based layer number (the metrics are recorded per layer).
        pg_collection: Process groups; its `ep`, `expt_tp` and `tp_ep` are the expert groups
            (see `resolve_ep_group`, `resolve_expt_tp_group`, `resolve_tp_ep_group`), its `tp`
            the tensor-parallel group (see `resolve_tp_group`), its `tp_cp` the router's
            reduction group under context parallelism (`resolve_tp_cp_group`).

    Raises:
        ValueError: the config has no experts; `expert_model_parallel_size`,
            `expert_tensor_parallel_size` or `tensor_model_parallel_size` differs from its
            group's size; or the tp_ep group is missing or of the wrong size.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MoESubmodules,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError(
                "an MoE layer spec needs config.num_moe_experts; set it, or build the layers "
                "with a dense spec (get_gpt_layer_local_spec() without num_experts)."
            )
        ep_group = resolve_ep_group(pg_collection)
        ep_size = 1 if ep_group is None else ep_group.size()
        if ep_size != config.expert_model_parallel_size:
            raise ValueError(
                f"config.expert_model_parallel_size ({config.expert_model_parallel_size}) "
                f"differs from the size of the expert-parallel group ({ep_size}); initialise "
                "parallel_state (or pass a pg_collection) with the same "
                "expert_model_parallel_size."
            )
        expt_tp_group = resolve_expt_tp_group(pg_collection)
        etp_size = group_size(expt_tp_group)
        if etp_size != config.expert_tensor_parallel_size:
            raise ValueError(
                f"config.expert_tensor_parallel_size ({config.expert_tensor_parallel_size}) "
                f"differs from the size of the expert tensor-parallel group ({etp_size}); "
                "initialise parallel_state (or pass a pg_collection with expt_tp) with the same "
                "expert_tensor_parallel_size."
            )
        tp_group = resolve_tp_group(pg_collection)
        if group_size(tp_group) != config.tensor_model_parallel_size:
            raise ValueError(
                f"config.tensor_model_parallel_size ({config.tensor_model_parallel_size}) "
                f"differs from the size of the tensor-parallel group ({group_size(tp_group)}); "
                "initialise parallel_state (or pass a pg_collection) with the same "
                "tensor_model_parallel_size."
            )
        self.layer_number = layer_number
        self.num_local_experts = config.num_moe_experts // ep_size
        first_expert = (0 if ep_group is None else ep_group.rank()) * self.num_local_experts
        self.local_expert_indices = list(range(first_expert, first_expert + self.num_local_experts))
        self.router = build_module(
            submodules.router,
            config=config,
            layer_number=layer_number,
            tp_group=tp_group,
            tp_cp_group=resolve_tp_cp_group(pg_collection, tp_group, config.context_parallel_size),
        )
        self.experts = build_module(
            submodules.experts,
            self.num_local_experts,
            config,
            first_expert=first_expert,
            # The config allows ETP x EP = 1 or >= TP: only at 1 do tp ranks share experts.
            tp_group=tp_group if etp_size * ep_size == 1 else None,
            expt_tp_group=expt_tp_group,
        )
        experts_read_counts = self.experts.reads_counts_on_host()
        sizing = DispatchSizing.of(config, etp_size * ep_size, experts_read_counts)
        self.token_dispatcher = _DISPATCHERS[config.moe_token_dispatcher_type](
            config, ep_group, expt_tp_group, resolve_tp_ep_group(pg_collection), sizing=sizing
        )
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = build_module(
                submodules.shared_experts, config=config, tp_group=tp_group
            )
        else:
            self.shared_experts = None
        self.recompute_moe = recomputes(config, "moe")
        self.recompute_shared_experts = recomputes(config, "shared_experts")

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # Megatron-core's per-expert names become the stacked tensors before the experts load
        # (`load_state_dict` hands each module a copy of the state dict to rewrite).
        first = self.local_expert_indices[0]
        stack_upstream_experts(
            state_dict,
            prefix,
            local_experts=range(first, first + self.num_local_experts),
            num_experts=self.config.num_moe_experts,
        )
        drop_empty_extra_states(state_dict, prefix, self)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Applies the layer to [s, b, h] hidden states ([s/T, b, h] under sequence
        parallelism).

        Returns:
            `(output, None)`: output [s, b, h] and no bias (the `MLP` calling convention; the
            experts' biases are already added).
        """
        if self.recompute_moe and self.training and torch.is_grad_enabled():
            return recompute(self._forward, hidden_states), None
        return self._forward(hidden_states), None

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        probs, routing_map = self.router(hidden_states)
        dispatcher = self.token_dispatcher
        tokens, tokens_per_expert, probs = dispatcher.dispatch(hidden_states, probs, routing_map)
        output = dispatcher.combine(self.experts(tokens, tokens_per_expert, probs))
        if self.shared_experts is not None:
            checkpointed = self.recompute_shared_experts and not self.recompute_moe
            if checkpointed and self.training and torch.is_grad_enabled():
                output = output + recompute(self.shared_experts, hidden_states)
            else:
                output = output + self.shared_experts(hidden_states)
        return output
