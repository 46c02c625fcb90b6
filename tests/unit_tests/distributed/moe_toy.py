"""A tiny MoE regression model for the expert-parallelism tests of the engines and checkpoints.

Its experts follow the MoE contract's layout (`layers.N.mlp.experts.linear_fc1.weight`
[E_local, ffn, hidden], `linear_fc2.weight` [E_local, hidden, ffn]; rank r of the ep group holds
the global experts r * E_local ...) and its router is dense (`layers.N.mlp.router.weight`
[E, hidden]). Tokens reach the experts through autograd-aware collectives over the ep group (an
all-gather of every ep rank's tokens, then a reduce-scatter of the experts' outputs back), and
each sample's expert is given with the data, so a model built at any EP size computes the same
function, and single-process reference runs need no groups at all.

Initialisation is EP-invariant: each expert module draws one seed from the default generator
(the same draw on every rank) and global expert e's weights come from a generator seeded with
seed + e; a rank creates only its own experts. The tests take builders of this signature
(`build_toy_moe`), so a real GPT-MoE can replace the toy.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

IN_FEATURES, HIDDEN, FFN, OUT_FEATURES = 6, 16, 12, 3


class StackedLinear(torch.nn.Module):
    """The weights of this rank's experts for one projection: [E_local, out, in]."""

    def __init__(self, num_local: int, first_expert: int, out_features: int, in_features: int):
        super().__init__()
        self.first_expert = first_expert
        self.weight = torch.nn.Parameter(torch.empty(num_local, out_features, in_features))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        seed = int(torch.randint(0, 2**31 - 1, ()))
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        for i in range(self.weight.shape[0]):
            generator = torch.Generator().manual_seed(seed + self.first_expert + i)
            values = torch.rand(self.weight.shape[1:], generator=generator) * 2 * bound - bound
            self.weight[i].copy_(values)


class ToyExperts(torch.nn.Module):
    """This rank's experts: a GELU MLP each."""

    def __init__(self, num_local: int, first_expert: int):
        super().__init__()
        self.linear_fc1 = StackedLinear(num_local, first_expert, FFN, HIDDEN)
        self.linear_fc2 = StackedLinear(num_local, first_expert, HIDDEN, FFN)


class ToyMoE(torch.nn.Module):
    """Router (dense) and experts (split over `ep_group`)."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None):
        super().__init__()
        ep_size = 1 if ep_group is None else ep_group.size()
        ep_rank = 0 if ep_group is None else ep_group.rank()
        self.ep_group = ep_group if ep_size > 1 else None
        self.num_local = num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        self.router = torch.nn.Linear(HIDDEN, num_experts, bias=False)
        self.experts = ToyExperts(self.num_local, self.first_expert)

    def forward(self, tokens: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(tokens), dim=-1).gather(1, route[:, None])
        if self.ep_group is not None:
            tokens = gather_from_sequence_parallel_region(tokens, self.ep_group)
            gate = gather_from_sequence_parallel_region(gate, self.ep_group)
            route = gather_from_sequence_parallel_region(route, self.ep_group)
        out = torch.zeros_like(tokens)
        fc1, fc2 = self.experts.linear_fc1.weight, self.experts.linear_fc2.weight
        for i in range(self.num_local):
            index = (route == self.first_expert + i).nonzero().squeeze(1)
            hidden = torch.nn.functional.gelu(tokens[index] @ fc1[i].T)
            out = out.index_add(0, index, (hidden @ fc2[i].T) * gate[index])
        if self.ep_group is not None:
            out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group)
        return out


class ToyMoELayer(torch.nn.Module):
    """A residual MoE block (the unit Megatron-FSDP shards by)."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None):
        super().__init__()
        self.mlp = ToyMoE(num_experts, ep_group)

    def forward(self, hidden: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(hidden, route)


class ToyMoEModel(torch.nn.Module):
    """Input projection, MoE layers, head; returns each sample's squared error."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None, num_layers: int):
        super().__init__()
        self.inp = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.layers = torch.nn.ModuleList(
            ToyMoELayer(num_experts, ep_group) for _ in range(num_layers)
        )
        self.head = torch.nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(
        self, inputs: torch.Tensor, labels: torch.Tensor, route: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.inp(inputs)
        for layer in self.layers:
            hidden = layer(hidden, route)
        return ((self.head(hidden) - labels) ** 2).mean(-1)


def build_toy_moe(
    ep_group: dist.ProcessGroup | None,
    *,
    num_experts: int = 4,
    num_layers: int = 2,
    device: str | torch.device = "cpu",
) -> ToyMoEModel:
    """The toy with the same global weights at any EP size (`ep_group` None: every expert on
    this process); on `meta`, parameters are left for `reset_parameters()`."""
    torch.manual_seed(1234)
    with torch.device(device):
        return ToyMoEModel(num_experts, ep_group, num_layers)


def make_moe_batches(
    num_batches: int, batch_size: int, num_experts: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs, labels, route) global batches; the routes cover every expert."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, IN_FEATURES, generator=generator),
            torch.randn(batch_size, OUT_FEATURES, generator=generator),
            torch.randint(0, num_experts, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]
