"""`step_and_copy` (`megatron.core.fusions.fused_adam`) against torch's fused Adam / AdamW step
followed by `copy_`: the fused kernel's weights and moments equal torch's up to fp32 rounding (a
unit or two in the last place, far below the 1e-2 learning rate's updates that a wrong formula
would change), its step counts exactly, and its model weights are its main weights rounded; every
case that falls back to torch is torch's bit for bit."""

import contextlib
import functools
import math
from unittest import mock

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron.core.fp8.quantize import record_amax
from megatron.core.fusions import fused_adam
from megatron.core.fusions.fused_adam import GradScale, step_and_copy

# Sizes over several programs (40000 > one program's 2048 elements), below one vector (3), and
# not a multiple of the vector width (1001).
SHAPES = [(40000,), (3,), (7, 143), (64, 32)]


def _problem(device, model_dtype, seed=0):
    """fp32 main weights in two groups, their model copies, and a gradient per step."""
    gen = torch.Generator().manual_seed(seed)
    mains = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(device) for s in SHAPES] for _ in range(4)]
    models = [m.to(model_dtype) for m in mains]
    return mains, grads, models


def _optimizer(kind, mains, lr, weight_decay, **kwargs):
    groups = [
        {"params": mains[:2], "weight_decay": weight_decay},
        {"params": mains[2:], "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6},
    ]
    return kind(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True, **kwargs)


def _run(kind, lr, weight_decay, model_dtype, fused, device="cuda", capturable=False):
    """Four steps; each step's weights, moments, counts and model copies."""
    mains, grads, models = _problem(device, model_dtype)
    mains = [m.requires_grad_() for m in mains]
    rate = lr.to(device) if isinstance(lr, torch.Tensor) else lr
    optimizer = _optimizer(kind, mains, rate, weight_decay, capturable=capturable)
    copies = list(zip(models, mains))
    history = []
    with torch.no_grad():
        for step_grads in grads:
            for main, grad in zip(mains, step_grads):
                main.grad = grad.clone()
            if fused:
                step_and_copy(optimizer, copies)
            else:
                optimizer.step()
                torch._foreach_copy_(models, [m.detach() for m in mains])
            history.append(_snapshot(optimizer, mains, models))
    return history, optimizer


def _snapshot(optimizer, mains, models):
    out = []
    for main, model in zip(mains, models):
        state = optimizer.state[main]
        out += [main.detach().clone(), model.clone()]
        out += [state[k].clone() for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def _assert_equal_histories(got, expected):
    for step, (a, b) in enumerate(zip(got, expected)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == y.dtype and torch.equal(x, y), (step, i, (x - y).abs().max())


def _assert_close_histories(got, expected):
    """Weights and moments within fp32 rounding, step counts equal, model weights the rounded
    main weights (and so within their own rounding of torch's)."""
    for step, (a, b) in enumerate(zip(got, expected)):
        for i in range(0, len(a), 5):
            main, model, exp_avg, exp_avg_sq, count = a[i : i + 5]
            torch.testing.assert_close(main, b[i], msg=f"step {step} main {i}")
            assert torch.equal(model, main.to(model.dtype)), (step, i)
            torch.testing.assert_close(model, b[i + 1], msg=f"step {step} model {i}")
            torch.testing.assert_close(exp_avg, b[i + 2], msg=f"step {step} exp_avg {i}")
            torch.testing.assert_close(exp_avg_sq, b[i + 3], msg=f"step {step} exp_avg_sq {i}")
            assert torch.equal(count, b[i + 4]), (step, i)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("lr_on_device", [False, True])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_fused_kernel_equals_torch(kind, weight_decay, lr_on_device, model_dtype):
    lr = torch.tensor(1e-2) if lr_on_device else 1e-2
    got, optimizer = _run(kind, lr, weight_decay, model_dtype, fused=True, capturable=True)
    expected, _ = _run(kind, lr, weight_decay, model_dtype, fused=False, capturable=True)
    _assert_close_histories(got, expected)
    # Steps 2-4 took the kernel (the first creates the moments in torch's step).
    assert len(fused_adam._tables[optimizer]) == 2


@pytest.mark.gpu
def test_found_inf_skips_the_step_and_counts():
    mains, grads, models = _problem("cuda", torch.bfloat16)
    optimizer = _optimizer(torch.optim.AdamW, mains, 1e-3, 0.1, capturable=True)
    copies = list(zip(models, mains))
    with torch.no_grad():
        for skip in (0.0, 0.0, 1.0, 0.0):
            for main, grad in zip(mains, grads[0]):
                main.grad = grad.clone()
            before = _snapshot(optimizer, mains, models) if optimizer.state else None
            optimizer.found_inf = torch.tensor(skip, device="cuda")
            step_and_copy(optimizer, copies)
            del optimizer.found_inf
            after = _snapshot(optimizer, mains, models)
            if skip:
                _assert_equal_histories([after], [before])
    assert optimizer.state[mains[0]]["step"].item() == 3
    assert len(fused_adam._tables[optimizer]) == 2


@pytest.mark.gpu
def test_step_hooks_run_once_around_the_kernel():
    """A global pre-hook that sets the gradients (as the DDP engine's hands out `.grad`) runs
    before the kernel reads them and the optimizer's post-hook after it, once each per step;
    the result is torch's step with the same hooks."""
    results = []
    for fused in (True, False):
        mains, grads, models = _problem("cuda", torch.bfloat16)
        optimizer = _optimizer(torch.optim.AdamW, mains, 1e-2, 0.1)
        calls = []

        def set_grads(opt, args, kwargs, mains=mains, grads=grads, calls=calls):
            calls.append("pre")
            for main, grad in zip(mains, grads[len(calls) % 4]):
                main.grad = grad.clone()

        handles = [
            register_optimizer_step_pre_hook(set_grads),
            optimizer.register_step_post_hook(lambda *unused, calls=calls: calls.append("post")),
        ]
        try:
            with torch.no_grad():
                for _ in range(3):
                    if fused:
                        step_and_copy(optimizer, list(zip(models, mains)))
                    else:
                        optimizer.step()
                        torch._foreach_copy_(models, mains)
        finally:
            for handle in handles:
                handle.remove()
        assert calls == ["pre", "post"] * 3
        results.append(_snapshot(optimizer, mains, models))
        if fused:
            assert len(fused_adam._tables[optimizer]) == 2
    _assert_close_histories([results[0]], [results[1]])


@pytest.mark.gpu
def test_unaligned_and_gradless_weights_take_torch_step():
    """A main weight that starts off a 16-byte boundary makes the step torch's; a weight
    without a gradient is copied all the same."""
    buffer = torch.randn(1 + 1000, device="cuda")
    odd = buffer[1:].view(10, 100)  # 4 bytes past an aligned start
    mains = [odd, torch.randn(64, device="cuda"), torch.randn(8, device="cuda")]
    results = []
    for fused in (True, False):
        params = [m.clone() if i else buffer.clone()[1:].view(10, 100) for i, m in enumerate(mains)]
        models = [p.to(torch.bfloat16) for p in params]
        optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
        with torch.no_grad():
            for _ in range(3):
                for p in params[:2]:
                    p.grad = torch.ones_like(p)
                params[2].add_(1.0)  # no gradient: only the copy changes the model
                if fused:
                    step_and_copy(optimizer, list(zip(models, params)))
                else:
                    optimizer.step()
                    torch._foreach_copy_(models, params)
        results.append([t.clone() for t in params + models])
        if fused:
            assert optimizer not in fused_adam._tables or not fused_adam._tables[optimizer]
    _assert_equal_histories([results[0]], [results[1]])


@pytest.mark.gpu
def test_captured_step_replays_with_new_learning_rates():
    """The kernel captured in a CUDA graph reads the learning rate from its device tensor and
    the step counts it advances: replays equal eager torch steps with those rates."""
    mains, grads, models = _problem("cuda", torch.bfloat16)
    reference = [m.clone() for m in mains]
    ref_models = [m.clone() for m in models]
    lr = torch.tensor(1e-3, device="cuda")
    optimizer = _optimizer(torch.optim.AdamW, mains, lr, 0.1, capturable=True)
    ref_optimizer = _optimizer(
        torch.optim.AdamW, reference, torch.tensor(1e-3, device="cuda"), 0.1, capturable=True
    )
    copies = list(zip(models, mains))
    with torch.no_grad():
        for params in (mains, reference):
            for main, grad in zip(params, grads[0]):
                main.grad = grad.clone()
        step_and_copy(optimizer, copies)  # the first, eager step creates the state
        ref_optimizer.step()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step_and_copy(optimizer, copies)  # warm-up on a side stream, as capture wants
        torch.cuda.current_stream().wait_stream(stream)
        ref_optimizer.step()
        with torch.cuda.graph(graph):
            step_and_copy(optimizer, copies)
        for rate in (2e-3, 5e-4, 1e-3):
            lr.fill_(rate)
            ref_optimizer.param_groups[0]["lr"].fill_(rate)
            ref_optimizer.param_groups[1]["lr"].fill_(rate)
            graph.replay()
            ref_optimizer.step()
            torch._foreach_copy_(ref_models, reference)
    torch.cuda.synchronize()
    for got, expected in zip(mains + models, reference + ref_models):
        torch.testing.assert_close(got, expected)
    for main, model in zip(mains, models):
        assert torch.equal(model, main.to(model.dtype))
    assert optimizer.state[mains[0]]["step"].item() == 5


@pytest.mark.gpu
def test_capture_after_the_gradient_buffer_moved():
    """Gradients that are views of one buffer, allocated anew between steps (as Megatron-FSDP's
    are): eager steps and the capture take the kernel, each with an address table of its
    addresses and the program map made once. The capture's table is filled by its replays only,
    so an eager step after it with the gradients where the capture saw them fills one of its
    own; that step's new Python-float learning rate goes into new memory, and the replays keep
    the rate they were captured with (as torch's captured kernels keep theirs). The steps and
    replays equal eager torch steps with those rates."""
    mains, grads, models = _problem("cuda", torch.bfloat16)
    reference = [m.clone() for m in mains]
    ref_models = [m.clone() for m in models]
    optimizer = _optimizer(torch.optim.AdamW, mains, 1e-2, 0.1)
    ref_optimizer = _optimizer(torch.optim.AdamW, reference, 1e-2, 0.1)
    copies = list(zip(models, mains))
    numels = [m.numel() for m in mains]
    sizes = [-(-n // 4) * 4 for n in numels]  # each view on a 16-byte boundary
    buffers = []  # all kept alive: every buffer at another address

    def attach():
        buffers.append(torch.empty(sum(sizes), device="cuda"))
        for main, chunk, numel in zip(mains, buffers[-1].split(sizes), numels):
            main.grad = chunk[:numel].view_as(main)

    def step_both(step_grads, step, lr=1e-2):
        for main, ref, grad in zip(mains, reference, step_grads):
            main.grad.copy_(grad)
            ref.grad = grad.clone()
        step()
        for group in ref_optimizer.param_groups:
            group["lr"] = lr
        ref_optimizer.step()
        torch._foreach_copy_(ref_models, reference)

    with torch.no_grad():
        made = []
        for step_grads in grads[:3]:  # torch's first step, then the kernel's
            attach()
            step_both(step_grads, lambda: step_and_copy(optimizer, copies))
            made.append(fused_adam._tables[optimizer].get(0))
        assert made[0] is None and made[1] is not made[2]
        assert made[2].programs is made[1].programs
        tables = made[2]
        attach()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step_and_copy(optimizer, copies)
        recaptured = fused_adam._tables[optimizer][0]
        assert recaptured is not tables and recaptured.programs is tables.programs
        assert any(captured is recaptured for captured in fused_adam._captured)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        step_both(grads[3], lambda: step_and_copy(optimizer, copies), lr=1e-3)
        for step_grads in grads[:2]:
            step_both(step_grads, graph.replay)
    torch.cuda.synchronize()
    for got, expected in zip(mains + models, reference + ref_models):
        torch.testing.assert_close(got, expected)
    assert optimizer.state[mains[0]]["step"].item() == 6


@pytest.mark.gpu
def test_duplicate_and_resized_weights_never_reach_the_kernel():
    """A weight listed twice in a group (which torch allows, with a warning) would race with
    itself in the kernel; a gradient resized through `.data` no longer has the size its row in
    the address table says. Steps with either are torch's (which may refuse the second)."""
    mains, grads, _ = _problem("cuda", torch.bfloat16)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="duplicate parameters"):
            optimizer = torch.optim.AdamW([mains[0], *mains], lr=1e-2, fused=True)
        with mock.patch.object(fused_adam._Launch, "run") as run:
            for step_grads in grads[:3]:
                for main, grad in zip(mains, step_grads):
                    main.grad = grad.clone()
                step_and_copy(optimizer)
        assert run.call_count == 0
        params = [m.clone() for m in mains]
        optimizer = _optimizer(torch.optim.AdamW, params, 1e-2, 0.1)
        with mock.patch.object(fused_adam._Launch, "run", autospec=True) as run:
            for step_grads in grads[:2]:  # torch's first step, then the kernel's
                for param, grad in zip(params, step_grads):
                    param.grad = grad.clone()
                step_and_copy(optimizer)
            assert run.call_count == 2
            params[0].grad.data = torch.zeros(3, device="cuda")
            with contextlib.suppress(RuntimeError):
                step_and_copy(optimizer)
        assert run.call_count == 2


def _checked_and_launched(steps: int, prepare) -> tuple[list[int], list[int]]:
    """Runs `steps` steps of SHAPES' weights through `step_and_copy` and through torch's step
    and copy, `prepare(step, params, values, optimizer)` setting each step's gradients (random
    `values`); asserts that both end equal (weights, model weights, moments, counts) and
    returns the fused run's full checks (`_fusable` calls) and kernel launches per step."""
    torch.manual_seed(0)
    mains = [torch.randn(shape, device="cuda") for shape in SHAPES]
    grads = [[torch.randn_like(m) for m in mains] for _ in range(steps)]
    runs, counts = [], []
    for fused in (True, False):
        params = [m.clone() for m in mains]
        models = [m.to(torch.bfloat16) for m in mains]
        optimizer = _optimizer(torch.optim.AdamW, params, 1e-2, 0.1)
        checked, launched = [], []
        with torch.no_grad():
            for step, values in enumerate(grads):
                prepare(step, params, values, optimizer)
                with (
                    mock.patch.object(fused_adam, "_fusable", wraps=fused_adam._fusable) as full,
                    mock.patch.object(
                        fused_adam._Launch, "run", autospec=True, side_effect=fused_adam._Launch.run
                    ) as run,
                ):
                    if fused:
                        step_and_copy(optimizer, list(zip(models, params)))
                    else:
                        optimizer.step()
                        torch._foreach_copy_(models, params)
                checked.append(full.call_count)
                launched.append(run.call_count)
        states = [optimizer.state[p][k] for p in params for k in ("exp_avg", "step")]
        runs.append([t.clone() for t in params + models + states])
        counts.append((checked, launched))
    for got, expected in zip(*runs):
        torch.testing.assert_close(got, expected)
    return counts[0]


@pytest.mark.gpu
def test_a_weight_is_checked_once_and_its_moving_gradients_every_step():
    """Gradients in a buffer allocated anew each step (as Megatron-FSDP's are): after the first
    fused step only the gradients are checked, which still catches a step whose gradients
    start off a 16-byte boundary (torch's step takes it); every step equals torch's."""
    sizes = [-(-math.prod(shape) // 4) * 4 for shape in SHAPES]  # views on 16-byte boundaries

    def prepare(step, params, values, optimizer):
        offset = 1 if step == 3 else 0  # 4 bytes past an aligned start
        buffer = torch.empty(sum(sizes) + offset, device="cuda")[offset:]
        for param, chunk, value in zip(params, buffer.split(sizes), values):
            param.grad = chunk[: param.numel()].view_as(param).copy_(value)

    checked, launched = _checked_and_launched(5, prepare)
    # Step 1 creates the moments (torch's step); step 2 checks each weight in full; step 4's
    # unaligned gradients send it to torch's step.
    assert checked == [0, 4, 0, 0, 0]
    assert launched == [0, 2, 2, 0, 2]


@pytest.mark.gpu
def test_a_moved_moment_is_checked_again_and_a_gradless_weight_copied():
    """A moment replaced between fused steps by one at another address (as a state-dict load
    replaces them) is checked again, alone, and stepped where it now is; a weight without a
    gradient in a step the kernel takes is copied into its model weight all the same. Every
    step equals torch's step followed by the copies."""

    def prepare(step, params, values, optimizer):
        for param, value in zip(params, values):
            param.grad = value.clone()
        if step == 2:
            state = optimizer.state[params[2]]
            state["exp_avg"] = state["exp_avg"].clone()
        if step == 3:
            params[1].grad = None
            params[1].add_(1.0)  # only the copy carries this into the model

    checked, launched = _checked_and_launched(4, prepare)
    assert checked == [0, 4, 1, 0]
    assert launched == [0, 2, 2, 2]


def _step_dtensors(steps: int) -> list[bool]:
    """On one rank: `steps` fused-AdamW steps over DTensor weights through `step_and_copy`
    and through torch; whether each weight and moment of the two is equal."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cuda", (1,))
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(distribute_tensor(torch.randn(s, device="cuda"), mesh, [Shard(0)]))
            for s in SHAPES
        ]
        optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
        with torch.no_grad():
            for _ in range(steps):
                for param in params:
                    param.grad = torch.ones_like(param)
                if fused:
                    step_and_copy(optimizer)
                else:
                    optimizer.step()
        states = [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        runs.append([t.to_local().clone() for t in params + states])
        if fused:
            assert optimizer not in fused_adam._tables or not fused_adam._tables[optimizer]
    return [torch.equal(a, b) for a, b in zip(*runs)]


@pytest.mark.gpu
def test_dtensor_weights_take_torch_step():
    """DTensors have no storage of their own (their address reads 0): the kernel must not be
    handed them; torch's fused step takes them, bit for bit."""
    from tests.unit_tests.distributed_harness import run_distributed

    (equal,) = run_distributed(_step_dtensors, 1, 3)
    assert equal and all(equal)


@pytest.mark.parametrize("planned", [False, True])
def test_cpu_is_torch_step_then_copy(planned):
    """`planned`: as where Triton imports but no GPU is visible (a CUDA build of torch on a
    CPU-only host, where CUDA queries raise): the planning refuses CPU weights without them."""
    with contextlib.ExitStack() as stack:
        if planned:
            triton = fused_adam.triton or mock.sentinel.triton
            stack.enter_context(mock.patch.object(fused_adam, "triton", triton))
            for query in ("is_available", "is_initialized"):  # no GPU: CUDA never initialises
                stack.enter_context(mock.patch.object(torch.cuda, query, return_value=False))
            for query in ("is_current_stream_capturing", "current_device"):
                error = RuntimeError("CUDA error: no CUDA-capable device is detected")
                stack.enter_context(mock.patch.object(torch.cuda, query, side_effect=error))
        got, _ = _run(torch.optim.AdamW, 1e-3, 0.1, torch.bfloat16, fused=True, device="cpu")
    expected, _ = _run(torch.optim.AdamW, 1e-3, 0.1, torch.bfloat16, fused=False, device="cpu")
    _assert_equal_histories(got, expected)


def _scaling(grads: list, factor, calls: list[int], step: int):
    """Multiplies `grads` by `factor` in place, noting `step` in `calls`."""

    def scale() -> None:
        calls.append(step)
        torch._foreach_mul_(grads, factor)

    return scale


def _scaled_steps(
    kind: type, device: str, factor_kind: str, fold: bool
) -> tuple[list, list, list, object]:
    """Four steps (with weight decay) whose gradients are multiplied by a clipping coefficient
    (below one, not exact in binary): handed to the step as a `GradScale` (`fold`), or
    multiplied in place before an unscaled step. Returns each step's snapshot, the gradients
    after the last step, the steps whose gradients were scaled in place, and the optimizer."""
    mains, grads, models = _problem(device, torch.bfloat16)
    optimizer = _optimizer(kind, mains, 1e-2, 0.1)
    copies = list(zip(models, mains))
    history, in_place = [], []
    with torch.no_grad():
        for step, step_grads in enumerate(grads):
            for main, grad in zip(mains, step_grads):
                main.grad = grad.clone()
            coeff = 0.3 + 0.1 * step
            factor = {
                "host": coeff,
                "device": torch.tensor(coeff, device=device),
                "device-fp64": torch.tensor(coeff, dtype=torch.float64, device=device),
            }[factor_kind]

            scale = _scaling([main.grad for main in mains], factor, in_place, step)
            if fold:
                step_and_copy(optimizer, copies, grad_scale=GradScale(factor, scale))
            else:
                scale()
                step_and_copy(optimizer, copies)
            history.append(_snapshot(optimizer, mains, models))
    return history, [main.grad.clone() for main in mains], in_place, optimizer


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("factor_kind", ["host", "device", "device-fp64"])
def test_grad_scale_multiplies_the_gradients_in_the_kernel(kind, factor_kind):
    """A clipping coefficient handed to the step updates bitwise as gradients multiplied by it
    in place first (the product rounded to fp32 once either way). The kernel reads it (a host
    number or an fp32 device scalar) and leaves the gradients unscaled; the first step (torch's,
    which makes the moments) and a factor the kernel cannot read (fp64) scale them in place,
    and the kernel steps with them. Adam's L2 decay adds to the scaled gradient, AdamW's
    decays the weight."""
    got, grads_after, in_place, optimizer = _scaled_steps(kind, "cuda", factor_kind, fold=True)
    expected, _, _, _ = _scaled_steps(kind, "cuda", factor_kind, fold=False)
    _assert_equal_histories(got, expected)
    assert len(fused_adam._tables[optimizer]) == 2  # steps 2-4 took the kernel
    if factor_kind == "device-fp64":
        assert in_place == [0, 1, 2, 3]
    else:
        assert in_place == [0]
        last_grads = _problem("cuda", torch.bfloat16)[1][-1]
        _assert_equal_histories([grads_after], [last_grads])


@pytest.mark.gpu
def test_a_skipped_step_leaves_its_scaled_gradients_unread():
    """`found_inf` 1 with a device factor that is nan (the coefficient of a nan norm): the
    kernel skips the step before it reads the factor; weights, moments and gradients stay."""
    mains, grads, models = _problem("cuda", torch.bfloat16)
    optimizer = _optimizer(torch.optim.AdamW, mains, 1e-3, 0.1, capturable=True)
    copies = list(zip(models, mains))
    in_place = []
    with torch.no_grad():
        for step, skip in enumerate((0.0, 0.0, 1.0)):
            for main, grad in zip(mains, grads[step]):
                main.grad = grad.clone()
            before = _snapshot(optimizer, mains, models) if optimizer.state else None
            factor = torch.tensor(float("nan") if skip else 0.5, device="cuda")
            scale = _scaling([main.grad for main in mains], factor, in_place, step)
            optimizer.found_inf = torch.tensor(skip, device="cuda")
            step_and_copy(optimizer, copies, grad_scale=GradScale(factor, scale))
            del optimizer.found_inf
        _assert_equal_histories([_snapshot(optimizer, mains, models)], [before])
    assert in_place == [0]
    _assert_equal_histories([[main.grad for main in mains]], [grads[2]])
    assert len(fused_adam._tables[optimizer]) == 2


def test_cpu_scales_the_gradients_in_place():
    got, grads_after, in_place, _ = _scaled_steps(torch.optim.AdamW, "cpu", "host", fold=True)
    expected, expected_grads, _, _ = _scaled_steps(torch.optim.AdamW, "cpu", "host", fold=False)
    _assert_equal_histories(got, expected)
    _assert_equal_histories([grads_after], [expected_grads])
    assert in_place == [0, 1, 2, 3]


def _step_recording_amaxes(device: str, skips: tuple[float, ...]) -> list[tuple]:
    """Steps (each skipped on the device where its entry is 1) recording the amax of every
    main weight (one with a NaN, one without a gradient) and of a part of one (a view the
    kernel does not step whole); per step, the slots and the weights' maxima the step left,
    NaNs skipped, in plain torch."""
    mains, grads, models = _problem(device, torch.bfloat16)
    with torch.no_grad():
        mains[3][5, 7] = float("nan")
    gradless = torch.randn(5, 16, device=device)
    optimizer = _optimizer(torch.optim.AdamW, [*mains, gradless], 1e-2, 0.1, capturable=True)
    targets = [*mains, gradless, mains[2][1:4]]
    results = []
    with torch.no_grad():
        for skip in skips:
            for main, grad in zip(mains, grads[0]):
                main.grad = grad.clone()
            slots = [torch.zeros((), device=device) for _ in targets]
            said: list[int] = []
            request = fused_adam.StepAmaxes(
                list(zip(slots, targets)), functools.partial(said.append, 1)
            )
            optimizer.found_inf = torch.tensor(skip, device=device)
            step_and_copy(optimizer, list(zip(models, mains)), [request])
            del optimizer.found_inf
            expected = [target.abs().nan_to_num(nan=0.0).amax() for target in targets]
            results.append((torch.stack(slots), torch.stack(expected), len(said)))
    return results


@pytest.mark.gpu
def test_kernel_records_the_amaxes_of_the_weights_it_leaves():
    """Exact maxima (NaNs skipped) of the stepped weights, of the unchanged ones of a step
    skipped on the device, of a weight without a gradient and of a part of one; `recorded`
    said once per step."""
    with mock.patch.object(fused_adam, "record_amax", wraps=record_amax) as after_step:
        results = _step_recording_amaxes("cuda", skips=(0.0, 0.0, 1.0, 0.0))
    for slots, expected, said in results:
        assert torch.equal(slots, expected) and said == 1
        assert torch.all(slots > 0)
    # The first step (torch's, which makes the moments) records all six after it; the kernel
    # records the four weights it steps, leaving the gradless one and the part to `_record`.
    assert after_step.call_count == 6 + 3 * 2


def test_cpu_records_the_amaxes_after_torch_step():
    (slots, expected, said), _ = _step_recording_amaxes("cpu", skips=(0.0, 0.0))
    assert torch.equal(slots, expected) and said == 1
    assert torch.all(slots > 0)


def _kernel_record(slot: torch.Tensor, weight: torch.Tensor) -> fused_adam._KernelRecord:
    """What the kernel leaves for `weight`: its maximum in `slot`, read before the hooks."""
    record_amax(weight, slot)
    return fused_adam._KernelRecord(slot, weight, weight, (weight._version, weight._version))


def test_a_slot_shared_with_a_weight_the_kernel_did_not_record_takes_both():
    stepped, gradless = torch.randn(100), 100 * torch.randn(7)
    slot = torch.zeros(())
    records = [_kernel_record(slot, stepped)]
    said: list[int] = []
    request = fused_adam.StepAmaxes(
        [(slot, stepped), (slot, gradless)], functools.partial(said.append, 1)
    )
    fused_adam._record([request], records)
    assert slot.item() == max(stepped.abs().max().item(), gradless.abs().max().item())
    assert said == [1]


def test_a_weight_a_step_hook_wrote_is_recorded_again_from_zero():
    """A hook that shrinks a weight after the kernel recorded it: its slot holds the maximum
    of the weight as the hooks left it, not the larger one of before."""
    weight, other = torch.randn(100), torch.randn(50)
    slot, other_slot = torch.zeros(()), torch.zeros(())
    records = [_kernel_record(slot, weight), _kernel_record(other_slot, other)]
    before = other_slot.clone()
    with torch.no_grad():
        weight.mul_(0.01)  # a post-step hook's in-place write
    request = fused_adam.StepAmaxes([(slot, weight), (other_slot, other)], lambda: None)
    fused_adam._record([request], records)
    assert slot.item() == weight.abs().max().item()
    assert torch.equal(other_slot, before)  # untouched weights are not recorded again


@pytest.mark.gpu
def test_kernel_slots_shared_with_other_weights_and_written_by_hooks():
    """Through the kernel: a slot shared by a stepped weight and a gradless one holds the
    larger maximum, and a weight a post-step hook shrinks is recorded as the hook left it."""
    mains, grads, models = _problem("cuda", torch.bfloat16)
    gradless = 50 * torch.randn(5, 16, device="cuda")
    optimizer = _optimizer(torch.optim.AdamW, [*mains, gradless], 1e-2, 0.1)
    optimizer.register_step_post_hook(lambda *unused: mains[1].mul_(0.01))
    with torch.no_grad():
        for _ in range(3):  # the first is torch's step; the kernel takes the others
            for main, grad in zip(mains, grads[0]):
                main.grad = grad.clone()
            shared, own = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
            targets = [(shared, mains[0]), (shared, gradless), (own, mains[1])]
            step_and_copy(
                optimizer, list(zip(models, mains)), [fused_adam.StepAmaxes(targets, lambda: None)]
            )
            assert shared.item() == max(mains[0].abs().max().item(), gradless.abs().max().item())
            assert own.item() == mains[1].abs().max().item()
    assert len(fused_adam._tables[optimizer]) == 2  # the kernel ran


@pytest.mark.gpu
def test_the_same_targets_every_step_are_planned_once_and_recorded_every_step():
    """As an engine hands them: the same (slot, weight) pairs every step, the slots zeroed
    before each. Each step records its weights' maxima; what the targets' planning reads of
    them is made once, and again where a pair changes."""
    mains, grads, models = _problem("cuda", torch.bfloat16)
    optimizer = _optimizer(torch.optim.AdamW, mains, 1e-2, 0.1)
    slots = [torch.zeros((), device="cuda") for _ in mains]
    pairs = list(zip(slots, mains))
    planned = []
    after_step = mock.patch.object(fused_adam, "record_amax", wraps=record_amax)
    with torch.no_grad(), after_step as recorded_after_step:
        for step in range(4):  # the first is torch's step; the kernel takes the others
            if step == 3:  # another slot for the first weight
                slots[0] = torch.zeros((), device="cuda")
                pairs[0] = (slots[0], mains[0])
            for main, grad in zip(mains, grads[step % len(grads)]):
                main.grad = grad.clone()
            torch._foreach_zero_(slots)
            request = fused_adam.StepAmaxes(list(pairs), lambda: None)
            step_and_copy(optimizer, list(zip(models, mains)), [request])
            assert all(slot.item() == main.abs().max().item() for slot, main in zip(slots, mains))
            planned.append(fused_adam._amax_target_cache[optimizer])
    assert planned[0] is planned[1] is planned[2]
    assert planned[3] is not planned[2] and planned[3].pairs[0][0] is slots[0]
    assert len(fused_adam._tables[optimizer]) == 2  # the kernel ran (both groups)
    # Only torch's step is recorded after it: the kernel recorded every other step's maxima.
    assert recorded_after_step.call_count == len(mains)


def _steps_switching_records(records: tuple[bool, ...]) -> tuple[list[list], list[int]]:
    """AdamW steps over `_problem`'s weights, recording every weight's maximum in the steps
    where `records` says so; each step's snapshot and its first group's program length."""
    mains, grads, models = _problem("cuda", torch.bfloat16)
    optimizer = _optimizer(torch.optim.AdamW, mains, 1e-2, 0.1)
    history, lengths = [], []
    with torch.no_grad():
        for step, record in enumerate(records):
            for main, grad in zip(mains, grads[step % len(grads)]):
                main.grad = grad.clone()
            slots = [torch.zeros((), device="cuda") for _ in mains]
            requests = [fused_adam.StepAmaxes(list(zip(slots, mains)), lambda: None)]
            step_and_copy(optimizer, list(zip(models, mains)), requests if record else [])
            if record:
                assert all(
                    slot.item() == main.abs().max().item() for slot, main in zip(slots, mains)
                )
            history.append(_snapshot(optimizer, mains, models))
            tables = fused_adam._tables.get(optimizer, {}).get(0)
            lengths.append(None if tables is None else tables.blocks_per_program)
    return history, lengths


@pytest.mark.gpu
def test_steps_that_record_maxima_update_as_steps_that_do_not():
    """A launch that records maxima runs longer programs over a program map of its own: steps
    switching between recording and not (the map made again each time) leave the weights,
    moments and counts of steps that never record, bit for bit."""
    records = (False, True, True, False, True, False)
    got, lengths = _steps_switching_records(records)
    expected, plain_lengths = _steps_switching_records((False,) * len(records))
    _assert_equal_histories(got, expected)
    # The first step is torch's (it makes the moments); the kernel takes the others.
    recording, plain = fused_adam._RECORDING_BLOCKS_PER_PROGRAM, fused_adam._BLOCKS_PER_PROGRAM
    assert lengths[1:] == [recording if record else plain for record in records[1:]]
    assert plain_lengths[1:] == [plain] * (len(records) - 1)
    # A weight of 40000 elements spans several of the longer programs too.
    assert SHAPES[0][0] > 2 * fused_adam._BLOCK * recording
