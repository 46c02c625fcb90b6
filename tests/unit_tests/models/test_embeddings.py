"""LanguageModelEmbedding and rotary position embeddings."""

import pytest
import torch

from megatron.core.models.common.embeddings import (
    LanguageModelEmbedding,
    RotaryEmbedding,
    apply_rotary_pos_emb,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**overrides):
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, **overrides
    )


def test_embedding_is_sequence_first_and_adds_positions():
    embedding = LanguageModelEmbedding(_config(), vocab_size=100, max_sequence_length=16)
    ids = torch.randint(0, 100, (2, 12))
    out = embedding(ids)
    assert out.shape == (12, 2, 32)
    words = embedding.word_embeddings.weight
    positions = embedding.position_embeddings.weight
    torch.testing.assert_close(out[5, 1], words[ids[1, 5]] + positions[5])
    shifted = embedding(ids, position_ids=torch.arange(12).unsqueeze(0) + 4)
    torch.testing.assert_close(shifted[5, 1], words[ids[1, 5]] + positions[9])


def test_rope_embedding_has_no_position_table():
    embedding = LanguageModelEmbedding(_config(), 100, 16, position_embedding_type="rope")
    assert not hasattr(embedding, "position_embeddings")
    ids = torch.randint(0, 100, (2, 20))  # longer than max_sequence_length is fine with RoPE
    torch.testing.assert_close(embedding(ids)[3, 0], embedding.word_embeddings.weight[ids[0, 3]])


def test_too_long_sequence_for_learned_positions_raises():
    embedding = LanguageModelEmbedding(_config(), 100, 16)
    with pytest.raises(ValueError, match="max_sequence_length"):
        embedding(torch.zeros(1, 17, dtype=torch.long))


def test_rotary_angles_shape_and_dtype():
    angles = RotaryEmbedding(kv_channels=8)(16)
    assert angles.shape == (16, 1, 1, 8) and angles.dtype == torch.float32
    torch.testing.assert_close(angles[3, 0, 0, 0], torch.tensor(3.0))  # frequency 1 at index 0


def test_rotary_angles_are_computed_once_per_length_offset_and_device():
    rope = RotaryEmbedding(kv_channels=8)
    angles = rope(6)
    assert rope(6) is angles  # every step and layer asks again: the same tensor (and tables)
    assert torch.equal(angles, RotaryEmbedding(kv_channels=8)(6))  # as computed anew
    shifted = rope(6, offset=2)
    assert shifted is not angles and torch.equal(shifted, rope(8)[2:])
    on_meta = rope(6, device="meta")
    assert on_meta.is_meta and rope(6, device="meta") is on_meta
    for length in range(1, 40):  # more lengths than are kept: the oldest go, none is wrong
        assert torch.equal(rope(length), RotaryEmbedding(kv_channels=8)(length))


def test_angles_first_used_under_inference_mode_train_afterwards():
    """Inference tensors cannot be saved for backward: none is kept for later calls."""
    rope = RotaryEmbedding(kv_channels=8)
    t = torch.randn(6, 2, 3, 8)
    with torch.inference_mode():
        apply_rotary_pos_emb(t, rope(6))
    trained = t.clone().requires_grad_()
    apply_rotary_pos_emb(trained, rope(6)).sum().backward()
    assert trained.grad is not None


def test_rotary_angles_under_torch_compile_are_computed_in_the_graph():
    rope = RotaryEmbedding(kv_channels=8)
    compiled = torch.compile(lambda n: rope(n) * 1, backend="aot_eager", fullgraph=True)
    angles = compiled(6)
    assert not rope._kept_angles  # the compiled call kept nothing for eager calls to reuse
    assert torch.equal(angles, rope(6))


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(kv_channels=8)
    angles = rope(12)
    q = torch.randn(1, 1, 1, 8).expand(12, 1, 1, 8)
    k = torch.randn(1, 1, 1, 8).expand(12, 1, 1, 8)
    q_rot, k_rot = apply_rotary_pos_emb(q, angles), apply_rotary_pos_emb(k, angles)
    score = lambda m, n: (q_rot[m] * k_rot[n]).sum()  # noqa: E731
    torch.testing.assert_close(score(5, 2), score(9, 6))
    torch.testing.assert_close(score(3, 3), (q[0] * k[0]).sum())
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_partial_rotary_leaves_the_other_channels_alone():
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=0.5)
    t = torch.randn(6, 2, 3, 8)
    out = apply_rotary_pos_emb(t, rope(6))
    torch.testing.assert_close(out[..., 4:], t[..., 4:])
    assert not torch.allclose(out[1:, ..., :4], t[1:, ..., :4])


def test_rotary_percent_must_give_an_even_width():
    with pytest.raises(ValueError, match="rotary_percent"):
        RotaryEmbedding(kv_channels=8, rotary_percent=0.25 / 2)


def test_arguments_after_rotary_percent_are_keyword_only():
    # Megatron-LM's third positional argument is rotary_interleaved; a call ported from there
    # must fail instead of setting the frequency base to True.
    with pytest.raises(TypeError):
        RotaryEmbedding(8, 1.0, 500)
    rope = RotaryEmbedding(8, 1.0, rotary_base=500)
    torch.testing.assert_close(rope(2)[1, 0, 0, 1], torch.tensor(500.0 ** (-2 / 8)))


def _textbook_rotation(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(t, 2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return t * torch.cos(freqs).to(t.dtype) + rotated_half * torch.sin(freqs).to(t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_the_textbook_formula_bitwise_forward_and_backward(dtype):
    # Arbitrary angles (not two equal halves), so the signed sine's halves are both exercised.
    freqs = torch.rand(6, 1, 1, 8) * 20
    t = torch.randn(6, 2, 3, 8, dtype=dtype, requires_grad=True)
    reference = t.detach().clone().requires_grad_()
    out, expected = apply_rotary_pos_emb(t, freqs), _textbook_rotation(reference, freqs)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(t.grad, reference.grad)


def test_rotation_tables_are_made_once_per_angles_tensor():
    freqs = RotaryEmbedding(kv_channels=8)(6)
    t = torch.randn(6, 2, 3, 8)
    cos = torch.cos
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "cos", lambda x: calls.append(1) or cos(x))
        first = apply_rotary_pos_emb(t, freqs)
        again = apply_rotary_pos_emb(t, freqs)  # the next layer of the same forward
        assert len(calls) == 1 and torch.equal(first, again)
        apply_rotary_pos_emb(t.bfloat16(), freqs)  # another dtype: its own tables
        assert len(calls) == 2
        for _ in range(2):  # the interleaved layout: its own tables, also made once
            apply_rotary_pos_emb(t, freqs, rotary_interleaved=True)
        assert len(calls) == 3
        freqs.mul_(2)  # modified in place: the tables follow
        rotated = apply_rotary_pos_emb(t, freqs)
        assert len(calls) == 4
    torch.testing.assert_close(rotated, _textbook_rotation(t, freqs))


def test_trained_angles_get_a_gradient_from_every_call():
    freqs = (torch.rand(6, 1, 1, 8) * 20).requires_grad_()
    t = torch.randn(6, 2, 3, 8)
    for _ in range(2):
        freqs.grad = None
        apply_rotary_pos_emb(t, freqs).sum().backward()
        assert freqs.grad is not None and freqs.grad.abs().sum() > 0
