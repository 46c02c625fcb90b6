"""How one root's units overlap communication with compute: `OverlapPolicy` and `CommStreams`.

On GPU the engine issues its all-gathers and reduce-scatters from two side streams, so that they
run while the compute stream runs the GEMMs of neighbouring units. Streams only order work; the
memory each stream touches is managed by `FsdpContext`, which allocates and frees every buffer
on one stream and orders the others against it with events (no `record_stream`). The engine
waits with `event.wait(stream)`: `stream.wait_event(event)` only forwards to it, at the cost of
one more Python call, several times per unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverlapPolicy:
    """The communication schedule of a root and its units (set on the root's `fully_shard`).

    Attributes:
        prefetch: all-gather the next unit (in the order of the previous forward, or of this
            forward for backward) while the current one computes. Megatron's
            `overlap_param_gather`.
        overlap_grad_reduce: reduce-scatter gradients on their own stream while earlier
            layers' backward runs; False reduces on the compute stream.
        max_unsharded_units: how many units other than the root may hold compute weights at
            once (ZeRO-3). A unit's weights are freed only when gathering another would exceed
            this (delayed release), and a prefetch that would exceed it is skipped: 2 holds the
            computing unit and the next; 1 never prefetches. Only units in use at once (nested
            in each other) can exceed it.
        use_symm_mem: the compute weights live in NCCL symmetric memory, where NCCL gathers
            them with its symmetric kernels (`symmetric_memory.py`).
        keep_unsharded_params: under gradient accumulation (`microbatch(is_last=False)`,
            `no_sync()`), a unit whose weights are sharded (ZeRO-3) keeps its compute weights
            from their first gather in the step until the last microbatch's backward has used
            them: one all-gather per unit and step instead of two per microbatch, for the memory
            of every unit's compute weights at once (`accumulation_memory()`). Kept units do not
            count against `max_unsharded_units`. Changes nothing outside gradient accumulation
            (every backward is then the last).
        accumulate_unsharded_grads: under gradient accumulation, groups that shard their
            gradients (ZeRO-2/3) sum them whole, in the main-grads dtype, and reduce-scatter the
            sum once, in the last microbatch's backward: one reduce-scatter per unit and step
            instead of one per microbatch, for the memory of every unit's whole gradients from
            the first microbatch's backward to the last's (`accumulation_memory()`). Changes
            nothing outside gradient accumulation, nor for ZeRO-0/1, which accumulate whole
            gradients anyway.
    """

    prefetch: bool = True
    overlap_grad_reduce: bool = True
    max_unsharded_units: int = 2
    use_symm_mem: bool = False
    keep_unsharded_params: bool = False
    accumulate_unsharded_grads: bool = False

    def __post_init__(self) -> None:
        if self.max_unsharded_units < 1:
            raise ValueError(
                f"OverlapPolicy.max_unsharded_units must be >= 1, got {self.max_unsharded_units}."
            )


class CommStreams:
    """The all-gather and reduce-scatter streams of one root on a CUDA device.

    High priority, as in FSDP2: a collective whose inputs are ready should not queue behind
    compute kernels, since the next unit waits for it.
    """

    def __init__(self, device: torch.device):
        self.device_index = (
            device.index if device.index is not None else torch.cuda.current_device()
        )
        self.all_gather = torch.cuda.Stream(device, priority=-1)
        self.reduce_scatter = torch.cuda.Stream(device, priority=-1)
        self._known: dict[int, torch.cuda.Stream] = {}
        self._order_event = torch.cuda.Event()

    def current(self) -> torch.cuda.Stream:
        """The stream the caller computes on (not necessarily the default one).

        Runs several times per unit: the raw lookup plus a cache of `Stream` objects by id
        costs a tenth of `torch.cuda.current_stream()`, which resolves the device and builds a
        new object each time.
        """
        stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(self.device_index)
        stream = self._known.get(stream_id)
        if stream is None:
            stream = torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
            self._known[stream_id] = stream
        return stream

    def wait(self, waiter: torch.cuda.Stream, producer: torch.cuda.Stream) -> None:
        """Makes `waiter` wait for the work queued on `producer` so far.

        `Stream.wait_stream` without its new event per call: a queued wait is not affected by
        later records of its event, so one event serves every call (the engine orders its
        streams a few times per unit).
        """
        self._order_event.record(producer)
        self._order_event.wait(waiter)

    def running_on(self, stream: torch.cuda.Stream) -> _RunningOn:
        """A context manager that makes `stream` current for its body and yields the stream it
        replaced.

        `torch.cuda.stream()` does the same with checks that cost several times more host
        time; the engine switches streams a few times per unit. `set_stream` also makes the
        stream's device current, so a caller on another device gets its own back.
        """
        return _RunningOn(self, stream)


class _RunningOn:
    """`CommStreams.running_on`'s context manager (a class: a generator costs more to enter).

    It calls what `torch.cuda.current_device()` and `torch.cuda.set_stream()` call, without
    their Python wrappers (lazy initialisation, done once the streams exist; argument
    forwarding), which cost as much host time again at a few switches per unit.
    """

    __slots__ = ("_streams", "_stream", "_previous", "_device")

    def __init__(self, streams: CommStreams, stream: torch.cuda.Stream):
        self._streams = streams
        self._stream = stream

    def __enter__(self) -> torch.cuda.Stream:
        self._device = torch._C._cuda_getDevice()
        self._previous = self._streams.current()
        _set_stream(self._stream)
        return self._previous

    def __exit__(self, *exc_info: object) -> None:
        _set_stream(self._previous)
        if self._device != self._streams.device_index:
            torch.cuda.set_device(self._device)


def _set_stream(stream: torch.cuda.Stream) -> None:
    torch._C._cuda_setStream(
        stream_id=stream.stream_id,
        device_index=stream.device_index,
        device_type=stream.device_type,
    )
