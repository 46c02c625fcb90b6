"""Multi-latent attention on SDPA's fast CUDA kernels in bf16 (FlashAttention with the values
padded to the query width, memory-efficient attention and cuDNN attention, each pinned so that
no other kernel can stand in), forward and backward, against the float64 DeepSeek reference on
the same bf16-rounded weights and inputs; and the fused rotation (`--apply-rope-fusion`)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.transformer.enums import AttnBackend
from tests.unit_tests.transformer.mla_reference import mla_reference
from tests.unit_tests.transformer.test_multi_latent_attention import (
    build_mla,
    mla_config,
    reference_shape,
)

pytestmark = pytest.mark.gpu

SEQ, BATCH = 256, 2
SHAPES = {
    # DeepSeek-V3's head widths: queries and keys 128 + 64, values 128.
    "deepseek_v3_heads": dict(
        hidden_size=512,
        num_attention_heads=4,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
    ),
    "small_heads": dict(
        hidden_size=256,
        num_attention_heads=8,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_head_dim=32,
        qk_pos_emb_head_dim=16,
        v_head_dim=24,
    ),
}
KERNELS = {
    # backend of the config, the kernel pinned around the call (None: the backend pins it)
    "flash": (AttnBackend.flash, None),
    "efficient": (AttnBackend.auto, SDPBackend.EFFICIENT_ATTENTION),
    "cudnn": (AttnBackend.fused, None),
}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach().double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("fused_rope", [False, True], ids=["rope", "fused_rope"])
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mla_on_fast_kernels_in_bf16_matches_the_fp32_reference(shape, kernel, fused_rope):
    backend, pinned = KERNELS[kernel]
    config = mla_config(
        attention_backend=backend,
        apply_rope_fusion=fused_rope,
        params_dtype=torch.bfloat16,
        bf16=True,
        rotary_scaling_factor=40.0,
        original_max_position_embeddings=64,
        **SHAPES[shape],
    )
    attention = build_mla(config).cuda().train()
    assert attention.pad_value is (kernel == "flash" and config.v_head_dim != attention.q_head_dim)
    torch.manual_seed(0)
    x = torch.randn(SEQ, BATCH, config.hidden_size, dtype=torch.bfloat16, device="cuda")
    x.requires_grad_()
    with sdpa_kernel(pinned) if pinned is not None else contextlib.nullcontext():
        output, _ = attention(x)
    grad_output = torch.randn_like(output)
    output.backward(grad_output)

    weights = {
        name: p.detach().cpu().double().requires_grad_() for name, p in attention.named_parameters()
    }
    x64 = x.detach().cpu().double().transpose(0, 1).requires_grad_()
    expected = mla_reference(x64, weights, reference_shape(config))
    expected.backward(grad_output.cpu().double().transpose(0, 1))

    errors = {"output": _relative_error(output.cpu().transpose(0, 1), expected.detach())}
    errors["x"] = _relative_error(x.grad.cpu().transpose(0, 1), x64.grad)
    for name, param in attention.named_parameters():
        errors[name] = _relative_error(param.grad.cpu(), weights[name].grad)
    # bf16 keeps 8 bits: about 0.4% per rounding, a few of them through the layer.
    assert max(errors.values()) < 0.03, errors
