"""What the schedule tests share: a tiny mock-data command line for `pretrain` on 2 ranks,
`validated()`, and parameter groups for a scheduler alone."""

from __future__ import annotations

import functools

from tests.unit_tests.training import flag_checks

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --lr 1e-2 --mock-data --vocab-size 64 --distributed-backend gloo"
).split()
TINY = [*BASE, *"--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0".split()]
"""A tiny fp32 mock-data run for `pretrain` (2 ranks); each test adds its batch and length."""


validated = functools.partial(flag_checks.validated, base=tuple(BASE))
"""`BASE` plus the flags, parsed and validated (`flag_checks.validated`)."""


class ParamGroups:
    """Something with `param_groups`, for a scheduler alone."""

    def __init__(self, *groups: dict):
        self.param_groups = [dict(group) for group in groups]
