"""`fully_shard(module)`: turns a module into a Megatron-FSDP unit, in place.

Call it bottom-up: once per unit (typically each transformer layer), then on the root, which
takes every parameter no unit below it holds. The module keeps its identity (parents keep their
references to it); its class gains the `FsdpModule` mixin, and its parameters are replaced by
DTensor main weights (the sharded fp32 weights the optimizer steps, what `parameters()` and
`state_dict()` return). Around each forward the unit registers the whole compute-dtype weights
instead. The unit's hooks hand each phase to the root's `FsdpContext`, which decides what runs
(unshard, prefetch, register, reduce, reshard): this module only wraps modules and registers
hooks; how they tell where a unit's backward begins and ends is `unit_boundaries.py`.

A unit may be several modules (`fully_shard([layer_0, layer_1])`, as in FSDP2), gathered and
reduced together: one set of collectives and hooks' work for all of them, for the memory of
their compute weights at once. Inside the root's forward, the unit's forward starts at the first
of them to run and ends when all have run (or the root's forward ends); outside it, each call of
one of them is a whole forward of the unit.

Parameters built on the `meta` device are materialised when the root is first used (forward,
`microbatch()`, `fully_shard_optimizer()`, the adapter), one parameter-owning module at a time
in module order with its `reset_parameters()` (which also sets the module's `meta` buffers),
each rank keeping only its shards: no rank ever holds the whole model, and the weights equal an
eager build's with the same seed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megatron.core.distributed.expert_parallel import is_expert_param
from megatron.core.distributed.fsdp import optimizer_steps
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.context import FsdpContext, TrainingState, in_backward
from megatron.core.distributed.fsdp.distributed_index import FSDPDistributedIndex
from megatron.core.distributed.fsdp.mixed_precision import MixedPrecisionPolicy
from megatron.core.distributed.fsdp.overlap import OverlapPolicy
from megatron.core.distributed.fsdp.param_group import FsdpParameterGroup, ParamSlot
from megatron.core.distributed.fsdp.strategy import (
    OuterShardingStrategy,
    ShardingPolicy,
    ShardingStrategy,
)
from megatron.core.distributed.fsdp.unit_boundaries import (
    BackwardEnd,
    GroupForward,
    PreBackwardHook,
    announce_backward,
    route_inputs,
)
from megatron.core.fp8.linear import computes_in_fp8
from megatron.core.tensor_parallel.layout import named_tensor_parallel_layouts
from megatron.core.utils import outside_compiled_graphs

_Modules = TypeVar("_Modules", torch.nn.Module, Sequence[torch.nn.Module])
"""What `fully_shard` takes and returns: a module, or the modules of one unit."""

_owner_unit = WeakIdKeyDictionary()
"""Original parameter -> weakref of the unit that took it (to refuse sharing across units)."""


class FsdpModule:
    """Mixin `fully_shard` adds to a module's class: the unit's public controls."""

    _fsdp_unit: FsdpUnit

    @property
    def fsdp_unit(self) -> FsdpUnit:
        return self._fsdp_unit

    def unshard(self) -> None:
        """Starts all-gathering this unit's compute weights (ZeRO-3; on GPU on the all-gather
        stream), ahead of its forward, which then only waits for it."""
        unit = self._fsdp_unit
        unit.lazy_init().unshard(unit)

    def reshard(self) -> None:
        """Frees this unit's whole compute weights (ZeRO-3) once their queued uses are done."""
        unit = self._fsdp_unit
        unit.lazy_init().residency.reshard(unit)

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise TypeError(
            f"A module wrapped by fully_shard ({type(self).__name__}) cannot be deep-copied: its "
            "parameters are views of its units' shared buffers and its state holds process "
            "groups (FSDP2 refuses it too). Build and wrap another model, then "
            "load_state_dict(copy.deepcopy(model.state_dict()))."
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`torch.nn.Module.zero_grad`, which also forgets the gradients the units in this
        module hold outside `.grad`, where an optimizer's `zero_grad()` cannot reach them: the
        whole sums of a step's earlier microbatches (`accumulate_unsharded_grads`) and those
        a failed backward left unreduced. Use it to abandon a step midway."""
        context = self._fsdp_unit.context
        if context is not None:
            units = dict.fromkeys(m._fsdp_unit for m in self.modules() if isinstance(m, FsdpModule))
            context.drop_held_grads(units)
        super().zero_grad(set_to_none)


class FsdpUnit:
    """The FSDP state of one unit: its parameter groups and the hooks that hand its forward and
    backward to the root's `FsdpContext`.

    Attributes:
        groups: the unit's parameter groups.
        overlap_policy: the schedule given to `fully_shard` (None: not given). The root's, or
            the default, applies to every unit below it.
        name: the unit's module name under its root (the root: its class name; several
            modules: their names joined by "+"), set when it binds; used in messages and
            profiler labels.
        position: where the context lists this unit (0: the root), set when it binds.
        has_transient_weights: whether some group gathers its compute weights for each use and
            frees them after (ZeRO-3).
    """

    def __init__(
        self,
        modules: list[torch.nn.Module],
        groups: list[FsdpParameterGroup],
        overlap_policy: OverlapPolicy | None,
    ):
        self._modules = [weakref.ref(module) for module in modules]
        self.groups = groups
        self.overlap_policy = overlap_policy
        self.name = "+".join(type(module).__name__ for module in modules)
        self.position = 0
        self.has_transient_weights = any(group.has_transient_weights for group in groups)
        self._context: FsdpContext | None = None  # owned by the root only
        self._context_ref: weakref.ref[FsdpContext] | None = None
        self.pending_meta: list[PendingParam] = []
        # A unit of several modules: its forward in progress (module docstring). The root:
        # its units of several modules, whose open forwards it ends with its own.
        self._forward: GroupForward | None = None
        self._grouped: list[weakref.ref[FsdpUnit]] = []

    @property
    def module(self) -> torch.nn.Module | None:
        """The unit's module (of several: the first given)."""
        return self._modules[0]()

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The unit's live modules, in the order given to `fully_shard`."""
        return [module for ref in self._modules if (module := ref()) is not None]

    @property
    def context(self) -> FsdpContext | None:
        return self._context_ref() if self._context_ref is not None else None

    @property
    def is_root(self) -> bool:
        return self._context is not None

    def lazy_init(self) -> FsdpContext:
        """The unit's context; created here, with this unit as root, if it has none. The
        root's first use also materialises parameters built on the `meta` device.

        Raises:
            ValueError: a unit below was given an overlap policy other than the root's (one
                schedule governs them all, so it would be ignored), or was used before this
                root (and became a root itself).
        """
        context = self.context
        if context is not None:
            return context
        if len(self._modules) > 1:
            raise ValueError(
                f"The Megatron-FSDP unit {self.name} of several modules has no root yet: call "
                "fully_shard() on a module that contains them all (the model) after them, and "
                "use the model (its forward, microbatch() or fully_shard_optimizer()) first."
            )
        module = self.module
        names = {id(m): name for name, m in module.named_modules()}
        # A unit of several modules once, at its first module.
        units = list(
            dict.fromkeys(m._fsdp_unit for m in module.modules() if isinstance(m, FsdpModule))
        )
        policy = self.overlap_policy or OverlapPolicy()
        for unit in units[1:]:
            if unit.is_root:
                # As in FSDP2: its context (open reductions, compute weights held) would be lost.
                raise ValueError(
                    f"The Megatron-FSDP unit {names.get(id(unit.module)) or unit.name} was "
                    f"used before the root {self.name} that contains it, so it "
                    "was set up as a root of its own. Use the root first (its forward, "
                    "microbatch() or fully_shard_optimizer()): that sets up every unit below it."
                )
            if unit.overlap_policy is not None and unit.overlap_policy != policy:
                raise ValueError(
                    f"The Megatron-FSDP unit {unit.name} was given "
                    f"{unit.overlap_policy}, but its root {type(module).__name__} uses {policy}: "
                    "the root's schedule applies to every unit below it. Pass the same "
                    "OverlapPolicy to both, or only to the root."
                )
        _materialize_meta(module, units)
        for position, unit in enumerate(units):
            unit.position = position
            unit.name = "+".join(names.get(id(m)) or type(m).__name__ for m in unit.modules)
        self._grouped = [weakref.ref(unit) for unit in units if len(unit._modules) > 1]
        devices = [group.device for unit in units for group in unit.groups]
        context = FsdpContext(units, policy, devices[0] if devices else torch.device("cpu"))
        for unit in units:
            unit._bind(context)
        self._context = context
        return context

    def _bind(self, context: FsdpContext) -> None:
        """Makes this unit use `context` (held weakly: the root owns it)."""
        self._context = None
        self._context_ref = weakref.ref(context)
        for group in self.groups:
            group.bind(context.comm)

    # The unit hooks run eagerly under torch.compile (a graph break at each unit's edges): they
    # issue collectives through process-group methods that Dynamo cannot trace.
    @outside_compiled_graphs
    def pre_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        context = self.lazy_init()
        if in_backward():
            context.pre_recompute(self)  # an activation-recompute rerun
            return args, kwargs
        if self._grouped:
            # The root's forward starts: what a failed one left open is over.
            for unit in self._live_grouped():
                unit._forward = None
        if len(self._modules) > 1:
            return self._pre_forward_of_member(context, args, kwargs)
        if not context.pre_forward(self):
            return args, kwargs
        end = BackwardEnd(self)
        routed, _ = route_inputs(end, args, kwargs)
        self._set_reduction_point(end)
        return routed

    def _pre_forward_of_member(
        self, context: FsdpContext, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The pre-forward of one module of a unit of several: the first to run opens the
        unit's forward; each routes its inputs not made inside the unit (those are reached by
        the backward before the inputs of the modules that made them)."""
        forward = self._forward
        if forward is None or context.state is not TrainingState.FORWARD:
            # Outside the root's forward every call of a module is a forward of the unit.
            context.pre_forward(self)
            forward = self._forward = GroupForward(self)
        if not torch.is_grad_enabled():
            # Run without autograd (a reentrant checkpoint's first pass, or inference): its
            # backward, if any, runs where no routed input can tell its end.
            forward.end.unreachable = True
            if forward.with_autograd:
                self._set_reduction_point(forward.end)
            return args, kwargs
        forward.with_autograd = True
        routed, needs_grad = route_inputs(forward.end, args, kwargs, forward.produced_inside)
        if not needs_grad:
            # No input needs a gradient, so none tells when this module's backward is over.
            forward.end.unreachable = True
        self._set_reduction_point(forward.end)
        return routed

    def _set_reduction_point(self, end: BackwardEnd) -> None:
        """The unit's gradients are reduced at the end of its own backward where `end` is
        reachable, else at the end of the whole backward. Set before each module's forward
        with autograd: linear layers ask it there whether to write their weight gradients into
        the reduction's input (those of a compiled layer at its backward: the answer of the
        unit's latest forward; not an inference forward's, which has no backward)."""
        for group in self.groups:
            if group.grads is not None:
                group.grads.pre_forward(reduced_after_own_backward=end.reachable)

    @outside_compiled_graphs
    def post_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if in_backward():
            return output  # a recompute rerun: the backward needs the weights as registered
        if len(self._modules) > 1:
            return self._post_forward_of_member(module, output)
        if self._grouped:
            # The root's forward ends: so do its units' whose modules did not all run.
            for unit in self._live_grouped():
                if unit._forward is not None:
                    unit._end_forward()
        self.context.post_forward(self)
        announce_backward(output, PreBackwardHook(self))
        return output

    def _post_forward_of_member(self, module: torch.nn.Module, output: Any) -> Any:
        """The post-forward of one module of a unit of several: its outputs announce the
        unit's backward; the last module to run (or any, outside the root's forward) ends
        the unit's forward."""
        forward = self._forward
        if forward is None:
            # Ended already: outside the root's forward, by a module of the unit it called.
            return output
        forward.pending.discard(id(module))
        forward.produced.extend(announce_backward(output, forward.hook))
        if not forward.pending or self.context.state is not TrainingState.FORWARD:
            self._end_forward()
        return output

    def _end_forward(self) -> None:
        """Ends the open forward of this unit of several modules (the context's post-forward)."""
        self._forward = None
        self.context.post_forward(self)

    def _live_grouped(self) -> Iterator[FsdpUnit]:
        for ref in self._grouped:
            unit = ref()
            if unit is not None:
                yield unit


