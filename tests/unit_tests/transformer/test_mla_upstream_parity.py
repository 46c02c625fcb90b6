"""Multi-latent attention computes what Megatron-core 0.19.2's does on the same weights and
inputs: the attention layer (output and every gradient), YaRN's angles and concentration
factor, the rotation, and a 2-layer GPT's loss and gradients (golden data made by upstream
itself: `fixtures/make_mla_fixtures.py`, whose docstring says what it runs; its core attention
is a plain causal softmax with upstream's scale, as upstream's local spec has no MLA kernel
without Transformer Engine). The weights load by upstream's names, strictly."""

from __future__ import annotations

import pathlib

import numpy
import pytest
import torch

from megatron.core.models.common.embeddings import (
    apply_rotary_pos_emb,
)
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.multi_latent_attention import mla_rotary_embedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
from tests.unit_tests.transformer.fixtures import mla_cases

FIXTURE = pathlib.Path(__file__).with_name("fixtures") / "mla_upstream.npz"


@pytest.fixture(scope="module")
def upstream() -> dict[str, torch.Tensor]:
    with numpy.load(FIXTURE) as arrays:
        assert str(arrays["megatron_core_version"]) == "0.19.2"
        return {key: torch.from_numpy(arrays[key]) for key in arrays.files if "/" in key}


def _part(upstream: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix) :]: value for key, value in upstream.items() if key.startswith(prefix)}


@pytest.mark.parametrize("case", list(mla_cases.CASES))
def test_attention_equals_upstream(case, upstream):
    config = MLATransformerConfig(**mla_cases.CASES[case])
    data = _part(upstream, f"{case}/attention/")
    spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    attention = build_module(spec, config=config, layer_number=1)
    attention.load_state_dict(_part(data, "weight/"), strict=True)
    x = data["x"].clone().requires_grad_()
    output, _ = attention(x)
    output.backward(data["grad_output"])
    torch.testing.assert_close(output, data["output"])
    torch.testing.assert_close(x.grad, data["x_grad"])
    grads = _part(data, "grad/")
    assert grads.keys() == dict(attention.named_parameters()).keys()
    for name, param in attention.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], msg=name)


@pytest.mark.parametrize("case", list(mla_cases.CASES))
def test_angles_and_concentration_factor_equal_upstreams(case, upstream):
    config = MLATransformerConfig(**mla_cases.CASES[case])
    data = _part(upstream, f"{case}/rope/")
    embedding = mla_rotary_embedding(config, interleaved=False)  # upstream's layout: the halves
    torch.testing.assert_close(embedding(mla_cases.SEQ), data["angles"], rtol=0, atol=0)
    assert embedding.concentration_factor == pytest.approx(data["mscale"].item(), rel=1e-12)


@pytest.mark.parametrize("case", list(mla_cases.CASES))
def test_rotation_is_upstreams_up_to_its_channel_order(case, upstream):
    """This project rotates adjacent pairs in place; upstream writes pair (2i, 2i + 1) to
    channels i and i + d/2 (of queries and keys alike, so their dot products are equal)."""
    config = MLATransformerConfig(**mla_cases.CASES[case])
    data = _part(upstream, f"{case}/rope/")
    embedding = mla_rotary_embedding(config, interleaved=True)
    rotated = apply_rotary_pos_emb(
        data["input"],
        embedding(mla_cases.SEQ),
        rotary_interleaved=True,
        mscale=embedding.concentration_factor,
    )
    half = config.qk_pos_emb_head_dim // 2
    upstream_order = torch.cat([rotated[..., 0::2], rotated[..., 1::2]], dim=-1)
    torch.testing.assert_close(upstream_order, data["rotated"])
    assert not torch.allclose(rotated[..., :half], data["rotated"][..., :half])


def test_gpt_equals_upstream(upstream):
    config = MLATransformerConfig(**mla_cases.CASES[mla_cases.GPT_CASE])
    data = _part(upstream, f"{mla_cases.GPT_CASE}/gpt/")
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=mla_cases.VOCAB,
        max_sequence_length=mla_cases.SEQ,
        position_embedding_type="rope",
    )
    model.load_state_dict(_part(data, "weight/"), strict=True)
    loss = model(data["tokens"], labels=data["labels"])
    loss.sum().backward()
    torch.testing.assert_close(loss, data["loss"])
    grads = _part(data, "grad/")
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], msg=name)
