"""`UnitsRunCheck`: every rank ran the same units in a forward, or every rank raises.

Collectives pair up by order. A unit that runs on some ranks but not on others (data-dependent
skipping) would pair one unit's all-gathers and reduce-scatters with another's, which is wrong
silently where the sizes match and hangs where they do not. At the end of each root forward the
ranks compare which units ran, in one small all-reduce over the shard group (and one over the
replicas under hybrid sharding); a difference makes every rank raise an error that names the
units. On CPU the result is read at once. On GPU it is copied to pinned memory behind the
all-reduce and read at the next root forward: by then the device has long passed that point,
so the host does not stall, and the collectives that would hang are only queued. Reading waits
at most `TIMEOUT_S`, for a device already stuck in mismatched collectives.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

TIMEOUT_S = 300.0
"""How long reading the result waits for the device before giving up with an error."""

_MODULUS = (1 << 61) - 1


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
        values = [len(positions), fingerprint]
        results = []
        for group in self._groups:
            # MAX of (x, -x) is (max, -min): one all-reduce tells whether all ranks agree.
            local = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64)
            tensor = local.to(self._device, non_blocking=True)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            results.append(tensor)
        if self._device.type != "cuda":
            self._pending = (results, positions, None)
            self.resolve()
            return
        host = [torch.empty(4, dtype=torch.int64, pin_memory=True) for _ in results]
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
                    raise RuntimeError(
                        f"Megatron-FSDP: the ranks' forwards did not complete within {TIMEOUT_S}s: "
                        "the ranks issued different collectives, as when a unit runs on some "
                        "ranks only. Run every unit on every rank."
                    )
                time.sleep(1e-4)
        for group, result in zip(self._groups, results):
            maxima, minima = result[:2].tolist(), [-v for v in result[2:].tolist()]
            if maxima != minima:
                self._raise_naming_units(group, positions)

    def _raise_naming_units(self, group: dist.ProcessGroup, positions: list[int]) -> None:
        """Gathers which units each rank ran and raises naming those that differ (the error
        path only: every rank saw the same mismatch, so every rank takes part)."""
        ran = torch.zeros(len(self._names), dtype=torch.int64, device=self._device)
        ran[torch.tensor(sorted(set(positions)), dtype=torch.long, device=self._device)] = 1
        gathered = [torch.empty_like(ran) for _ in range(group.size())]
        dist.all_gather(gathered, ran, group=group)
        table = torch.stack(gathered).cpu()
        ranks = dist.get_process_group_ranks(group)
        lines = []
        for position, name in enumerate(self._names):
            column = table[:, position].tolist()
            if min(column) != max(column):
                on = [rank for rank, flag in zip(ranks, column) if flag]
                off = [rank for rank, flag in zip(ranks, column) if not flag]
                lines.append(f"{name} ran on rank(s) {on} but not on {off}")
        detail = "; ".join(lines) or "the units ran in different orders on different ranks"
        raise RuntimeError(
            f"Megatron-FSDP: the ranks ran different units in one forward: {detail}. Every "
            "rank must run every unit in the same order (its all-gathers and reduce-scatters "
            "pair up across ranks): instead of skipping a unit on some ranks, run it and "
            "multiply its contribution by zero."
        )
