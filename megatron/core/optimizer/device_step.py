"""What an optimizer step needs to run with no host synchronisation, so that a CUDA graph can
capture it (`MegatronOptimizer.step_on_device`): learning rates read from device tensors, and a
step that torch's fused kernels skip on the device when the gradient norm is not finite.

`MegatronOptimizer.step()` decides on the host: it reads the global gradient norm, and skips the
update when it is inf or nan. Its device twin keeps the norm on the device and hands the torch
optimizer a `found_inf` flag (1.0: skip), the protocol of torch's `GradScaler` for optimizers
whose fused kernels honour it (`_step_supports_amp_scaling`: Adam, AdamW and SGD built with
`fused=True`). Their kernels then leave the weights, Adam's moments and SGD's momentum untouched,
and Adam takes back the step count it added, so a skipped step changes nothing, as on the host.
An eager loop takes the same step to read its outcome later
(`MegatronOptimizer.step_without_host_sync`): Adam's fused kernels need no `capturable=True` for
it, and the learning rates stay the host numbers the groups hold.

A captured step replays the numbers it was captured with, so anything that changes between
steps must live in device memory: each parameter group's learning rate is a 0-dim fp32 tensor
(`DeviceLearningRates`), written from the group's `"lr"` (which the scheduler sets on the host)
before every step, outside the graph. The fused kernels read the rate as fp32: a rate that fp32
cannot represent exactly differs from the host step's float64 one by at most half an fp32 ulp
(a relative 6e-8). Weight decay and Adam's betas are captured as numbers: they must stay
constant.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron.core.fusions.fused_adam import GradScale, StepAmaxes, step_and_copy
from megatron.core.host_copy import HostCopy
from megatron.core.optimizer.clip_grads import (
    clip_scale_on_device,
    count_zeros_on_device,
    grad_norm_on_device,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.utils import cuda_graph_capturing


@dataclasses.dataclass
class DeviceStepResult:
    """What `MegatronOptimizer.step_on_device` measured, as device tensors.

    Attributes:
        grad_norm: the global gradient norm before clipping, 0-dim float64 (equal to what
            `step()` returns).
        found_inf: 0-dim fp32, 1.0 where the norm was not finite and the step was skipped.
        num_zeros: the number of zero gradient elements, 0-dim int64 (None unless
            `log_num_zeros_in_grad`).
    """

    grad_norm: torch.Tensor
    found_inf: torch.Tensor
    num_zeros: torch.Tensor | None
    _host: HostCopy | None = dataclasses.field(default=None, init=False, repr=False)

    def copy_to_host(self) -> None:
        """Queues the values' copy to the host (`read` then waits for it alone): a step
        queues it before its update, so reading the outcome need not wait for the update."""
        self._host = HostCopy(self.packed())

    def read(self) -> tuple[bool, float, int | None]:
        """`(update_successful, grad_norm, num_zeros_in_grad)` on the host, as
        `MegatronOptimizer.step()` returns them (from `copy_to_host`'s copy where one was
        queued; else read now)."""
        host = self.packed() if self._host is None else self._host
        return self.unpack(host.tolist())

    def packed(self) -> torch.Tensor:
        """The values in one float64 tensor, to copy to the host at once (`unpack` reads it):
        [norm, found_inf] and the zero count where there is one (exact below 2**53)."""
        parts = [self.grad_norm.view(1), self.found_inf.double().view(1)]
        if self.num_zeros is not None:
            parts.append(self.num_zeros.double().view(1))
        return torch.cat(parts)

    @staticmethod
    def unpack(values: Sequence[float]) -> tuple[bool, float, int | None]:
        """`(update_successful, grad_norm, num_zeros_in_grad)`, as `MegatronOptimizer.step()`
        returns them, from `packed()`'s values read to the host."""
        grad_norm, found_inf, *num_zeros = values
        return found_inf == 0.0, grad_norm, int(num_zeros[0]) if num_zeros else None


class DeviceLearningRates:
    """Each parameter group's learning rate as a 0-dim fp32 tensor on `device`, which torch's
    fused kernels read when they run (so a replayed step takes the current rate).

    Args:
        optimizer: the torch optimizer whose groups' `"lr"` (host numbers) are mirrored.
        device: where the parameters live.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self._optimizer = optimizer
        self._rates = [
            torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups
        ]

    def write(self) -> None:
        """Copies every group's `"lr"` into its tensor (queued on the current stream)."""
        for rate, group in zip(self._rates, self._optimizer.param_groups):
            rate.fill_(group["lr"])

    @contextlib.contextmanager
    def in_groups(self) -> Iterator[None]:
        """The tensors stand in for the groups' `"lr"` for the body (a step); the numbers the
        scheduler set are back afterwards, for everything else that reads them."""
        groups = self._optimizer.param_groups
        rates = [group["lr"] for group in groups]
        try:
            for group, rate in zip(groups, self._rates):
                group["lr"] = rate
            yield
        finally:
            for group, rate in zip(groups, rates):
                group["lr"] = rate


def device_skip_problem(optimizer: torch.optim.Optimizer, capture: bool) -> str | None:
    """Why `optimizer` cannot skip its step on the device.

    Args:
        optimizer: the torch optimizer.
        capture: the step is also to run under a CUDA graph capture, which torch refuses for
            Adam built with `capturable=False`.

    Returns:
        The reason, as an error message; None where it can.
    """
    name = type(optimizer).__name__
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return (
            f"A step on the device needs an optimizer that skips a step on the device; "
            f"{name} does not. Build torch's Adam, AdamW or SGD with fused=True "
            "(get_megatron_optimizer(config, model, capturable=True) does)."
        )
    for group in optimizer.param_groups:
        if capture and "capturable" in group and not group["capturable"]:
            return (
                f"{name} was built with capturable=False: a CUDA graph cannot capture its step; "
                "build it with capturable=True."
            )
        if group.get("momentum", 0.0) and group.get("dampening", 0.0):
            return (
                f"{name} has dampening {group['dampening']}: its first step on the device would "
                "differ from torch's (see zero_momentum_buffers); use dampening 0."
            )
    return None


