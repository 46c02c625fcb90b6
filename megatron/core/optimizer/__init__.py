"""Optimizer construction, gradient clipping and the optimizer config.

    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-4, clip_grad=1.0), model)
    update_successful, grad_norm, num_zeros = optimizer.step()

Learning-rate and weight-decay schedules: `megatron.core.optimizer_param_scheduler`.
"""

from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer.construction import get_megatron_optimizer, get_param_groups
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig

__all__ = [
    "MegatronOptimizer",
    "OptimizerConfig",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
    "get_param_groups",
]
