"""`FullyShardedDataParallel`: Megatron-FSDP behind the DDP engine's interface.

It shards a Megatron model (by default each `TransformerLayer` a unit, each multi-token
prediction depth too, and so are the embedding and the output layer unless they share their
weight; the rest in the root) from a
`DistributedDataParallelConfig`, and answers the calls a
Megatron training loop makes on its data-parallel wrapper (`zero_grad_buffer`, `no_sync`,
`start_param_sync`, `finish_grad_sync`, `scale_gradients`, state dicts), so the loop does not
care which engine it holds. Any optimizer over `model.parameters()` (DTensor main weights) or
their local shards trains it; `fully_shard_optimizer()` is the fast path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.fsdp.distributed_index import FSDPDistributedIndex
from megatron.core.distributed.fsdp.fsdp_module import fully_shard
from megatron.core.distributed.fsdp.overlap import OverlapPolicy
from megatron.core.distributed.fsdp.plan import OuterReduction
from megatron.core.distributed.fsdp.roots import (
    fsdp_contexts,
    local_main_weights,
    parameter_groups,
)
from megatron.core.distributed.fsdp.weights import step_amaxes
from megatron.core.fusions.fused_adam import StepAmaxes
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.upstream_names import stack_upstream_experts
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

if TYPE_CHECKING:
    # The config builds this package's policies, so it imports from here, not the reverse.
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )


class FullyShardedDataParallel(_BaseDataParallel):
    """Wraps `module` with Megatron-FSDP.

    Args:
        config: the model's transformer config (with `gradient_accumulation_fusion`, linear
            layers write their weight gradients into the buffer they are reduce-scattered from
            where their unit reduces right after its own backward (not the root), or, with
            `megatron_fsdp_accumulate_unsharded_grads`, add them into the whole sums from a
            step's second microbatch on; where gradients are not sharded and `main_grad`
            holds them whole (`no_shard`, `optim` over one rank), into `main_grad`).
        ddp_config: data-parallel switches; `use_megatron_fsdp` must be True.
        module: the model (may live on the `meta` device: it is materialised shard by shard).
        fsdp_unit_modules: module classes that each become a unit; everything else belongs to
            the root. Default: see `default_fsdp_units`.
        disable_bucketing: Megatron-core's; accepted, no effect (each unit's parameters are
            gathered and reduced together).
        device: where buffers live; None, or the device the process groups imply (the
            current CUDA device under NCCL, else the CPU).
        pg_collection: process groups (default: parallel_state's, else the world).

    Raises:
        ValueError: `use_megatron_fsdp` is False, or `num_distributed_optimizer_instances`
            disagrees with the outer group of the process groups.
    """

    keeps_main_weights = True
    """The DTensor main weights (shards in `megatron_fsdp_main_params_dtype`) are the wrapped
    module's parameters: an optimizer steps them (or their local shards) and keeps no masters of
    its own."""

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        fsdp_unit_modules: Sequence[type[torch.nn.Module]] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config, module)
        if not ddp_config.use_megatron_fsdp:
            raise ValueError(
                "FullyShardedDataParallel needs ddp_config.use_megatron_fsdp=True; for plain "
                "data parallelism wrap the model with DistributedDataParallel instead."
            )
        if ddp_config.fp8_param_gather and not config.fp8:
            raise ValueError(
                "ddp_config.fp8_param_gather (--fp8-param-gather) gathers the weights of FP8 "
                "linear layers, and this model has none: set config.fp8 (--fp8-format), or "
                "drop fp8_param_gather."
            )
        if ddp_config.fp8_param_gather and config.fp8_recipe == "blockwise":
            raise ValueError(
                "ddp_config.fp8_param_gather (--fp8-param-gather) gathers FP8 weights with one "
                "scale per tensor, and config.fp8_recipe='blockwise' needs one per 128x128 "
                "block (not built): drop fp8_param_gather or use fp8_recipe 'tensorwise' or "
                "'delayed'."
            )
        self.ddp_config = ddp_config
        self.distributed_index = FSDPDistributedIndex.from_pg_collection(
            pg_collection, average_grads=not self.sums_grads
        )
        if device is not None and torch.device(device).type != self.distributed_index.device.type:
            raise ValueError(
                f"device={device}, but the process groups' buffers live on "
                f"{self.distributed_index.device}; pass that device or None."
            )
        outer = self.distributed_index.outer_group
        replicas = 1 if outer is None else outer.size()
        if replicas != ddp_config.num_distributed_optimizer_instances:
            raise ValueError(
                "ddp_config.num_distributed_optimizer_instances="
                f"{ddp_config.num_distributed_optimizer_instances} but the process groups have "
                f"{replicas} outer replica(s) (pg_collection.inter_dist_opt); initialise "
                "parallel_state with the same num_distributed_optimizer_instances."
            )
        strategy = ddp_config.sharding_policy()
        mp_policy = ddp_config.mixed_precision_policy()
        overlap_policy = OverlapPolicy(
            prefetch=ddp_config.overlap_param_gather,
            overlap_grad_reduce=ddp_config.overlap_grad_reduce,
            use_symm_mem=ddp_config.use_symm_mem,
            keep_unsharded_params=ddp_config.megatron_fsdp_keep_unsharded_params,
            accumulate_unsharded_grads=ddp_config.megatron_fsdp_accumulate_unsharded_grads,
        )
        if fsdp_unit_modules is None:
            units = default_fsdp_units(module)
        else:
            classes = tuple(fsdp_unit_modules)
            units = [m for m in module.modules() if isinstance(m, classes) and m is not module]
        units = group_layers(module, units, ddp_config.suggested_communication_unit_size)
        # Children before parents: a unit takes what no unit below it holds.
        for unit in [*reversed(units), module]:
            fully_shard(
                unit,
                self.distributed_index,
                sharding_strategy=strategy,
                mp_policy=mp_policy,
                overlap_policy=overlap_policy,
            )
        self._groups = parameter_groups(module)
        if config.gradient_accumulation_fusion:
            for group in self._groups:
                if group.grads is None:
                    continue
                if overlap_policy.accumulate_unsharded_grads:
                    group.grads.fuse_into_deferred_sums()
                elif group.plan.shards_grads:
                    group.grads.fuse_into_sends()
                else:
                    group.grads.fuse_into_main_grad()
        # The root's context now (which materialises meta-device weights), kept for the
        # per-step calls below.
        self._contexts = fsdp_contexts(module)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate into `main_grad`, deferring the once-per-step
        reductions to `finish_grad_sync()` or the first backward outside (as
        `microbatch(is_last=False)`, also for `megatron_fsdp_keep_unsharded_params` and
        `megatron_fsdp_accumulate_unsharded_grads`)."""
        with contextlib.ExitStack() as stack:
            for context in self._contexts:
                stack.enter_context(context.microbatch_state(is_last=False))
            yield

    def zero_grad_buffer(self) -> None:
        """Forgets accumulated gradients before the first microbatch of a step."""
        for context in self._contexts:
            context.zero_grad()

    def start_grad_sync(self, *unused: Any) -> None:
        """Runs the reductions deferred to the end of the step (same as `finish_grad_sync`)."""
        self.finish_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Completes every gradient reduction; the optimizer may step afterwards."""
        for context in self._contexts:
            context.finalize_grads()

    def local_main_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each DTensor main weight (a parameter of the wrapped module) -> its local shard."""
        return local_main_weights(self.module)

    def prepare_step_amaxes(self) -> StepAmaxes | None:
        """The amaxes of the FP8 compute weights (`fp8_param_gather`) for the optimizer step
        about to write the main weights to record (`step_and_copy`), sparing their next
        refresh a pass over the main weights; None without FP8 weights. Call it right before
        that step, once per step: it zeroes the amaxes the last step recorded."""
        return step_amaxes([group.weights for group in self._groups])

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiplies every accumulated (and handed-to-optimizer) gradient by `scaling_factor`."""
        for group in self._groups:
            if group.grads is not None:
                group.grads.scale(scaling_factor)

    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """With `fsdp_all_gather_in_start_param_sync`, starts the first unit's all-gather (and
        the refresh of its weights after an optimizer step) now, before the forward loop
        starts; otherwise issues nothing (each unit then gathers when its forward needs it,
        which CUDA-graph capture requires).

        Args:
            force_sync: refresh every group's compute weights before its next use, even if the
                engine saw no write to the main weights (one made through `.data`).
        """
        for context in self._contexts:
            if force_sync:
                context.mark_main_weights_written()
            if self.ddp_config.fsdp_all_gather_in_start_param_sync:
                context.unshard_first_unit()

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Gives every rank the first rank's weights where they are replicated (Megatron-core's
        call after an initialisation that differed across ranks): main weights replicated over
        the shard group (`no_shard`) or over the hybrid-sharding replicas (HSDP) are broadcast
        from that group's first rank. Sharded main weights exist once already."""
        for group in self._groups:
            weights, plan = group.weights, group.plan
            groups = weights.groups
            replicated_over = [] if plan.shards_main else [groups.shard]
            if plan.outer_reduction is OuterReduction.ALL_REDUCE:  # HSDP's replicas
                replicated_over.append(groups.outer)
            for process_group in replicated_over:
                dist.broadcast(
                    weights.sharded_main.data,
                    src=dist.get_global_rank(process_group, 0),
                    group=process_group,
                )
        for context in self._contexts:
            context.mark_main_weights_written()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Loads weights given as DTensors (as `state_dict()` returns) or as whole tensors
        of the DTensors' global shapes (each rank keeps its shard; of an expert parameter, all
        experts, which may also come under Megatron-core's per-expert names: they are stacked,
        `upstream_names.py`); compute weights refresh before the next forward.

        Raises:
            ValueError: a whole tensor's shape differs from its parameter's; per-expert entries
                that do not stack (`stack_upstream_experts`).
        """
        location = {p: (g, i) for g in self._groups for i, p in enumerate(g.main_weights)}
        params = dict(self.module.named_parameters())
        converted = dict(state_dict)
        stack_upstream_experts(converted)
        with torch.no_grad():
            for key, value in list(converted.items()):
                param = params.get(key)
                if param not in location or isinstance(value, DTensor):
                    continue
                if value.shape != param.shape:
                    raise ValueError(
                        f"state_dict[{key!r}] has shape {tuple(value.shape)} but the model's "
                        f"parameter has {tuple(param.shape)}; the checkpoint is of another model."
                    )
                group, index = location[param]
                group.weights.load_global_tensor(index, value.to(group.device))
                converted[key] = param
        return self.module.load_state_dict(converted, strict=strict)


def default_fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules below `model` that become units by default, in module order: every
    `TransformerLayer`, every multi-token prediction depth (`MultiTokenPredictionLayer`: its
    norms, projection and transformer layer in one unit), and a GPT model's embedding and output
    layer when the output layer has a weight of its own.

    The output layer is then gathered just before the loss and freed while the layers' backward
    runs, its gradients reduced under that backward rather than at the end of it; and the
    embedding's weights are not held from the forward to the end of backward. A tied output
    layer computes with the embedding's weight outside the embedding's forward, so both stay
    in the root. (The multi-token prediction depths use the embedding and the output layer
    again: a unit gathers its weights for each use.)
    """
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    ends = [] if tied else [getattr(model, name, None) for name in ("embedding", "output_layer")]
    depths = [m for m in model.modules() if isinstance(m, MultiTokenPredictionLayer)]
    inside_depths = {id(sub) for depth in depths for sub in depth.modules() if sub is not depth}
    return [
        m
        for m in model.modules()
        if m is not model
        and id(m) not in inside_depths
        and (
            isinstance(m, (TransformerLayer, MultiTokenPredictionLayer))
            or any(m is e for e in ends)
        )
    ]


