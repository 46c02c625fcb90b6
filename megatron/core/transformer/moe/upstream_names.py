"""Megatron-core's per-expert state-dict names, read into this project's stacked experts.

Megatron-core (0.19) names each local expert's projections on their own:

- `SequentialMLP` (its local spec): `<layer>.experts.local_experts.<i>.linear_fc1.weight` (and
  `.bias`, `linear_fc2.*`), each linear with an `_extra_state` entry that is None without
  Transformer Engine;
- `TEGroupedMLP` (Transformer Engine's grouped GEMM): `<layer>.experts.linear_fc1.weight<i>`
  (and `bias<i>`).

Here each projection is one tensor stacked over the experts, `<layer>.experts.linear_fc1.weight`
[num_experts, out, in] (`experts.py`, the same per-expert `[out, in]` layout): what this
project's checkpoints save, as DTensors over the expert-parallel ranks, so that they load at any
expert-parallel size. `stack_upstream_experts` rewrites a state dict's per-expert entries into
the stacked ones, so an upstream state dict loads: `MoELayer` applies it to what
`load_state_dict` gives it, Megatron-FSDP's `load_state_dict` and `tools/convert_checkpoint.py
from-torch` to a whole model's. `drop_empty_extra_states` drops the None `_extra_state` entries
of Megatron-core's other local linears (the shared experts'), which hold nothing.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from typing import Any

import torch

_PER_EXPERT_FORMS = {
    "SequentialMLP": re.compile(
        r"(?P<experts>(?:.*\.)?experts\.)local_experts\.(?P<index>\d+)\."
        r"(?P<name>linear_fc[12]\.(?:weight|bias))"
    ),
    "TEGroupedMLP": re.compile(
        r"(?P<experts>(?:.*\.)?experts\.)(?P<name>linear_fc[12]\.(?:weight|bias))(?P<index>\d+)"
    ),
}
"""Each upstream experts class's per-expert names: the experts' prefix, the stacked tensor's name
below it, and the (local) expert index."""

_SEQUENTIAL_EXTRA_STATE = re.compile(
    r"(?:.*\.)?experts\.local_experts\.\d+\.linear_fc[12]\._extra_state"
)
"""`SequentialMLP`'s linears' extra states (None without Transformer Engine)."""
EXTRA_STATE_SUFFIX = "_extra_state"


def stack_upstream_experts(
    state_dict: MutableMapping[str, Any],
    prefix: str = "",
    *,
    local_experts: range | None = None,
    num_experts: int | None = None,
) -> None:
    """Replaces, in place, the per-expert entries under `prefix` with stacked tensors.

    Each layer's `linear_fc1.weight0 ... weight<n-1>` (or `local_experts.<i>.linear_fc1.weight`)
    become `linear_fc1.weight` [n, out, in], and so on for fc2 and the biases; the None
    `_extra_state` entries of `SequentialMLP`'s linears are dropped. Entries in this project's
    names are left as they are.

    Args:
        state_dict: the state dict (a model's, or what `load_state_dict` passes a module).
        prefix: only entries whose names start with it are rewritten.
        local_experts: the global indices of the experts the stacked tensors hold (an
            `MoELayer`'s on its expert-parallel rank): the state dict may name just these (as
            upstream's `state_dict()` on that rank does: local indices 0, 1, ...) or all
            `num_experts` (a state dict made at expert-parallel size 1), of which these are
            taken. None: all the experts the state dict names are stacked.
        num_experts: the number of experts of the layer (all ranks'); needed with
            `local_experts`.

    Raises:
        ValueError: a layer's per-expert entries skip an index, differ in shape, number other
            experts than `local_experts` or `num_experts`, mix the two upstream forms, or come
            with the stacked name too.
    """
    groups: dict[tuple[str, str], dict[int, str]] = {}
    forms: dict[str, set[str]] = {}
    for key in state_dict:
        if not key.startswith(prefix):
            continue
        for form, pattern in _PER_EXPERT_FORMS.items():
            match = pattern.fullmatch(key)
            if match:
                experts = match["experts"]
                groups.setdefault((experts, match["name"]), {})[int(match["index"])] = key
                forms.setdefault(experts, set()).add(form)
                break
    for experts, found in forms.items():
        if len(found) > 1:
            raise ValueError(
                f"state dict entries under {experts!r} name experts in both Megatron-core "
                f"forms ({' and '.join(sorted(found))}); pass the state dict of one model."
            )
    for (experts, name), keys in groups.items():
        stacked = experts + name
        if stacked in state_dict:
            raise ValueError(
                f"the state dict holds {stacked!r} and the same experts under Megatron-core's "
                f"per-expert names (e.g. {keys[min(keys)]!r}); pass one of the two."
            )
        indices = _selected(sorted(keys), stacked, local_experts, num_experts)
        tensors = [state_dict[keys[index]] for index in indices]
        shapes = {tuple(tensor.shape) for tensor in tensors}
        if len(shapes) > 1:
            raise ValueError(
                f"the experts of {stacked!r} differ in shape ({sorted(shapes)}) in the state "
                "dict; each expert's projection must have one shape."
            )
        for key in keys.values():
            del state_dict[key]
        state_dict[stacked] = torch.stack(tensors)
    for key in [key for key in state_dict if key.startswith(prefix)]:
        if state_dict[key] is None and _SEQUENTIAL_EXTRA_STATE.fullmatch(key):
            del state_dict[key]


def _selected(
    indices: list[int], stacked: str, local_experts: range | None, num_experts: int | None
) -> list[int]:
    """The indices (among the state dict's `indices` for `stacked`) of the experts to stack."""
    if indices != list(range(len(indices))):
        missing = sorted(set(range(indices[-1] + 1)) - set(indices))
        raise ValueError(
            f"the state dict names experts {indices} of {stacked!r} (per expert): experts "
            f"{missing} are missing. Pass the whole state dict of the layer's experts."
        )
    if local_experts is None or len(indices) == len(local_experts):
        return indices
    if len(indices) == num_experts:
        return list(local_experts)
    raise ValueError(
        f"the state dict names {len(indices)} experts of {stacked!r}; this layer holds "
        f"{len(local_experts)} of its {num_experts} (experts {local_experts.start} to "
        f"{local_experts.stop - 1}). Pass this rank's experts (upstream's state_dict() at the "
        "same expert-parallel size) or all of them."
    )


def drop_empty_extra_states(
    state_dict: MutableMapping[str, Any], prefix: str, module: torch.nn.Module
) -> None:
    """Drops, in place, the `_extra_state` entries under `prefix` that are None and that no
    submodule of `module` (whose state-dict prefix is `prefix`) reads: Megatron-core's local
    linears save None there (Transformer Engine's FP8 state, absent), which holds nothing."""
    suffix = "." + EXTRA_STATE_SUFFIX
    for key in [key for key in state_dict if key.startswith(prefix) and key.endswith(suffix)]:
        if state_dict[key] is not None:
            continue
        path = key[len(prefix) : -len(suffix)]
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            owner = None
        if owner is None or type(owner).set_extra_state is torch.nn.Module.set_extra_state:
            del state_dict[key]
