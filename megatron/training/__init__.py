"""Training utilities: arguments, initialisation, the pretrain loop, checkpointing.

from megatron.training import get_args, pretrain, print_rank_0
"""

from megatron.training.global_vars import get_args
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0

__all__ = ["get_args", "pretrain", "print_rank_0"]