def group_layers(
    model: torch.nn.Module, units: list[torch.nn.Module], size: int | None
) -> list[torch.nn.Module | list[torch.nn.Module]]:
    """`units` (in module order), with runs of consecutive `TransformerLayer`s of one parent
    merged into units of several modules while their parameters total at most `size` elements
    (`suggested_communication_unit_size`; None: none merged). A layer larger than `size` stays
    alone, and so does every other module."""
    if size is None:
        return list(units)
    parents = {id(child): id(parent) for parent in model.modules() for child in parent.children()}
    grouped: list[torch.nn.Module | list[torch.nn.Module]] = []
    run: list[torch.nn.Module] = []
    run_numel = 0
    for unit in units:
        numel = sum(p.numel() for p in unit.parameters())
        joins = (
            bool(run)
            and isinstance(unit, TransformerLayer)
            and parents.get(id(unit)) == parents.get(id(run[-1]))
            and run_numel + numel <= size
        )
        if not joins:
            if run:
                grouped.append(run if len(run) > 1 else run[0])
            run, run_numel = [], 0
            if not isinstance(unit, TransformerLayer):
                grouped.append(unit)
                continue
        run.append(unit)
        run_numel += numel
    if run:
        grouped.append(run if len(run) > 1 else run[0])
    return grouped
