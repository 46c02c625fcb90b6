"""Opt-in profiler labels for Megatron-FSDP: one range per unit and phase.

With labels on (`set_profiler_labels`), the engine's work for each unit runs inside a
`torch.profiler.record_function` range, and on GPU an NVTX range, named
``"MFSDP <unit> <phase>"`` (for example ``"MFSDP decoder.layers.3 forward all-gather"``), so a
trace reads without the source. Off by default: a range costs host time per unit.
"""

from __future__ import annotations

import contextlib

import torch

_NO_LABEL = contextlib.nullcontext()


class PhaseLabels:
    """Opens the range of one unit's phase, or nothing while labels are off.

    Attributes:
        enabled: whether ranges are opened.
    """

    def __init__(self, device: torch.device):
        self.enabled = False
        self._nvtx = device.type == "cuda"

    def __call__(self, unit: object, phase: str) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return _NO_LABEL
        return _Label(f"MFSDP {unit.name} {phase}", self._nvtx)


class _Label:
    __slots__ = ("_name", "_nvtx", "_range")

    def __init__(self, name: str, nvtx: bool):
        self._name = name
        self._nvtx = nvtx

    def __enter__(self) -> None:
        self._range = torch.profiler.record_function(self._name)
        self._range.__enter__()
        if self._nvtx:
            torch.cuda.nvtx.range_push(self._name)

    def __exit__(self, *exc_info: object) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._range.__exit__(*exc_info)