def fully_shard(
    module: _Modules,
    distributed_index: FSDPDistributedIndex | None = None,
    *,
    sharding_strategy: str | ShardingStrategy | ShardingPolicy = "optim_grads_params",
    outer_dp_sharding_strategy: str | OuterShardingStrategy = "no_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    overlap_policy: OverlapPolicy | None = None,
    is_expert: Callable[[str, torch.nn.Parameter], bool] = is_expert_param,
) -> _Modules:
    """Makes `module` a Megatron-FSDP unit in place and returns it.

    Args:
        module: the unit; units below it must already be wrapped. A sequence of modules
            (below one root, none inside another) makes one unit of them all: their weights
            are gathered and their gradients reduced together (module docstring).
        distributed_index: process groups (default: parallel_state's, else the world).
        sharding_strategy: `no_shard`, `optim`, `optim_grads` or `optim_grads_params` (a
            `ShardingStrategy`), or a `ShardingPolicy` (which then also carries the outer
            strategy).
        outer_dp_sharding_strategy: with an outer group: `no_shard` (HSDP) or `optim` (HFSDP).
        mp_policy: dtypes of main weights and gradients (default: fp32 main weights).
        overlap_policy: the communication schedule (prefetching, reduce-scatter overlap, the
            bound on compute weights held, symmetric memory); the root's applies to every unit
            below it, which may repeat it or leave it out (default: everything overlapped, 2
            units). A different one below the root is an error at its first use.
        is_expert: tells expert parameters (which use the expert groups) from dense ones.

    Raises:
        ValueError: a module is already a unit, or given twice, or inside another given; no
            module is given; a strategy does not exist or needs an outer group there is none
            of; a parameter is shared with a module outside this unit that another unit holds;
            a `meta` module has no `reset_parameters()`; an embedding makes sparse gradients.
    """
    modules = [module] if isinstance(module, torch.nn.Module) else list(module)
    _check_unit_modules(modules)
    if not isinstance(sharding_strategy, ShardingPolicy):
        sharding_strategy = ShardingPolicy(sharding_strategy, outer_dp_sharding_strategy)
    index = distributed_index or FSDPDistributedIndex.from_pg_collection(None)
    mp_policy = mp_policy or MixedPrecisionPolicy()

    slots, params = _collect_params(modules)
    name = "+".join(type(m).__name__ for m in modules)
    members: dict[tuple[torch.dtype, bool, bool, bool], list[int]] = {}
    for i, (slot, param) in enumerate(zip(slots, params)):
        fp8 = mp_policy.fp8_param_gather and param.requires_grad and _computes_in_fp8(slot)
        key = (param.dtype, param.requires_grad, is_expert(slot.fqn, param), fp8)
        members.setdefault(key, []).append(i)
    devices = {p.device for p in params if p.device.type != "meta"}
    if len(devices) > 1:
        raise ValueError(
            f"The parameters of {name} are on several devices {devices}; move the module to "
            "one device before fully_shard()."
        )
    device = devices.pop() if devices else index.device
    groups: list[FsdpParameterGroup] = []
    for (dtype, requires_grad, expert, fp8), indices in members.items():
        shard_groups = index.groups(expert)
        sharding_strategy.check_outer_group(shard_groups.outer_size)
        groups.append(
            FsdpParameterGroup(
                [params[i].shape for i in indices],
                [slots[i] for i in indices],
                model_dtype=dtype,
                requires_grad=requires_grad,
                fp8_gather=fp8,
                keep_fp8_transposes=mp_policy.keep_fp8_transpose_cache,
                groups=shard_groups,
                strategy=sharding_strategy,
                precision=mp_policy.resolve(dtype),
                # Replaced by the root context's issuer at lazy init.
                comm=Collectives(),
                device=device,
            )
        )
    unit = FsdpUnit(modules, groups, overlap_policy)
    with torch.no_grad():
        for group, indices in zip(groups, members.values()):
            for k, i in enumerate(indices):
                if params[i].device.type == "meta":
                    unit.pending_meta.append(PendingParam(slots[i], params[i], group, k))
                else:
                    group.load_full_tensor(k, params[i])
    for param in params:
        _owner_unit[param] = weakref.ref(unit)
    for group in groups:
        group.weights.register_sharded()
        optimizer_steps.track(group.weights)
    for member in modules:
        member.__class__ = _fsdp_class(type(member))
        member._fsdp_unit = unit
        member.register_forward_pre_hook(unit.pre_forward, prepend=True, with_kwargs=True)
        member.register_forward_hook(unit.post_forward, with_kwargs=True)
        member.register_state_dict_post_hook(_alias_main_weights)
    return module


