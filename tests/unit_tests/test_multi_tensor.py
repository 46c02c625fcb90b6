"""`megatron.core.multi_tensor`: copies and additions over lists of tensors, large tensors one
kernel each, the others in one foreach call, with the values of per-tensor `copy_` / `add_`."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron.core import multi_tensor


def _lists(device: str, sizes: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    targets = [torch.randn(n, device=device) for n in sizes]
    sources = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in sizes]
    return targets, sources


def _ops(function, *args) -> list[str]:
    """The aten operators `function(*args)` calls, not those they call."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        function(*args)
    return [
        e.name
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]


@pytest.mark.parametrize("op", ["copy", "add"])
def test_values_and_launches_of_mixed_sizes(monkeypatch, op):
    """Tensors above the bound (lowered here) get a call each, the others one foreach call;
    the values are those of the per-tensor op, casts included."""
    monkeypatch.setattr(multi_tensor, "_ELEMENTS_PER_LAUNCH", 16)
    sizes = [3, 40, 16, 17, 0, 5]
    targets, sources = _lists("cpu", sizes)
    expected = [t.clone() for t in targets]
    function = multi_tensor.copy_tensors_ if op == "copy" else multi_tensor.add_tensors_
    for target, source in zip(expected, sources):
        getattr(target, f"{op}_")(source)
    ops = _ops(function, targets, sources)
    for got, want in zip(targets, expected):
        assert torch.equal(got, want)
    # The two tensors above the bound (40 and 17 elements), then the others together.
    assert ops == [f"aten::{op}_", f"aten::{op}_", f"aten::_foreach_{op}_"]


def test_only_small_tensors_take_one_foreach_call():
    targets, sources = _lists("cpu", [4, 8])
    assert _ops(multi_tensor.copy_tensors_, targets, sources) == ["aten::_foreach_copy_"]
    assert all(torch.equal(t, s.float()) for t, s in zip(targets, sources))


def test_no_tensors_take_no_call():
    assert _ops(multi_tensor.copy_tensors_, [], []) == []
    assert _ops(multi_tensor.add_tensors_, [], []) == []


def test_only_large_tensors_take_no_foreach_call(monkeypatch):
    monkeypatch.setattr(multi_tensor, "_ELEMENTS_PER_LAUNCH", 2)
    targets, sources = _lists("cpu", [4, 8])
    assert _ops(multi_tensor.add_tensors_, targets, sources) == ["aten::add_", "aten::add_"]


@pytest.mark.gpu
def test_a_tensor_past_one_foreach_launch_is_one_kernel_on_cuda():
    """An fp32 -> bf16 cast of 2.5 launches' worth of elements and a small one: two kernels,
    where `_foreach_copy_` launches three or more."""
    big = multi_tensor._ELEMENTS_PER_LAUNCH * 5 // 2
    targets = [torch.empty(big, device="cuda", dtype=torch.bfloat16),
               torch.empty(100, device="cuda", dtype=torch.bfloat16)]  # fmt: skip
    sources = [torch.randn(big, device="cuda"), torch.randn(100, device="cuda")]

    def kernels(function) -> int:
        function(targets, sources)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            function(targets, sources)
            torch.cuda.synchronize()
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())

    assert kernels(torch._foreach_copy_) >= 3
    assert kernels(multi_tensor.copy_tensors_) == 2
    for target, source in zip(targets, sources):
        assert torch.equal(target, source.to(torch.bfloat16))
