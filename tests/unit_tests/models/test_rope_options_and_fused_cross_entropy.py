"""RoPE options (Llama 3 scaling, interleaved pairs, position interpolation) and the chunked
cross-entropy, against direct implementations of the formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_cross_entropy import fused_cross_entropy
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    RotaryEmbedding,
    apply_rotary_pos_emb,
    llama3_inv_freq,
)
from tests.unit_tests.model_builders import (
    assert_same_training_signal,
    build_tiny_gpt,
    make_token_batches,
    tiny_gpt_config,
)


def _llama3_reference(freqs: list[float], factor: float) -> list[float]:
    """Meta's `apply_scaling` (llama-models, Llama 3.1), element by element."""
    low_freq_factor, high_freq_factor, old_context_len = 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    scaled = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            scaled.append(freq)
        elif wavelen > low_freq_wavelen:
            scaled.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return scaled


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_scaling_matches_reference(factor):
    # Head width 128 with base 500000 (Llama 3.1): every band of the formula is populated.
    dim, base = 128, 500000.0
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    expected = torch.tensor(_llama3_reference(inv_freq.tolist(), factor), dtype=torch.float64)
    wavelen = 2 * math.pi / inv_freq
    assert (wavelen < 2048).any() and (wavelen > 8192).any()
    assert ((wavelen >= 2048) & (wavelen <= 8192)).any()
    torch.testing.assert_close(llama3_inv_freq(inv_freq, factor), expected)


def test_rotary_embedding_with_rope_scaling_and_interpolation():
    rope = RotaryEmbedding(
        128,
        rotary_base=500000,
        rope_scaling=True,
        rope_scaling_factor=8.0,
        seq_len_interpolation_factor=4,
    )
    angles = rope(16)
    inv_freq = 1.0 / 500000 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    scaled = torch.tensor(_llama3_reference(inv_freq.tolist(), 8.0), dtype=torch.float64)
    freqs = torch.outer(torch.arange(16, dtype=torch.float64) / 4, scaled)
    expected = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    torch.testing.assert_close(angles, expected.float())


def _rope_complex_reference(t: torch.Tensor, positions: torch.Tensor, base: float):
    """RoFormer / Meta Llama's rotation: adjacent channels (x0, x1) as x0 + i x1 times
    e^(i pos theta_k), theta_k = base^(-2k/d)."""
    d = t.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(positions.double(), theta)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(t.double().reshape(*t.shape[:-1], d // 2, 2).contiguous())
    rotated = pairs * rotation[:, None, None, :]
    return torch.view_as_real(rotated).reshape(t.shape)


def test_interleaved_rotary_matches_complex_rotation():
    seq, d = 12, 16
    rope = RotaryEmbedding(d, rotary_interleaved=True, rotary_base=10000)
    # fp32, as the model computes: the angles are fp32, the reference float64.
    t = torch.randn(seq, 2, 3, d)
    got = apply_rotary_pos_emb(t, rope(seq), rotary_interleaved=True)
    expected = _rope_complex_reference(t, torch.arange(seq), 10000.0)
    torch.testing.assert_close(got, expected.float())


def test_half_rotary_is_the_interleaved_rotation_of_permuted_channels():
    """The default layout pairs channel i with i + d/2: the complex rotation after moving those
    pairs next to each other."""
    seq, d = 12, 16
    t = torch.randn(seq, 2, 3, d)
    got = apply_rotary_pos_emb(t, RotaryEmbedding(d)(seq))
    order = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), -1).flatten()
    expected = torch.empty_like(t)
    rotated = _rope_complex_reference(t[..., order], torch.arange(seq), 10000.0)
    expected[..., order] = rotated.float()
    torch.testing.assert_close(got, expected)


def test_interleaved_model_runs_and_differs():
    config = tiny_gpt_config(rotary_interleaved=True)
    tokens, labels = make_token_batches(1, 2)[0]
    interleaved = build_tiny_gpt(config, position_embedding_type="rope")
    plain = build_tiny_gpt(tiny_gpt_config(), position_embedding_type="rope")
    assert interleaved.rotary_pos_emb.rotary_interleaved
    assert not torch.equal(interleaved(tokens, labels=labels), plain(tokens, labels=labels))


# --- chunked cross-entropy ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [1, 7 * 50, 10**9])
def test_fused_cross_entropy_loss_and_gradient(dtype, chunk_elements):
    torch.manual_seed(0)
    tokens, vocab = 37, 50
    logits = (torch.randn(tokens, vocab) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    target[::5] = -100
    weights = torch.randn(tokens)

    loss = fused_cross_entropy(logits, target, chunk_elements=chunk_elements)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)

    ref_logits = logits.detach().float().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits, target, reduction="none")
    (ref_grad,) = torch.autograd.grad((ref_loss * weights).sum(), ref_logits)
    torch.testing.assert_close(loss, ref_loss)
    assert torch.all(loss[::5] == 0)
    assert grad.dtype == dtype
    # The reference gradient rounded once to the logits' dtype, as fused_cross_entropy rounds.
    torch.testing.assert_close(grad, ref_grad.to(dtype))


def test_fused_cross_entropy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="logits \\[tokens, vocab\\]"):
        fused_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))


def test_gpt_model_with_cross_entropy_fusion_matches_unfused():
    configs = [tiny_gpt_config(cross_entropy_loss_fusion=fusion) for fusion in (False, True)]
    assert_same_training_signal(configs)
