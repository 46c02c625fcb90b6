"""`route_rows` (`megatron.core.fusions.moe_routing`): the rows of a dropless dispatch laid out by
its kernels, against the PyTorch ops the dispatchers otherwise run (`route_order`, a stable
argsort of the rows' tokens, the experts' counts): the same integers, and no host read."""

import pytest
import torch

from megatron.core.fusions.moe_routing import route_rows
from megatron.core.transformer.moe.token_dispatcher import route_every_token_k, route_order


def _routing(tokens: int, experts: int, topk: int, device: str):
    generator = torch.Generator(device=device).manual_seed(tokens * 1000 + experts + topk)
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    chosen = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=device)
    routing_map.scatter_(1, chosen, True)
    probs = torch.zeros(tokens, experts, device=device).scatter(1, chosen, logits.softmax(1))
    return routing_map, probs


def _expected(routing_map, probs, topk):
    permuted_probs, token_index = route_order(routing_map, probs, routing_map.shape[0] * topk)
    by_token = torch.argsort(token_index, stable=True)
    return permuted_probs, token_index, by_token, routing_map.sum(dim=0)


def test_the_pytorch_ops_run_off_cuda():
    routing_map, probs = _routing(9, 6, 2, "cpu")
    assert route_rows(routing_map, 2) is None
    for got, want in zip(
        route_every_token_k(routing_map, probs, 2), _expected(routing_map, probs, 2)
    ):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,experts,topk",
    [(1, 8, 2), (17, 8, 1), (4096, 8, 2), (1000, 40, 6), (300, 256, 8), (64, 1024, 4)],
)
def test_the_kernels_lay_out_the_rows_of_the_pytorch_ops(tokens, experts, topk):
    routing_map, probs = _routing(tokens, experts, topk, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routes = route_rows(routing_map, topk)
        got = route_every_token_k(routing_map, probs, topk)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert routes is not None
    expected = _expected(routing_map, probs, topk)
    for name, a, b in zip(("probs", "token_index", "by_token", "counts"), got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(
        routes.source_index, routes.token_index * experts + _experts_of_rows(routes.counts)
    )


def _experts_of_rows(counts: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)


@pytest.mark.gpu
def test_the_routing_weights_gradient_is_the_pytorch_ops():
    routing_map, probs = _routing(333, 16, 3, "cuda")
    grads = []
    for route in (route_every_token_k, lambda m, p, k: _expected(m, p, k)):
        leaf = probs.clone().requires_grad_()
        permuted = route(routing_map, leaf, 3)[0]
        permuted.backward(torch.arange(permuted.numel(), device="cuda", dtype=torch.float32))
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.gpu
def test_no_tokens():
    routes = route_rows(torch.zeros(0, 8, dtype=torch.bool, device="cuda"), 2)
    assert routes.token_index.numel() == 0 and routes.counts.tolist() == [0] * 8