def _alias_main_weights(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """`state_dict()`'s post-hook on a unit's modules: the values it returns alias the main
    weights, and writes into them (`torch.distributed.checkpoint.load` writes there) must reach
    the compute weights.

    `Module.state_dict()` detaches each DTensor parameter, and a detached DTensor's local tensor
    counts its writes apart; so the unit's main weights in it become DTensors over aliases of
    the main weights' memory whose writes the unit counts (`GroupWeights.aliased_dtensor`,
    which `torch.save` and `copy.deepcopy` handle too). And the unit's compute weights are
    refreshed at its next use whatever the versions say: a rank whose shard of a tensor is empty
    sees no write to count, yet must refresh with the ranks that do (the refresh is a
    collective), and every rank builds the state dict (`torch.distributed.checkpoint` needs
    them all).
    """
    del local_metadata
    unit = module._fsdp_unit
    owners = {}
    for group in unit.groups:
        group.weights.mark_written()
        owners.update(
            (id(param), (group.weights, index))
            for index, param in enumerate(group.weights.main_weights)
        )
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        if id(param) in owners and key in state_dict and state_dict[key] is not param:
            weights, index = owners[id(param)]
            state_dict[key] = weights.aliased_dtensor(index)


def _check_unit_modules(modules: list[torch.nn.Module]) -> None:
    """Refuses modules that cannot make one unit (`fully_shard`'s Raises)."""
    if not modules:
        raise ValueError("fully_shard() got an empty list of modules; give at least one.")
    for member in modules:
        if isinstance(member, FsdpModule):
            raise ValueError(
                f"{type(member).__name__} is already a Megatron-FSDP unit; call fully_shard() "
                "once per module."
            )
    ids = {id(member) for member in modules}
    if len(ids) < len(modules):
        raise ValueError("fully_shard() got the same module twice; give each module once.")
    for member in modules:
        inner = next((m for m in member.modules() if m is not member and id(m) in ids), None)
        if inner is not None:
            raise ValueError(
                f"fully_shard() got {type(inner).__name__} and {type(member).__name__}, which "
                "contains it; give modules of which none contains another (wrap the inner one "
                "as a unit of its own first if it should gather on its own)."
            )
        for name, inner in member.named_modules():
            if isinstance(inner, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and inner.sparse:
                raise ValueError(
                    f"{name or type(member).__name__} ({type(inner).__name__}) makes sparse "
                    "gradients, which Megatron-FSDP does not reduce (nor does FSDP2); build it "
                    "with sparse=False."
                )


def _collect_params(
    modules: list[torch.nn.Module],
) -> tuple[list[ParamSlot], list[torch.nn.Parameter]]:
    """The parameters `modules` hold outside nested units, with every place each is registered
    and its tensor-parallel layout (absent: replicated). Names are relative to their module,
    prefixed with its index among several.

    Raises:
        ValueError: a parameter here is held by another unit (shared across units).
    """
    slots: dict[torch.nn.Parameter, ParamSlot] = {}
    for i, module in enumerate(modules):
        layouts = named_tensor_parallel_layouts(module)
        prefix_of_module = f"{i}." if len(modules) > 1 else ""
        for prefix, owner in _modules_outside_units(module):
            for name, param in owner._parameters.items():
                if param is None:
                    continue
                fqn = f"{prefix}{name}"
                taken = _owner_unit.get(param)
                if taken is not None and taken() is not None:
                    raise ValueError(
                        f"Parameter {fqn!r} of {type(module).__name__} is shared with a module "
                        "of another Megatron-FSDP unit. A shared parameter must belong to one "
                        "unit: wrap the lowest common ancestor of its users instead of one of "
                        "them."
                    )
                if param not in slots:
                    slots[param] = ParamSlot(prefix_of_module + fqn, [], layouts.get(fqn))
                slots[param].registrations.append((weakref.ref(owner), name))
    return list(slots.values()), list(slots)


def _computes_in_fp8(slot: ParamSlot) -> bool:
    """Whether every module that registers the parameter computes with it in FP8."""
    modules = [(module_ref(), name) for module_ref, name in slot.registrations]
    return all(module is not None and computes_in_fp8(module, name) for module, name in modules)


def _modules_outside_units(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(prefix, submodule) for `module` and its descendants, not entering nested units."""
    stack = [("", module)]
    seen: set[int] = set()
    while stack:
        prefix, current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield prefix, current
        children = [
            (f"{prefix}{name}.", child)
            for name, child in current.named_children()
            if not isinstance(child, FsdpModule)
        ]
        stack.extend(reversed(children))


@dataclass
class PendingParam:
    """A parameter built on `meta`, waiting for its owner's `reset_parameters()`."""

    slot: ParamSlot
    param: torch.nn.Parameter
    group: FsdpParameterGroup
    index: int


@torch.no_grad()
def _materialize_meta(module: torch.nn.Module, units: list[FsdpUnit]) -> None:
    """Initialises the `meta` parameters of `units`, one owning module at a time in
    `module.modules()` order (the order an eager build initialises in, so the same seed gives
    the same weights), keeping only this rank's shards. The `meta` buffers of any module are
    allocated whole on the units' device and set by the same `reset_parameters()` (as
    `torch.nn.BatchNorm`'s resets its running statistics).

    Raises:
        ValueError: a module holding `meta` parameters or buffers has no `reset_parameters()`.
    """
    by_owner: dict[int, list[tuple[str, PendingParam]]] = {}
    for unit in units:
        for pending in unit.pending_meta:
            owner_ref, name = pending.slot.registrations[0]
            by_owner.setdefault(id(owner_ref()), []).append((name, pending))
        unit.pending_meta = []
    if not by_owner:
        return
    # Buffers are not sharded: each goes whole to the device the units' groups live on.
    device = next(pending.group.device for entries in by_owner.values() for _, pending in entries)
    for owner in module.modules():
        entries = by_owner.pop(id(owner), [])
        buffers = [name for name, buffer in owner._buffers.items() if _is_meta(buffer)]
        if not entries and not buffers:
            continue
        reset = getattr(owner, "reset_parameters", None)
        if reset is None:
            raise ValueError(
                f"{type(owner).__name__} holds parameters or buffers on the meta device but has "
                "no reset_parameters(); give it one, or build the model on a real device."
            )
        for name, pending in entries:
            owner._parameters[name] = torch.nn.Parameter(
                torch.empty_like(pending.param, device=pending.group.device),
                requires_grad=pending.param.requires_grad,
            )
        for name in buffers:
            owner._buffers[name] = torch.empty_like(owner._buffers[name], device=device)
        reset()
        for name, pending in entries:
            pending.group.load_full_tensor(pending.index, owner._parameters[name])
            # Drop the whole tensor now: only one module's are ever alive at once.
            owner._parameters[name] = pending.group.main_weights[pending.index]


def _is_meta(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_meta


_fsdp_classes: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """`FsdpModule` mixed into `cls`, one class per original class (as FSDP2 does)."""
    if cls not in _fsdp_classes:
        _fsdp_classes[cls] = type(f"Fsdp{cls.__name__}", (FsdpModule, cls), {})
    return _fsdp_classes[cls]
