"""Loss scaling for fp16 training: Megatron-LM's `ConstantGradScaler` and `DynamicGradScaler`.

fp16 has a narrow exponent range: gradients of a few 1e-8 underflow to zero. The training loop
therefore multiplies the loss by the scaler's `scale` before backward (`MegatronOptimizer.
scale_loss`), so the fp16 gradients are `scale` times too large, and the optimizer divides its
fp32 main gradients by it before the step (`unscale_and_check_for_inf`). A scale that is too
large makes some gradient overflow to inf; the optimizer then skips the step and `update()`
lowers the scale (`DynamicGradScaler`), or keeps it (`ConstantGradScaler`, `--loss-scale`).

The dynamic rule is Megatron-LM's, including its hysteresis: every overflow resets the growth
count and spends one unit of hysteresis; once the hysteresis is spent, that overflow and every
later one multiplies the scale by `backoff_factor` (never below `min_scale`); only a growth
(`growth_interval` overflow-free steps in a row) restores the hysteresis, and multiplies the
scale by `growth_factor`. Steps without overflow do not restore it.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.optimizer.optimizer_config import OptimizerConfig


class MegatronGradScaler(abc.ABC):
    """The loss scale of fp16 training and how it changes after each step.

    Args:
        initial_scale: the first loss scale; > 0.

    Raises:
        ValueError: `initial_scale` is not > 0.
    """

    def __init__(self, initial_scale: float):
        if not initial_scale > 0.0:
            raise ValueError(
                f"The initial loss scale is {initial_scale}; it must be > 0 (--loss-scale / "
                "--initial-loss-scale)."
            )
        # A Python float: the skip decision reads found_inf on the host anyway, and powers of
        # two (all the rule produces from power-of-two settings) are exact in fp32 and fp64.
        self._scale = float(initial_scale)

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """The factor the gradients are multiplied by before the step."""
        return 1.0 / self._scale

    @abc.abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjusts the scale after a step whose gradients overflowed (`found_inf`) or not."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The scaler's state, as CPU tensors (checkpoints store tensors)."""

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restores what `state_dict()` returned."""


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (`--loss-scale`): an overflowed step is skipped, the scale kept."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        # Megatron-LM saves nothing: the scale comes from --loss-scale on every start.
        return {}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """A loss scale lowered after overflows and raised after a run of steps without any.

    Args:
        initial_scale: the first scale (`--initial-loss-scale`).
        min_scale: the scale never falls below it (`--min-loss-scale`); in (0, initial_scale].
        growth_factor: multiplies the scale after `growth_interval` steps in a row without
            overflow; > 1 (Megatron-LM: 2).
        backoff_factor: multiplies the scale after an overflow once the hysteresis is spent;
            in (0, 1) (Megatron-LM: 0.5).
        growth_interval: overflow-free steps before a growth (`--loss-scale-window`); >= 1.
        hysteresis: overflows tolerated before the first backoff (`--hysteresis`); >= 1.

    Raises:
        ValueError: a value is out of its range.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ):
        super().__init__(initial_scale)
        checks = (
            (0.0 < min_scale <= initial_scale, "min_scale", min_scale, "in (0, initial_scale]"),
            (growth_factor > 1.0, "growth_factor", growth_factor, "> 1"),
            (0.0 < backoff_factor < 1.0, "backoff_factor", backoff_factor, "in (0, 1)"),
            (growth_interval >= 1, "growth_interval", growth_interval, ">= 1"),
            (hysteresis >= 1, "hysteresis", hysteresis, ">= 1"),
        )
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(
                    f"DynamicGradScaler {name}={value} must be {allowed} (initial_scale="
                    f"{initial_scale}; flags --min-loss-scale, --loss-scale-window, "
                    "--hysteresis)."
                )
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Megatron-LM's keys: `scale`, `growth_tracker`, `hysteresis_tracker`."""
        return {
            "scale": torch.tensor(self._scale, dtype=torch.float64),
            "growth_tracker": torch.tensor(self._growth_tracker, dtype=torch.int64),
            "hysteresis_tracker": torch.tensor(self._hysteresis_tracker, dtype=torch.int64),
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def unscale_and_check_for_inf(
    grads: list[torch.Tensor], inv_scale: float, device: torch.device
) -> bool:
    """Multiplies `grads` in place by `inv_scale` and says whether any rank's hold an inf/nan.

    The flag is all-reduced (MAX) over the default process group: every rank of a run takes
    part in every step, so this covers the data-parallel and model-parallel groups at once,
    and under Megatron-FSDP, where each rank holds only its shard of each gradient, an overflow
    in one rank's shard skips the step on all of them.

    Args:
        grads: the main gradients (fp32; DTensors are unscaled through their local shards).
        inv_scale: 1 / the loss scale.
        device: where the flag lives (the gradients' device; NCCL reduces CUDA tensors only).

    Returns:
        Whether some gradient on some rank is not finite.
    """
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in local:
        if grad.numel():
            by_device.setdefault(grad.device, []).append(grad)
    for grad_device, tensors in by_device.items():
        flag = torch.zeros(1, dtype=torch.float32, device=grad_device)
        scale = torch.full((1,), inv_scale, dtype=torch.float32, device=grad_device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, scale)
        found_inf = torch.maximum(found_inf, flag.to(device))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return bool(found_inf.item() > 0)


def get_grad_scaler(config: OptimizerConfig) -> MegatronGradScaler | None:
    """Megatron-LM's choice: a constant scaler with `loss_scale` (fp16 or bf16), a dynamic one
    (growth x2, backoff x0.5) for fp16 without it, none otherwise."""
    if config.loss_scale and (config.fp16 or config.bf16):
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None
