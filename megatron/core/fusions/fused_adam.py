"""Adam and AdamW steps that also write the model's low-precision weights: one Triton kernel per
parameter group updates the fp32 main weights and their moments and rounds the new weights into
the model's bf16 (or fp16) weights.

Mixed-precision training steps fp32 main weights and then copies them into the model's weights.
torch's fused Adam reads each weight, gradient and both moments and writes back the weight and
the moments (28 bytes per element); the copy reads the weight again and writes its rounding (6
more). `step_and_copy` does both in one pass over memory (30 bytes per element), every tensor of
a parameter group in one launch.

The update is torch's Adam / AdamW (decay, moments, bias corrections from each tensor's step
count, `eps` added after the square root), its intermediates in float64 and its square roots and
divisions correctly rounded: weights and moments equal `optimizer.step()`'s up to fp32 rounding
(a unit or two in the last place), step counts exactly, and the model weights are the new main
weights rounded, as `copy_` rounds them. Like torch's fused kernels it reads a learning rate held
in a device tensor and skips the step on the device where the optimizer's `found_inf` is 1
(`device_step.py`), so a CUDA graph can capture it.

A step can scale the gradients first (`GradScale`: Megatron's clipping coefficient). On NVIDIA
GPUs the kernel multiplies each gradient as it reads it, so clipping costs no pass of its own
over the gradients (reading and writing them all, 8 bytes per element); the product is rounded
to fp32 as an in-place `_foreach_mul_` rounds it, so the update is the same. The gradients keep
their values.

A step can also record absolute maxima of the new weights (`StepAmaxes`): Megatron-FSDP's FP8
weights (`fp8_param_gather`) are scaled from them, which the kernel takes from the values it
writes, sparing a second pass over the fp32 main weights.

It runs where the torch optimizer is `Adam` or `AdamW` built with `fused=True` (no amsgrad,
maximize or gradient scaling), on CUDA with Triton, over plain contiguous fp32 tensors (not
DTensors: Megatron-FSDP's optimizers step the local shards) that start on 16-byte boundaries,
from the second step on (the first creates the moments). Anywhere else
`step_and_copy` is the torch step followed by one foreach copy. The optimizer's step hooks
(Megatron-FSDP's `fully_shard_optimizer`, the DDP engine's) run in both.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks as _global_post_hooks
from torch.optim.optimizer import _global_optimizer_pre_hooks as _global_pre_hooks

from megatron.core.fp8.quantize import record_amax
from megatron.core.fusions.multi_tensor_tables import aligned, program_table
from megatron.core.utils import cuda_graph_capturing

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only PyTorch builds
    triton = None

_BLOCK = 512
"""Elements one program updates per iteration: four per thread of four warps (16-byte loads)."""

_BLOCKS_PER_PROGRAM = 4
"""Iterations per program: enough work to amortise the loads of its tensor's addresses, few
enough that a program's loads are not serialised behind one another's (longer loops were
slower on an H200)."""

_RECORDING_BLOCKS_PER_PROGRAM = 16
"""Iterations per program of a launch that records absolute maxima: each program max-es its
maximum into its tensor's slot, and four times fewer programs contend for the slots. On an
H200 (2.0B elements of a Llama-3-8B-shaped model, 32 weights recorded) the step took 14.1 ms
against 15.1 ms with 4 iterations; without recording, 16 iterations were 5% slower than 4."""

_WARPS = 4
"""Warps per program: each thread loads 16 bytes of each tensor per block. On an H200 the best
tile with 8 warps (1,024 elements a block) took 15.3 ms against 14.8 ms for this one."""

_ROW = 8
"""Entries of a tensor's row in the address table: weight, first moment, second moment, model
weight (-1: none), step count, number of elements, absolute-maximum slot (-1: none), gradient
(last: the one entry that changes from step to step where an engine frees its gradient buffers
between steps)."""

_NO_MODEL = -1
"""The model-weight entry of a row without one: not 0, the address that tensors without storage
of their own report, so that a row which gains such a model weight differs from the last step's
and is checked in full."""

_NO_AMAX = -1
"""The absolute-maximum entry of a row without one (-1 for the same reason as `_NO_MODEL`)."""


if triton is not None:

    @triton.jit
    def _magnitudes(values, mask):
        """`|values|` where `mask`, 0 elsewhere and for NaNs (skipped, as
        `megatron.core.fp8.quantize.record_amax` skips them)."""
        magnitude = tl.abs(values)
        return tl.where(mask & (magnitude == magnitude), magnitude, 0.0)

    @triton.jit
    def _record_max(address, value):
        """Max-es `value` into the fp32 at `address`. Every program of a tensor records into
        one address: an atomic from each serialises them, so only a value above the one read
        there takes the atomic (a stale read costs an atomic, never a wrong maximum)."""
        pointer = address.to(tl.pointer_type(tl.float32))
        if value > tl.load(pointer):
            tl.atomic_max(pointer, value)

    @triton.jit
    def _rounded_product(values, factor):
        """`values * factor` rounded to fp32, as PTX's `mul.rn.f32` rounds it. As plain Triton
        the compiler may carry the product unrounded into the float64 arithmetic that follows
        (Adam's L2 decay did), and the update would differ from an in-place multiplication's."""
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;",
            "=r,r,r",
            [values, factor + tl.zeros_like(values)],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def _adam_kernel(
        tensors,
        programs,
        hyper,
        lr_ptr,
        found_inf_ptr,
        grad_scale,
        grad_scale_ptr,
        DECOUPLED: tl.constexpr,
        DECAY: tl.constexpr,
        LR_ON_DEVICE: tl.constexpr,
        SKIP_ON_DEVICE: tl.constexpr,
        SCALE_GRADS: tl.constexpr,
        SCALE_ON_DEVICE: tl.constexpr,
        RECORD_AMAX: tl.constexpr,
        COPY_DTYPE: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        program = tl.program_id(0)
        row = tensors + tl.load(programs + 2 * program).to(tl.int64) * 8
        start = tl.load(programs + 2 * program + 1).to(tl.int64) * (BLOCK * BLOCKS)
        # Every address starts on a 16-byte boundary (`aligned`): vector loads and stores.
        param = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
        numel = tl.load(row + 5)
        amax_address = tl.load(row + 6)
        # Element-wise maxima over the program's blocks, reduced once at its end.
        amaxes = tl.zeros((BLOCK,), dtype=tl.float32)
        if SKIP_ON_DEVICE:
            if tl.load(found_inf_ptr) == 1.0:
                # A skipped step still records the (unchanged) weights' maximum.
                if RECORD_AMAX:
                    if amax_address > 0:
                        for block in range(BLOCKS):
                            offsets = start + block * BLOCK + tl.arange(0, BLOCK)
                            mask = offsets < numel
                            p = tl.load(param + offsets, mask=mask)
                            amaxes = tl.maximum(amaxes, _magnitudes(p, mask))
                        _record_max(amax_address, tl.max(amaxes, axis=0))
                return
        exp_avg = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float32)), 16)
        exp_avg_sq = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32)), 16)
        model_address = tl.load(row + 3)
        model = tl.multiple_of(model_address.to(tl.pointer_type(COPY_DTYPE)), 16)
        step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32))).to(tl.float64)
        grad = tl.multiple_of(tl.load(row + 7).to(tl.pointer_type(tl.float32)), 16)

        beta1 = tl.load(hyper)
        beta2 = tl.load(hyper + 1)
        eps = tl.load(hyper + 2)
        weight_decay = tl.load(hyper + 3)
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float64)
        else:
            lr = tl.load(hyper + 4)
        # Corrections in float64, handed to the fp32 arithmetic rounded (as torch's kernel).
        bias_correction1 = (1.0 - libdevice.pow(beta1, step)).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt(1.0 - libdevice.pow(beta2, step)).to(tl.float32)
        step_size = (lr / bias_correction1.to(tl.float64)).to(tl.float32)
        if SCALE_ON_DEVICE:
            grad_scale = tl.load(grad_scale_ptr)

        for block in range(BLOCKS):
            offsets = start + block * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < numel
            p = tl.load(param + offsets, mask=mask)
            g = tl.load(grad + offsets, mask=mask)
            if SCALE_GRADS:
                g = _rounded_product(g, grad_scale)
            m = tl.load(exp_avg + offsets, mask=mask)
            v = tl.load(exp_avg_sq + offsets, mask=mask)
            if DECAY:
                if DECOUPLED:
                    p = (p.to(tl.float64) - lr * weight_decay * p.to(tl.float64)).to(tl.float32)
                else:
                    g = (g.to(tl.float64) + p.to(tl.float64) * weight_decay).to(tl.float32)
            g64 = g.to(tl.float64)
            m = (beta1 * m.to(tl.float64) + (1.0 - beta1) * g64).to(tl.float32)
            v = (beta2 * v.to(tl.float64) + (1.0 - beta2) * g64 * g64).to(tl.float32)
            denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt).to(tl.float64) + eps
            p = p - tl.div_rn(step_size * m, denom.to(tl.float32))
            tl.store(param + offsets, p, mask=mask)
            tl.store(exp_avg + offsets, m, mask=mask)
            tl.store(exp_avg_sq + offsets, v, mask=mask)
            if model_address > 0:
                tl.store(model + offsets, p.to(COPY_DTYPE), mask=mask)
            if RECORD_AMAX:
                amaxes = tl.maximum(amaxes, _magnitudes(p, mask))
        if RECORD_AMAX:
            if amax_address > 0:
                _record_max(amax_address, tl.max(amaxes, axis=0))


_TRITON_DTYPES = {} if triton is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
"""Model-weight dtypes the kernel writes (fp32 weights are their own main weights)."""


@dataclasses.dataclass
class StepAmaxes:
    """Absolute maxima a step records of the weights it leaves (`step_and_copy`).

    Attributes:
        targets: (slot, weight) pairs: `max |weight|` after the step and its hooks (NaNs
            skipped) is max-ed into the slot, one fp32 element on the weight's device, as
            `megatron.core.fp8.quantize.record_amax` would then (a slot of `k` elements takes
            the maxima of `k` equal segments of the weight, as there). A weight is one the
            optimizer steps, or a part of one, or one it does not step (recorded as it is);
            several weights may share a slot. A slot one of whose weights a step hook writes
            in place is recorded again from zero.
        recorded: called once every target is recorded (after the optimizer's step hooks).
    """

    targets: list[tuple[torch.Tensor, torch.Tensor]]
    recorded: Callable[[], None]


@dataclasses.dataclass(frozen=True)
class GradScale:
    """A factor every gradient is multiplied by before a step updates with it (Megatron's
    clipping coefficient, `clip_grads.py`).

    The fused kernel multiplies each gradient as it reads it and leaves the gradients as they
    are; a step that does not run the kernel calls `scale_in_place` before torch's update. So,
    as with the scale of torch's `GradScaler` in its fused optimizers, the optimizer's step
    hooks may see the gradients unscaled, and a pre-hook that replaces a `.grad` tensor has its
    replacement scaled by the kernel but not by `scale_in_place`.

    Attributes:
        factor: a host number, or a 0-dim fp32 tensor on the gradients' device (a step that a
            CUDA graph captures).
        scale_in_place: multiplies the gradients the optimizer steps with by `factor`, each
            once, rounding as the kernel does (the product in fp32, once).
    """

    factor: float | torch.Tensor
    scale_in_place: Callable[[], None]


def step_and_copy(
    optimizer: torch.optim.Optimizer,
    copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    amaxes: Sequence[StepAmaxes | None] = (),
    grad_scale: GradScale | None = None,
) -> None:
    """`optimizer.step()`, then `model.copy_(main)` for each `(model, main)` of `copies` and the
    absolute maxima `amaxes` ask for: in one kernel per parameter group where the module
    docstring's conditions hold. The step hooks registered on the optimizer (and on every
    optimizer) run around it as around `step()`.

    Args:
        optimizer: the torch optimizer; its `found_inf` attribute, where set, skips the step on
            the device (as torch's fused kernels read it).
        copies: (model weight, the fp32 main weight the optimizer steps) pairs, same shapes;
            each main weight at most once.
        amaxes: the absolute maxima to record (None entries, from an engine without weights
            scaled from them, are skipped); each weight the optimizer steps whole has at most
            one slot.
        grad_scale: the gradients multiplied by its factor before the update (None: as they
            are). In the kernel the gradients' memory keeps its values.
    """
    amaxes = [request for request in amaxes if request is not None]
    if grad_scale is not None and not _is_foldable(grad_scale):
        _scale_in_place(grad_scale)
        grad_scale = None
    # torch wraps each optimizer class's `step` in the hook runner; the wrapped function is
    # the update alone, for a step the kernel cannot take once the hooks ran.
    hooked_step = type(optimizer).step
    update = getattr(hooked_step, "__wrapped__", None)
    if (
        triton is None
        or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW)
        or not getattr(hooked_step, "hooked", False)
        or getattr(optimizer, "grad_scale", None) is not None
    ):
        _scale_in_place(grad_scale)
        optimizer.step()
        _copy(copies)
        _record(amaxes, [])
        return
    launches: list[_Launch] = []
    recorded: list[_KernelRecord] = []
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        args, kwargs = (optimizer,), {}
        for hook in (*_global_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values()):
            result = hook(optimizer, args, kwargs)
            if result is not None:
                args, kwargs = result
        try:
            if args != (optimizer,) or kwargs:  # a closure to evaluate
                raise _Unfusable
            targets = _amax_targets(optimizer, amaxes)
            launches = _plan(optimizer, copies, targets)
        except _Unfusable:
            _scale_in_place(grad_scale)
            update(*args, **kwargs)
        else:
            found_inf = getattr(optimizer, "found_inf", None)
            factor = None if grad_scale is None else grad_scale.factor
            for launch in launches:
                torch._foreach_add_(launch.steps, 1)
                launch.run(found_inf, factor)
                if found_inf is not None:  # torch takes the count back the same way
                    torch._foreach_sub_(launch.steps, [found_inf] * len(launch.steps))
            recorded = _kernel_records(targets, launches)
        for hook in (*optimizer._optimizer_step_post_hooks.values(), *_global_post_hooks.values()):
            hook(optimizer, args, kwargs)
    # Main weights the kernel did not write (torch's step, or no gradient): copied as after
    # step(). Each main weight is in one launch and one copy at most, so equal counts mean
    # that the kernel wrote them all.
    if sum(launch.copies for launch in launches) != len(copies):
        written = {id(main) for launch in launches for main in launch.mains}
        _copy([(model, main) for model, main in copies if id(main) not in written])
    _record(amaxes, recorded)


def _copy(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if copies:
        torch._foreach_copy_([model for model, _ in copies], [main for _, main in copies])


@dataclasses.dataclass
class _KernelRecord:
    """A target of a `StepAmaxes` that the kernel recorded, with the version counters of its
    weight and of the tensor the optimizer stepped, read before the step hooks ran."""

    slot: torch.Tensor
    weight: torch.Tensor
    main: torch.Tensor
    versions: tuple[int, int]

    def written_since(self) -> bool:
        return (self.weight._version, self.main._version) != self.versions


@dataclasses.dataclass
class _AmaxTargets:
    """The targets of a step's `StepAmaxes` requests, with what planning the step reads of
    them (made once while the same pairs come back step after step: `_amax_targets`)."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    """Every request's (slot, weight) targets, in order."""
    keys: list[tuple[int, int]]
    """Each weight's address and size: a DTensor's local tensor and the engine's view of it are
    different objects over the same memory."""
    slot_of: dict[tuple[int, int], torch.Tensor]
    """The slot the kernel can record into (one fp32 element on the weight's device), by the
    key of a weight of any elements."""


_amax_target_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Optimizer -> the `_AmaxTargets` of its last step."""


def _amax_targets(optimizer: torch.optim.Optimizer, amaxes: Sequence[StepAmaxes]) -> _AmaxTargets:
    """The targets of `amaxes`, reusing the last step's where its pairs are the same objects
    over the same memory (an engine hands the same views every step)."""
    pairs = [pair for request in amaxes for pair in request.targets]
    weights = [weight for _, weight in pairs]
    # Read every step (two C-level passes): a weight re-pointed through `.data` keeps its object.
    keys = list(zip(map(_address, weights), map(torch.Tensor.numel, weights)))
    cached = _amax_target_cache.get(optimizer)
    if (
        cached is not None
        and cached.keys == keys
        and len(cached.pairs) == len(pairs)
        and all(map(operator.is_, cached.pairs, pairs))
    ):
        return cached
    slot_of = {
        key: slot
        for (slot, weight), key in zip(pairs, keys)
        if _is_device_scalar(slot) and slot.device == weight.device and key[1] > 0
    }
    targets = _AmaxTargets(pairs, keys, slot_of)
    _amax_target_cache[optimizer] = targets
    return targets


def _kernel_records(targets: _AmaxTargets, launches: Sequence[_Launch]) -> list[_KernelRecord]:
    """The `targets` the kernels of `launches` recorded: the weights stepped whole with the
    target's own slot in their row."""
    row_slots = {
        (main.data_ptr(), main.numel()): (slot, main)
        for launch in launches
        for slot, main in launch.amax_rows
    }
    records = []
    for (slot, weight), key in zip(targets.pairs, targets.keys):
        row = row_slots.get(key)
        if row is not None and row[0] is slot:
            main = row[1]
            versions = (weight._version, main._version)
            records.append(_KernelRecord(slot, weight, main, versions))
    return records


def _record(amaxes: Sequence[StepAmaxes], kernel_records: Sequence[_KernelRecord]) -> None:
    """Records the targets of `amaxes` the kernel did not (`kernel_records`) and, from zero,
    every target of a slot whose kernel-recorded weight a step hook wrote since; then says
    each request is recorded."""
    if not amaxes:
        return
    written = {id(record.slot) for record in kernel_records if record.written_since()}
    done = {
        (id(record.slot), id(record.weight))
        for record in kernel_records
        if id(record.slot) not in written
    }
    for slot in {id(r.slot): r.slot for r in kernel_records if id(r.slot) in written}.values():
        slot.zero_()
    for request in amaxes:
        for slot, weight in request.targets:
            if (id(slot), id(weight)) not in done:
                record_amax(weight.detach(), slot)
    for request in amaxes:
        request.recorded()


class _Unfusable(Exception):
    """The step cannot take the fused kernel (module docstring); torch's step runs instead."""


@dataclasses.dataclass
class _Launch:
    """One parameter group's kernel launch: its tables on the device and its flags."""

    tables: _Tables
    mains: list[torch.Tensor]
    steps: list[torch.Tensor]
    copies: int
    """How many of `mains` have a model weight the kernel writes."""
    amax_rows: list[tuple[torch.Tensor, torch.Tensor]]
    """(absolute-maximum slot, main weight) of each row that records one."""
    lr: torch.Tensor | None
    decoupled: bool
    decay: bool
    copy_dtype: torch.dtype

    def run(self, found_inf: torch.Tensor | None, grad_scale: float | torch.Tensor | None) -> None:
        hyper = self.tables.hyper
        scale_on_device = isinstance(grad_scale, torch.Tensor)
        _adam_kernel[(len(self.tables.programs),)](
            self.tables.tensors,
            self.tables.programs,
            hyper,
            hyper if self.lr is None else self.lr,
            hyper if found_inf is None else found_inf,
            1.0 if grad_scale is None or scale_on_device else float(grad_scale),
            grad_scale if scale_on_device else hyper,
            DECOUPLED=self.decoupled,
            DECAY=self.decay,
            LR_ON_DEVICE=self.lr is not None,
            SKIP_ON_DEVICE=found_inf is not None,
            SCALE_GRADS=grad_scale is not None,
            SCALE_ON_DEVICE=scale_on_device,
            RECORD_AMAX=bool(self.amax_rows),
            COPY_DTYPE=_TRITON_DTYPES[self.copy_dtype],
            BLOCK=_BLOCK,
            BLOCKS=self.tables.blocks_per_program,
            num_warps=_WARPS,
        )


@dataclasses.dataclass
class _Tables:
    """A parameter group's address table, program map and hyperparameters on the device, with
    the host values they were made from (remade when those change)."""

    fixed: list[tuple[int, ...]]
    """Each tensor's row without its gradient's address (`_ROW`'s first seven entries)."""
    blocks_per_program: int
    """`_BLOCK`s each program updates: the program map's chunks are this many."""
    fixed_rows: torch.Tensor
    """`fixed` as an int64 host tensor, the part of each address table that readdressing keeps."""
    grads: list[int]
    """The gradients' addresses, the last column."""
    tensors: torch.Tensor
    programs: torch.Tensor
    hyper_values: tuple[float, ...]
    hyper: torch.Tensor
    staging: torch.Tensor | None
    """Pinned host memory for the address table of one CUDA-graph capture (`readdressed`),
    None once a capture took it."""

    def readdressed(
        self, grads: list[int], capturing: bool, fixed: list[tuple[int, ...]] | None = None
    ) -> _Tables:
        """These tables for tensors of the same sizes at other addresses: the gradients at
        `grads`, the other tensors where they were, or at `fixed`. The program map and
        hyperparameters are kept, the address table is copied from pinned host memory.

        An engine that frees its gradient buffers between steps (Megatron-FSDP) hands the
        optimizer its gradients at other addresses each step, and inside a CUDA-graph capture
        at others than in the eager steps before it. A capture must not allocate the pinned
        buffer: it takes `staging`, made with the tables, and records a copy that its replays
        repeat, so the buffer goes to `_captured`, never written or freed again.

        Raises:
            _Unfusable: a capture, where an earlier one took `staging`.
        """
        fixed_rows = self.fixed_rows if fixed is None else torch.tensor(fixed, dtype=torch.int64)
        addresses = _address_table(fixed_rows, grads)
        if not capturing:
            staging = addresses.pin_memory()
        elif self.staging is None:
            raise _Unfusable
        else:
            staging, self.staging = self.staging, None
            staging.copy_(addresses)
            _captured.append(staging)
        tensors = torch.empty_like(self.tensors)
        tensors.copy_(staging, non_blocking=True)
        return dataclasses.replace(
            self,
            fixed=self.fixed if fixed is None else fixed,
            fixed_rows=fixed_rows,
            grads=grads,
            tensors=tensors,
        )


def _address_table(fixed_rows: torch.Tensor, grads: list[int]) -> torch.Tensor:
    """The host address table: `fixed_rows` with the gradients' addresses as last column."""
    return torch.cat((fixed_rows, torch.tensor(grads, dtype=torch.int64).unsqueeze(1)), dim=1)


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Optimizer -> its groups' `_Tables` (index: group)."""

_captured: list[_Tables | torch.Tensor] = []
"""Tables a CUDA graph captured a launch with, and the host buffers it copies tables from: its
replays read them, so they are never freed."""


def _plan(
    optimizer: torch.optim.Optimizer,
    copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
    targets: _AmaxTargets,
) -> list[_Launch]:
    """The launches of the fused step, one per group with gradients.

    Raises:
        _Unfusable: the step does not meet the module docstring's conditions.
    """
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None and not _is_device_scalar(found_inf):
        raise _Unfusable
    model_of = {id(main): model for model, main in copies}
    # Other targets are recorded after the step (`_record`).
    amax_of = targets.slot_of
    cache = _tables.setdefault(optimizer, {})
    capturing = cuda_graph_capturing()
    launches = []
    for index, group in enumerate(optimizer.param_groups):
        launch = _plan_group(optimizer, group, model_of, amax_of, cache.get(index), capturing)
        if launch is None:
            continue
        cache[index] = launch.tables
        if capturing and all(launch.tables is not t for t in _captured):
            _captured.append(launch.tables)
        launches.append(launch)
    return launches


_address = torch.Tensor.data_ptr


def _plan_group(
    optimizer: torch.optim.Optimizer,
    group: dict,
    model_of: dict[int, torch.Tensor],
    amax_of: dict[tuple[int, int], torch.Tensor],
    tables: _Tables | None,
    capturing: bool,
) -> _Launch | None:
    """A group's launch (None: no gradients to step with), reusing `tables` where they still
    describe it.

    This runs before every step, over every weight: it gathers each column of the address
    table with one pass of C-level calls rather than one Python loop body per weight.

    Raises:
        _Unfusable: the group does not meet the module docstring's conditions.
    """
    if (
        not group.get("fused")
        or group.get("amsgrad")
        or group.get("maximize")
        or group.get("differentiable")
        or any(isinstance(beta, torch.Tensor) for beta in group["betas"])
    ):
        raise _Unfusable
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and not _is_device_scalar(lr):
        raise _Unfusable
    mains = [param for param in group["params"] if param.grad is not None]
    if not mains:
        return None
    grads = [param.grad for param in mains]
    models = [model_of.get(id(param)) for param in mains]
    try:
        states = list(map(optimizer.state.get, mains))
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        steps = [state["step"] for state in states]
        numels = list(map(torch.Tensor.numel, mains))
        addresses = list(map(_address, mains))
        if amax_of:
            amax_slots = list(map(amax_of.get, zip(addresses, numels)))
            amax_entries = [_NO_AMAX if slot is None else slot.data_ptr() for slot in amax_slots]
        else:  # most steps record no maxima: no per-weight work for them
            amax_slots, amax_entries = [], [_NO_AMAX] * len(mains)
        fixed = list(
            zip(
                addresses,
                map(_address, exp_avgs),
                map(_address, exp_avg_sqs),
                [_NO_MODEL if model is None else model.data_ptr() for model in models],
                map(_address, steps),
                numels,
                amax_entries,
            )
        )
    except (KeyError, TypeError):  # no moments yet (the first step makes them), or not tensors
        raise _Unfusable from None
    if not mains[0].is_cuda or mains[0].device.index != torch.cuda.current_device():
        raise _Unfusable
    device = mains[0].device.index
    # A weight whose other tensors are where they were in the last step's table was checked
    # then: only the gradients are checked again (engines that free their gradient buffers
    # between steps hand the optimizer new gradients every step).
    previous = [] if tables is None else tables.fixed
    moved = fixed != previous
    if moved:
        if len(set(map(id, mains))) != len(mains):  # its rows would race in the kernel
            raise _Unfusable
        for i, row in enumerate(fixed):
            if i < len(previous) and row == previous[i]:
                continue
            weight = (mains[i], grads[i], exp_avgs[i], exp_avg_sqs[i])
            if not _fusable(weight, models[i], steps[i], device):
                raise _Unfusable
    grad_addresses = list(map(_address, grads))
    if not _gradients_fusable(grads, grad_addresses, numels):
        raise _Unfusable
    # Not `models.count(None)`: that compares each tensor with None through `Tensor.__eq__`.
    copies = [model for model in models if model is not None]
    copy_dtypes = {model.dtype for model in copies}
    if len(copy_dtypes) > 1:
        raise _Unfusable
    beta1, beta2 = group["betas"]
    hyper_values = (beta1, beta2, group["eps"], group["weight_decay"])
    if not isinstance(lr, torch.Tensor):
        hyper_values += (lr,)
    if moved:
        # The program map holds while the sizes and the program length stay.
        map_kept = (
            len(fixed) == len(previous)
            and all(row[5] == old[5] for row, old in zip(fixed, previous))
            and _blocks_per_program(fixed) == tables.blocks_per_program
        )
        if map_kept:
            tables = tables.readdressed(grad_addresses, capturing, fixed)
        elif capturing:  # a program map made now would be copied from pageable host memory
            raise _Unfusable
        else:
            tables = _build_tables(fixed, grad_addresses, mains[0].device, hyper_values)
    elif grad_addresses != tables.grads or (not capturing and _is_captured(tables)):
        # A table a capture made is filled by the graph's replays, not by the capture itself.
        tables = tables.readdressed(grad_addresses, capturing)
    if tables.hyper_values != hyper_values:
        if capturing:
            raise _Unfusable
        # New memory, not written over: a graph may have captured a launch that reads this.
        hyper = torch.tensor(hyper_values, dtype=torch.float64)
        hyper = hyper.to(tables.hyper.device, non_blocking=True)
        tables = dataclasses.replace(tables, hyper_values=hyper_values, hyper=hyper)
    return _Launch(
        tables=tables,
        mains=mains,
        steps=steps,
        copies=len(copies),
        amax_rows=[(slot, main) for slot, main in zip(amax_slots, mains) if slot is not None],
        lr=lr if isinstance(lr, torch.Tensor) else None,
        decoupled=bool(
            group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        ),
        decay=group["weight_decay"] != 0,
        copy_dtype=copy_dtypes.pop() if copy_dtypes else torch.bfloat16,
    )


def _blocks_per_program(fixed: list[tuple[int, ...]]) -> int:
    """The program length of a launch over the rows `fixed` (`_RECORDING_BLOCKS_PER_PROGRAM`
    where a row records an absolute maximum)."""
    if any(row[6] != _NO_AMAX for row in fixed):
        return _RECORDING_BLOCKS_PER_PROGRAM
    return _BLOCKS_PER_PROGRAM


def _build_tables(
    fixed: list[tuple[int, ...]],
    grads: list[int],
    device: torch.device,
    hyper_values: tuple[float, ...],
) -> _Tables:
    fixed_rows = torch.tensor(fixed, dtype=torch.int64)
    blocks = _blocks_per_program(fixed)
    programs = program_table(fixed_rows[:, 5], _BLOCK * blocks)
    return _Tables(
        fixed=fixed,
        blocks_per_program=blocks,
        fixed_rows=fixed_rows,
        grads=grads,
        tensors=_address_table(fixed_rows, grads).to(device, non_blocking=True),
        programs=programs.to(device, non_blocking=True),
        hyper_values=hyper_values,
        hyper=torch.tensor(hyper_values, dtype=torch.float64).to(device, non_blocking=True),
        staging=torch.empty((len(fixed), _ROW), dtype=torch.int64, pin_memory=True),
    )


def _fusable(
    tensors: tuple[torch.Tensor, ...], model: torch.Tensor | None, step: torch.Tensor, device: int
) -> bool:
    """fp32 main weight, gradient and moments (and a bf16 / fp16 model weight) of one shape,
    contiguous and 16-byte aligned in memory of their own on CUDA device `device`, with a
    device step count there."""
    main = tensors[0]
    if not (main.is_cuda and main.device.index == device):
        return False
    if not (_is_device_scalar(step) and step.device == main.device):
        return False
    if any(t.dtype != torch.float32 for t in tensors):
        return False
    if model is not None:
        if model.dtype not in _TRITON_DTYPES:
            return False
        tensors = (*tensors, model)
    return all(
        t.device == main.device
        and t.shape == main.shape
        and t.is_contiguous()
        and aligned(t.data_ptr(), t.numel())
        for t in tensors
    )


def _gradients_fusable(grads: list[torch.Tensor], addresses: list[int], numels: list[int]) -> bool:
    """`_fusable` for gradients (at `addresses`) whose weights (of `numels` elements) passed it:
    `.grad` takes only tensors of its weight's shape and device, but a write through `.data`
    can change their dtype and size; those, layout and alignment are what is left to check."""
    return (
        all(grad.dtype == torch.float32 for grad in grads)
        and all(map(torch.Tensor.is_contiguous, grads))
        and list(map(torch.Tensor.numel, grads)) == numels
        and all(aligned(address, numel) for address, numel in zip(addresses, numels))
    )


def _is_captured(tables: _Tables) -> bool:
    """Whether a CUDA graph captured a launch with `tables`."""
    return any(tables is captured for captured in _captured)


def _scale_in_place(grad_scale: GradScale | None) -> None:
    """Multiplies the gradients by `grad_scale`'s factor, where there is one, before a step
    that reads them unscaled (torch's own)."""
    if grad_scale is not None:
        grad_scale.scale_in_place()


def _is_foldable(grad_scale: GradScale) -> bool:
    """Whether the kernel can take `grad_scale`'s factor: a host number, or a device scalar on
    the current device (where the kernel runs), on an NVIDIA GPU (its multiplication is PTX)."""
    if torch.version.hip is not None:
        return False
    factor = grad_scale.factor
    if not isinstance(factor, torch.Tensor):
        return True
    return _is_device_scalar(factor) and factor.device.index == torch.cuda.current_device()


def _is_device_scalar(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and tensor.dtype == torch.float32 and tensor.numel() == 1