def makes_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s steps keep state: Adam's moments, SGD's momentum buffers (none
    where every group's momentum is 0)."""
    return any(group.get("momentum") != 0 for group in optimizer.param_groups)


def check_skips_on_device(optimizer: torch.optim.Optimizer, capture: bool) -> None:
    """Raises unless `optimizer` can skip its step on the device (`device_skip_problem`).

    Raises:
        ValueError: not a torch optimizer whose fused kernels honour `found_inf` (Adam, AdamW,
            SGD with `fused=True`), Adam without `capturable=True` for a `capture`, or SGD with
            dampening.
    """
    problem = device_skip_problem(optimizer, capture)
    if problem is not None:
        raise ValueError(problem)


def zero_momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """Gives SGD with momentum zero momentum buffers where it has none yet.

    Fused SGD treats a step without buffers as its first, copying the gradient into buffers it
    allocates: captured, every replay would be a first step, and a first step skipped on the
    device would leave those buffers uninitialised. From zero buffers every step is the
    steady-state update `buf = momentum * buf + grad`, whose first step is torch's (`buf =
    grad`) exactly, dampening being 0 (`check_skips_on_device`).
    """
    for group in optimizer.param_groups:
        if group.get("momentum", 0.0):
            for param in group["params"]:
                state = optimizer.state[param]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(param)


def check_state_exists(optimizer: torch.optim.Optimizer) -> None:
    """Raises while a CUDA graph is being captured if a parameter with a gradient has no
    optimizer state yet: its creation (zero moments) would be captured and repeated by every
    replay.

    Raises:
        RuntimeError: capturing a step before the first one ran.
    """
    if not cuda_graph_capturing():
        return
    for group in optimizer.param_groups:
        if group.get("momentum") == 0:  # SGD without momentum keeps no state
            continue
        for param in group["params"]:
            if param.grad is not None and not optimizer.state.get(param):
                raise RuntimeError(
                    "The optimizer step is being captured in a CUDA graph before any step ran: "
                    "the optimizer creates its state in its first step, which a graph cannot "
                    "capture. Run at least one step eagerly first (--cuda-graph-warmup-steps "
                    ">= 1)."
                )


def step_skipping_on_device(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    amaxes: Sequence[StepAmaxes | None] = (),
    grad_scale: GradScale | None = None,
) -> None:
    """`step_and_copy(optimizer, copies, amaxes, grad_scale)`, the step skipped by its kernels
    where `found_inf` (0-dim fp32) is 1 (the model then keeps the weights it has).

    torch's optimizers read `found_inf` from the attribute of that name, which its
    `GradScaler` sets around `step()` the same way.
    """
    optimizer.found_inf = found_inf
    try:
        step_and_copy(optimizer, copies, amaxes, grad_scale)
    finally:
        del optimizer.found_inf


def device_step(
    optimizer: torch.optim.Optimizer,
    grads: list[torch.Tensor],
    config: OptimizerConfig,
    device: torch.device,
    learning_rates: DeviceLearningRates | None,
    copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    amaxes: Sequence[StepAmaxes | None] = (),
    counted: Sequence[torch.Tensor] | None = None,
    pp_group: dist.ProcessGroup | None = None,
    copy_to_host: bool = False,
) -> DeviceStepResult:
    """`MegatronOptimizer.step()`'s norm, skip, clip, step and copy into the model's weights,
    all on the device.

    Args:
        optimizer: the torch optimizer (`check_skips_on_device` passed: it skips on the device).
        grads: the main gradients it steps with, as `MegatronOptimizer.get_main_grads()`.
        config: read for `clip_grad` and `log_num_zeros_in_grad`.
        device: where the results live.
        learning_rates: the rates the step reads (written before the step); None: the numbers
            the groups hold (a step that no CUDA graph replays).
        copies: (model weight, fp32 main weight) pairs written after the step
            (`step_and_copy`).
        amaxes: absolute maxima the step records of the weights it leaves (`step_and_copy`).
        counted: the gradients the norm and the zero count sum, each parameter once over the
            pipeline stages (None: `grads`).
        pp_group: the pipeline group, whose stages hold the other parameters (None: one stage).
        copy_to_host: queue the result's copy to the host before the update
            (`DeviceStepResult.copy_to_host`; not in a step a CUDA graph captures).
    """
    counted = grads if counted is None else counted
    grad_norm = grad_norm_on_device(counted, device, pp_group)
    num_zeros = None
    if config.log_num_zeros_in_grad:
        num_zeros = count_zeros_on_device(counted, device, pp_group)
    found_inf = torch.isfinite(grad_norm).logical_not().float()
    result = DeviceStepResult(grad_norm, found_inf, num_zeros)
    if copy_to_host:
        result.copy_to_host()
    clip = None
    if config.clip_grad > 0.0:
        # A non-finite norm makes the coefficient nan; the kernels skip the step.
        clip = clip_scale_on_device(grads, config.clip_grad, grad_norm)
    check_state_exists(optimizer)
    zero_momentum_buffers(optimizer)
    rates = contextlib.nullcontext() if learning_rates is None else learning_rates.in_groups()
    with rates:
        step_skipping_on_device(optimizer, found_inf, copies, amaxes, clip)
    return result
