"""`OptimizerConfig`: which optimizer to build and its hyperparameters (Megatron-LM field names).

The learning rate and weight decay given here are the starting values; an
`OptimizerParamScheduler` overwrites both in every parameter group as training proceeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.value_ranges import (
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    Range,
    check_ranges,
    ranged,
)

OPTIMIZERS = ("adam", "sgd")


@dataclass
class OptimizerConfig:
    """Optimizer hyperparameters.

    Attributes:
        optimizer: "adam" (Adam / AdamW) or "sgd" (with momentum).
        lr: initial learning rate (required to build an optimizer).
        min_lr: the floor the scheduler decays the learning rate to (None: 0).
        decoupled_lr: the word embeddings' and output layer's own peak learning rate (their
            parameter group's `max_lr`); None: `lr`.
        decoupled_min_lr: their own floor (the group's `min_lr`); None: `min_lr`.
        weight_decay: decay coefficient of weights; biases and other 1-D parameters (norm
            weights) get none.
        apply_wd_to_qk_layernorm: the query and key norms' weights decay too (Qwen3-Next's
            rule; Megatron-LM's `--apply-wd-to-qk-layernorm`).
        adam_beta1: Adam's first-moment coefficient.
        adam_beta2: Adam's second-moment coefficient.
        adam_eps: Adam's denominator term.
        decoupled_weight_decay: AdamW's decoupled decay (True) or Adam's L2 penalty (False).
        sgd_momentum: SGD's momentum.
        clip_grad: clip gradients to this global L2 norm; 0 turns clipping off.
        log_num_zeros_in_grad: count zero gradient elements at each step (one extra
            all-reduce per group).
        fp16: the model computes in fp16: the optimizer scales the loss (dynamically unless
            `loss_scale`) and skips steps whose gradients overflow.
        bf16: the model computes in bf16 (no loss scaling unless `loss_scale`).
        loss_scale: a constant loss scale (`ConstantGradScaler`); None: dynamic with fp16,
            none otherwise.
        initial_loss_scale: the first scale of dynamic loss scaling.
        min_loss_scale: dynamic loss scaling never goes below it.
        loss_scale_window: steps without overflow before the dynamic scale doubles.
        hysteresis: overflows tolerated before the dynamic scale first halves.
    """

    optimizer: str = "adam"
    lr: float | None = ranged(None, NON_NEGATIVE)
    min_lr: float | None = ranged(None, NON_NEGATIVE)
    decoupled_lr: float | None = ranged(None, NON_NEGATIVE)
    decoupled_min_lr: float | None = ranged(None, NON_NEGATIVE)
    weight_decay: float = ranged(0.01, NON_NEGATIVE)
    apply_wd_to_qk_layernorm: bool = False
    adam_beta1: float = ranged(0.9, PROBABILITY)
    adam_beta2: float = ranged(0.999, PROBABILITY)
    adam_eps: float = ranged(1e-8, NON_NEGATIVE)
    decoupled_weight_decay: bool = True
    sgd_momentum: float = ranged(0.9, NON_NEGATIVE)
    clip_grad: float = ranged(1.0, NON_NEGATIVE)
    log_num_zeros_in_grad: bool = False
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = ranged(None, POSITIVE)
    initial_loss_scale: float = ranged(2.0**32, POSITIVE)
    min_loss_scale: float = ranged(1.0, POSITIVE)
    loss_scale_window: float = ranged(1000, Range(1))
    hysteresis: int = 2

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"OptimizerConfig.optimizer={self.optimizer!r} is not supported; choose one of "
                f"{', '.join(OPTIMIZERS)}."
            )
        check_ranges(self, "OptimizerConfig.")
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig.fp16 and bf16 are both True; set one of them.")
        if self.lr is not None and self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(
                f"OptimizerConfig.min_lr={self.min_lr} exceeds lr={self.lr}; the schedule "
                "decays from lr down to min_lr, so set min_lr <= lr."
            )
