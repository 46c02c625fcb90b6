"""`UnitsRunCheck`: every rank ran the same units in a forward, or every rank raises.

Collectives pair up by order. A unit that runs on some ranks but not on others (data-dependent
skipping) would pair one unit's all-gathers and reduce-scatters with another's, which is wrong
silently where the sizes match and hangs where they do not. At the end of each root forward the
ranks compare which units ran, in one small all-reduce over the shard group (and one over the
replicas under hybrid sharding) that also carries, per unit, the first rank that ran it and the
first that did not; a difference makes every rank raise an error that names the units and
ranks, with no further collective (the communicator may be stuck behind mismatched ones).

On CPU the result is read at once. On GPU it is copied to pinned memory behind the all-reduce
and read at the next root forward or when the gradients are finalised, whichever comes first, so
the optimizer never steps on gradients from mismatched reductions: by then the device has
usually passed the forward's end (the host has queued the backward since), so the host rarely
stalls. Reading waits at most `TIMEOUT_S`, for a device already stuck in mismatched
collectives, and then names the units this rank ran.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

TIMEOUT_S = 300.0
"""How long reading the result waits for the device before giving up with an error."""

_MODULUS = (1 << 61) - 1
_NONE = 1 << 62
"""Stands for "no rank" in the per-unit minima."""


class UnitsRunCheck:
    """Compares, across ranks, the units each root forward ran.

    Args:
        groups: the process groups to compare over.
        device: where the collectives' tensors live.
        names: each unit's name, by position.
    """

    def __init__(self, groups: list[dist.ProcessGroup], device: torch.device, names: list[str]):
        self._groups = [group for group in groups if group.size() > 1]
        self._device = device
        self._names = names
        self._pending: tuple[list[torch.Tensor], list[int], torch.cuda.Event | None] | None = None

    def after_forward(self, positions: list[int]) -> None:
        """Issues the comparison of the units of the forward that just ended (positions in
        the order their forwards started)."""
        if not self._groups:
            return
        if self._device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # a CUDA graph replays the captured collectives, the same on every rank
        fingerprint = len(positions)
        for position in positions:
            fingerprint = (fingerprint * 1_000_003 + position + 1) % _MODULUS
        ran = set(positions)
        results = []
        for group in self._groups:
            rank = group.rank()
            first_ran = [rank if p in ran else _NONE for p in range(len(self._names))]
            first_not = [_NONE if p in ran else rank for p in range(len(self._names))]
            # MAX of (x, -x) is (max, -min): one all-reduce gives both over the ranks.
            values = [len(positions), fingerprint]
            minima = [*(-v for v in values), *(-r for r in first_ran), *(-r for r in first_not)]
            local = torch.tensor([*values, *minima], dtype=torch.int64)
            if self._device.type == "cuda":
                # A copy from pageable memory would wait for the stream to reach it.
                local = local.pin_memory()
            tensor = local.to(self._device, non_blocking=True)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            results.append(tensor)
        if self._device.type != "cuda":
            self._pending = (results, positions, None)
            self.resolve()
            return
        host = [torch.empty_like(tensor, device="cpu", pin_memory=True) for tensor in results]
        for out, tensor in zip(host, results):
            out.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, positions, event)

    def resolve(self) -> None:
        """Reads the last comparison, if not read yet.

        Raises:
            RuntimeError: the ranks ran different units (named), or the device did not reach
                the comparison within `TIMEOUT_S`.
        """
        if self._pending is None:
            return
        if self._device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # read after the capture: querying an event is not allowed inside one
        results, positions, event = self._pending
        self._pending = None
        if event is not None:
            deadline = time.monotonic() + TIMEOUT_S
            while not event.query():
                if time.monotonic() > deadline:
                    ran = ", ".join(self._names[position] for position in positions)
                    raise RuntimeError(
                        f"Megatron-FSDP: the ranks' forwards did not complete within {TIMEOUT_S}s: "
                        "the ranks issued different collectives, as when a unit runs on some "
                        f"ranks only (this rank ran: {ran}). Run every unit on every rank."
                    )
                time.sleep(1e-4)
        for group, result in zip(self._groups, results):
            values = result.tolist()
            if values[:2] != [-v for v in values[2:4]]:
                self._raise_naming_units(group, values[4:])

    def _raise_naming_units(self, group: dist.ProcessGroup, minima: list[int]) -> None:
        """Raises naming each unit some ranks ran and others did not, with the first rank of
        each side (every rank received the same table, so every rank raises the same error)."""
        ranks = dist.get_process_group_ranks(group)
        count = len(self._names)
        lines = []
        for position, name in enumerate(self._names):
            first_ran, first_not = -minima[position], -minima[count + position]
            if first_ran != _NONE and first_not != _NONE:
                lines.append(
                    f"{name} ran on rank {ranks[first_ran]} but not on rank {ranks[first_not]}"
                )
        detail = "; ".join(lines) or "the units ran in different orders on different ranks"
        raise RuntimeError(
            f"Megatron-FSDP: the ranks ran different units in one forward: {detail}. Every "
            "rank must run every unit in the same order (its all-gathers and reduce-scatters "
            "pair up across ranks): instead of skipping a unit on some ranks, run it and "
            "multiply its contribution by zero."
        )
