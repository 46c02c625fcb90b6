"""`OptimizerConfig`: which optimizer to build and its hyperparameters (Megatron-LM field names).

The learning rate and weight decay given here are the starting values; an
`OptimizerParamScheduler` overwrites both in every parameter group as training proceeds.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    lr: float | None = None
    min_lr: float | None = None
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"OptimizerConfig.optimizer={self.optimizer!r} is not supported; choose one of "
                f"{', '.join(OPTIMIZERS)}."
            )
        non_negative = {
            "lr": self.lr,
            "min_lr": self.min_lr,
            "decoupled_lr": self.decoupled_lr,
            "decoupled_min_lr": self.decoupled_min_lr,
            "weight_decay": self.weight_decay,
            "sgd_momentum": self.sgd_momentum,
            "clip_grad": self.clip_grad,
        }
        for name, value in non_negative.items():
            if value is not None and value < 0:
                raise ValueError(f"OptimizerConfig.{name}={value} must be >= 0.")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"OptimizerConfig.{name}={value} must be in [0, 1).")
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig.fp16 and bf16 are both True; set one of them.")
        if self.adam_eps <= 0:
            raise ValueError(f"OptimizerConfig.adam_eps={self.adam_eps} must be > 0.")
        if self.lr is not None and self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(
                f"OptimizerConfig.min_lr={self.min_lr} exceeds lr={self.lr}; the schedule "
                "decays from lr down to min_lr, so set min_lr <= lr."
            )
