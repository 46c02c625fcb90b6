"""The GPT of `gpt_model.py` written as plain PyTorch modules, and PyTorch's own 2-D
composition of it: tensor parallelism with `parallelize_module` (`ColwiseParallel`,
`RowwiseParallel`, `SequenceParallel`; torchtitan's plan for Llama) inside, FSDP2's
`fully_shard` across the data-parallel ranks outside, and the loss computed on vocabulary-sharded
logits under `loss_parallel()`.

Same shape as the benchmark GPT: pre-norm LayerNorm blocks with biases, RoPE, GeLU or SwiGLU MLP,
untied output layer; separate query, key and value projections (the FLOPs of the fused one).
Attention views infer the head count (`-1`), so the same code runs on the local heads of a tensor-
parallel rank. Imported by `tools/benchmark_tp.py`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE with Megatron's (non-interleaved) pairing on [b, s, heads, d]."""
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, hidden)
        self.wk = nn.Linear(hidden, hidden)
        self.wv = nn.Linear(hidden, hidden)
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, angles), _rotate(k, angles)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int, swiglu: bool):
        super().__init__()
        self.swiglu = swiglu
        self.w1 = nn.Linear(hidden, ffn)
        self.w3 = nn.Linear(hidden, ffn) if swiglu else None
        self.w2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, swiglu: bool):
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads)
        self.ffn_norm = nn.LayerNorm(hidden)
        self.feed_forward = FeedForward(hidden, ffn, swiglu)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), angles)
        return x + self.feed_forward(self.ffn_norm(x))


class TorchGPT(nn.Module):
    """The benchmark GPT ([b, s] token ids in, [b, s, vocab] logits out)."""

    def __init__(self, args: argparse.Namespace):
        super().__init__()
        hidden, heads = args.hidden_size, args.num_attention_heads
        ffn = args.ffn_hidden_size or 4 * hidden
        self.tok_embeddings = nn.Embedding(args.vocab_size, hidden)
        self.layers = nn.ModuleList(
            Block(hidden, heads, ffn, args.swiglu) for _ in range(args.num_layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, args.vocab_size, bias=False)
        self.head_dim, self.seq_length = hidden // heads, args.seq_length
        self.register_buffer("angles", self._angles(), persistent=False)

    def _angles(self) -> torch.Tensor:
        inverse = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(self.seq_length).float(), inverse)
        return torch.cat((angles, angles), dim=-1)[:, None, :]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draws every parameter again and recomputes the rotary angles (after `to_empty`)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        self.angles.copy_(self._angles())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.angles[: tokens.shape[1]])
        return self.output(self.norm(x))


def parallelize(model: TorchGPT, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh, bf16: bool) -> TorchGPT:
    """torchtitan's Llama recipe: sequence-parallel norms and residuals, column-/row-parallel
    projections, vocabulary-sharded logits (for `loss_parallel`); then FSDP2 on each block and
    the root over `dp_mesh`, fp32 sharded parameters and bf16 compute when `bf16`."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if model.layers[0].feed_forward.swiglu:
        block_plan["feed_forward.w3"] = ColwiseParallel()
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block_plan)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model
