"""A spy on the Megatron-FSDP engine's collectives, weight refreshes and FP8 weight casts and
transposes, shared by the tests.

Tests that count or order what the engine launches observe it through `spy_on_engine()`, so the
engine's private names are patched in this one place.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any
from unittest import mock

from megatron.core.distributed.fsdp import collectives, fp8_gather
from megatron.core.distributed.fsdp.residency import Residency
from megatron.core.distributed.fsdp.weights import GroupWeights
from megatron.core.fp8.weights import Fp8Weight


@dataclasses.dataclass
class EngineCalls:
    """What the engine launched while the spy was on.

    Attributes:
        log: "gather", "reduce_scatter", "order" (a gather ordered after the compute stream's
            queued writes), "refresh" (compute weights rebuilt from the main weights),
            "amax_reduce" (FP8 weights' amaxes all-reduced), "amax_record" (a refresh taking
            the amax of an FP8 weight's part itself), "fp8_cast" (a group's FP8 compute
            weights cast from its main weights), "fp8_transpose" (an FP8 weight's
            transposed copy made for the input-gradient GEMM) and "fp8_transpose_all" (a
            group's transposes made in one call of the C++ extension), in call order.
        gather_groups: the process group of each all-gather.
        gather_bytes: the bytes each all-gather writes on this rank (all ranks' blocks).
        gather_dtypes: the dtype of each all-gather's outputs.
        scatter_groups: the process group of each reduce-scatter.
        refreshes: per parameter group's `GroupWeights` (by id), how often it was refreshed.
        fp8_transposes: the bytes of each FP8 weight transpose made, weakly (dead once freed).
        fp8_refresh_order: ("cast", id) where a group's FP8 compute weights are cast and
            ("refresh", id) where a group with FP8 compute weights is refreshed, in call order,
            by the id of its `Fp8ComputeWeights`.
    """

    log: list[str] = dataclasses.field(default_factory=list)
    gather_groups: list[Any] = dataclasses.field(default_factory=list)
    gather_bytes: list[int] = dataclasses.field(default_factory=list)
    gather_dtypes: list[Any] = dataclasses.field(default_factory=list)
    scatter_groups: list[Any] = dataclasses.field(default_factory=list)
    refreshes: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    fp8_transposes: list[weakref.ref] = dataclasses.field(default_factory=list)
    fp8_refresh_order: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    def count(self, event: str) -> int:
        """How many times `event` (a `log` entry) happened."""
        return self.log.count(event)


@contextlib.contextmanager
def spy_on_engine() -> Iterator[EngineCalls]:
    """Records the engine's all-gathers, reduce-scatters, gather orderings and refreshes while
    the context is open; each still runs as it would."""
    calls = EngineCalls()
    gather, scatter = collectives._all_gather_coalesced, collectives._reduce_scatter_coalesced
    order, refresh = Residency.order_gathers, GroupWeights.refresh
    amax_reduce = collectives.Collectives.all_reduce_max
    amax_record = fp8_gather.record_amax
    take_casts = fp8_gather.Fp8ComputeWeights.take_casts
    transpose, transpose_all = Fp8Weight._transpose, Fp8Weight.transpose_all

    def spied_gather(*args, **kwargs):
        calls.log.append("gather")
        calls.gather_groups.append(kwargs["group"])
        calls.gather_bytes.append(sum(out.numel() * out.element_size() for out in args[0]))
        calls.gather_dtypes.append(args[0][0].dtype)
        return gather(*args, **kwargs)

    def spied_scatter(*args, **kwargs):
        calls.log.append("reduce_scatter")
        calls.scatter_groups.append(kwargs["group"])
        return scatter(*args, **kwargs)

    def spied_order(residency: Residency) -> None:
        calls.log.append("order")
        return order(residency)

    def spied_refresh(weights: GroupWeights) -> None:
        calls.log.append("refresh")
        calls.refreshes[id(weights)] += 1
        if weights.fp8 is not None:
            calls.fp8_refresh_order.append(("refresh", id(weights.fp8)))
        return refresh(weights)

    def spied_amax_reduce(comm, *args, **kwargs) -> None:
        calls.log.append("amax_reduce")
        return amax_reduce(comm, *args, **kwargs)

    def spied_amax_record(*args, **kwargs) -> None:
        calls.log.append("amax_record")
        return amax_record(*args, **kwargs)

    def spied_take_casts(weights: fp8_gather.Fp8ComputeWeights, *args, **kwargs):
        calls.log.append("fp8_cast")
        calls.fp8_refresh_order.append(("cast", id(weights)))
        return take_casts(weights, *args, **kwargs)

    def record_transpose(made) -> None:
        calls.log.append("fp8_transpose")
        calls.fp8_transposes.append(weakref.ref(made.data))

    def spied_transpose(weight: Fp8Weight):
        made = transpose(weight)
        record_transpose(made)
        return made

    def spied_transpose_all(weights: list[Fp8Weight]) -> None:
        pending = [weight for weight in weights if weight._transposed is None]
        one_by_one = len(calls.fp8_transposes)
        transpose_all(weights)
        if pending and len(calls.fp8_transposes) == one_by_one:  # in one call of the extension
            calls.log.append("fp8_transpose_all")
            for weight in pending:
                record_transpose(weight._transposed)

    with (
        mock.patch.object(collectives.Collectives, "all_reduce_max", spied_amax_reduce),
        mock.patch.object(collectives, "_all_gather_coalesced", spied_gather),
        mock.patch.object(collectives, "_reduce_scatter_coalesced", spied_scatter),
        mock.patch.object(Residency, "order_gathers", spied_order),
        mock.patch.object(GroupWeights, "refresh", spied_refresh),
        mock.patch.object(Fp8Weight, "_transpose", spied_transpose),
        mock.patch.object(Fp8Weight, "transpose_all", staticmethod(spied_transpose_all)),
        mock.patch.object(fp8_gather, "record_amax", spied_amax_record),
        mock.patch.object(fp8_gather.Fp8ComputeWeights, "take_casts", spied_take_casts),
    ):
        yield calls
