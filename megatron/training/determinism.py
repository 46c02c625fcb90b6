"""`--deterministic-mode`: bitwise-reproducible training, as upstream Megatron-LM sets it up.

`check_deterministic_mode` refuses what would break reproducibility (a fused cross-entropy, or a
launcher's environment variable set to a non-deterministic value), and `apply_deterministic_mode`
sets upstream's environment defaults (`NCCL_ALGO=Ring`, `NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`,
`CUBLAS_WORKSPACE_CONFIG=:4096:8`; a value the launcher set and that passed the check is kept)
and calls `torch.use_deterministic_algorithms(True)`, before the process group, NCCL and cuBLAS
read them. `restore_nondeterministic_mode` undoes both, for the next job of the same process.
"""

from __future__ import annotations

import argparse
import os

import torch

ENV_DEFAULTS: dict[str, str] = {
    "NCCL_ALGO": "Ring",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
"""Upstream's environment for bit-exact runs (`megatron/training/determinism.py`)."""

ACCEPTED_NCCL_ALGOS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
"""`NCCL_ALGO` tokens upstream vouches for under `--deterministic-mode` (not Tree: its reduction
order can change between runs)."""

ACCEPTED_ENV_VALUES: dict[str, frozenset[str]] = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
    "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"}),
}
"""The deterministic values of the other variables (cuBLAS documents the two workspaces)."""

_applied: dict[str, object] | None = None
"""What `apply_deterministic_mode` changed (the variables it set, torch's previous setting)."""


def check_deterministic_mode(args: argparse.Namespace) -> None:
    """Refuses, under `--deterministic-mode`, a flag or environment variable that would make the
    run non-deterministic.

    Raises:
        ValueError: naming each such flag or variable and the fix.
    """
    if not args.deterministic_mode:
        return
    problems = []
    if args.cross_entropy_loss_fusion:
        problems.append("--cross-entropy-loss-fusion (drop it)")
    algo = os.environ.get("NCCL_ALGO")
    if algo is not None:
        tokens = [token.strip() for token in algo.split(",") if token.strip()]
        if not tokens or not set(tokens) <= ACCEPTED_NCCL_ALGOS:
            problems.append(
                f"NCCL_ALGO={algo} (use tokens of {', '.join(sorted(ACCEPTED_NCCL_ALGOS))}, or "
                "unset it for Ring)"
            )
    for name, accepted in ACCEPTED_ENV_VALUES.items():
        value = os.environ.get(name)
        if value is not None and value not in accepted:
            problems.append(f"{name}={value} (use {' or '.join(sorted(accepted))}, or unset it)")
    if problems:
        raise ValueError(
            f"--deterministic-mode cannot make this run reproducible with {'; '.join(problems)}."
        )


def apply_deterministic_mode() -> None:
    """Sets the environment defaults and torch's deterministic algorithms (module docstring);
    call before the process group exists."""
    global _applied
    if _applied is not None:
        return
    set_here = [name for name in ENV_DEFAULTS if name not in os.environ]
    for name in set_here:
        os.environ[name] = ENV_DEFAULTS[name]
    _applied = {"env": set_here, "torch": torch.are_deterministic_algorithms_enabled()}
    torch.use_deterministic_algorithms(True)


def restore_nondeterministic_mode() -> None:
    """Undoes `apply_deterministic_mode` (nothing if it was not called)."""
    global _applied
    if _applied is None:
        return
    for name in _applied["env"]:
        os.environ.pop(name, None)
    torch.use_deterministic_algorithms(bool(_applied["torch"]))
    _applied = None
