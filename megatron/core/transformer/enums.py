"""Enumerations of transformer options whose values are names (Megatron-LM's `enums.py`)."""

from __future__ import annotations

import enum


class AttnBackend(enum.Enum):
    """Which attention kernel `DotProductAttention` runs (`--attention-backend`).

    Upstream these select Transformer Engine's kernels; here they select PyTorch's
    `scaled_dot_product_attention` backends, or the explicit local implementation:

    - `flash`: SDPA's FlashAttention kernel (CUDA, fp16/bf16).
    - `fused`: SDPA's cuDNN fused-attention kernel (TE's "fused" backend is cuDNN's).
    - `unfused`: SDPA's math implementation (unfused matmul, softmax, matmul).
    - `local`: this project's unfused attention, which honours `attention_softmax_in_fp32` and
      `apply_query_key_layer_scaling` (Megatron-core's local `DotProductAttention`).
    - `auto`: SDPA picks the fastest kernel the inputs allow.
    """

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
