"""GPTModel: outputs and loss, weight tying, variants, determinism, meta init, bf16."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.activations import quick_gelu
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import run_distributed

VOCAB, SEQ, BATCH, HIDDEN = 100, 16, 2, 32


def _config(**overrides):
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**base, **overrides})


def _model(config=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    config = config or _config()
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, **kwargs)


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, labels


def test_logits_and_per_token_loss():
    model = _model().eval()
    ids, labels = _batch()
    logits = model(ids)
    loss = model(ids, labels=labels)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32
    assert torch.isfinite(loss).all()
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, expected.view(BATCH, SEQ))
    # Initial loss of a freshly initialised model is close to uniform guessing.
    assert abs(loss.mean().item() - torch.log(torch.tensor(VOCAB)).item()) < 0.5


def test_tied_weights_are_one_parameter_with_gradient_from_both_uses():
    tied = _model(share_embeddings_and_output_weights=True)
    weight = tied.embedding.word_embeddings.weight
    assert tied.output_layer is None
    assert tied.shared_embedding_or_output_weight() is weight
    assert sum(p is weight for p in tied.parameters()) == 1

    # Same weights, untied, with the output matrix a copy of the embedding: the tied gradient
    # must be the sum of the untied embedding and output gradients.
    untied = _model()
    untied.load_state_dict(tied.state_dict(), strict=False)
    with torch.no_grad():
        untied.output_layer.weight.copy_(weight)
    ids, labels = _batch()
    tied(ids, labels=labels).mean().backward()
    untied(ids, labels=labels).mean().backward()
    expected = untied.embedding.word_embeddings.weight.grad + untied.output_layer.weight.grad
    torch.testing.assert_close(weight.grad, expected)
    assert untied.output_layer.weight.grad.abs().sum() > 0


def test_shared_embedding_or_output_weight_follows_megatron():
    # The word embeddings on a first stage, else the output layer on a last stage, else None.
    config = _config(num_layers=1)
    whole = _model(config)
    assert whole.shared_embedding_or_output_weight() is whole.embedding.word_embeddings.weight
    last = _model(config, pre_process=False)
    assert last.shared_embedding_or_output_weight() is last.output_layer.weight
    middle = _model(config, pre_process=False, post_process=False)
    assert middle.shared_embedding_or_output_weight() is None


def test_megatron_cores_positional_arguments():
    """Constructor: (..., pre_process, post_process, fp16_lm_cross_entropy, parallel_output,
    share_embeddings_and_output_weights, ...); forward: (input_ids, position_ids,
    attention_mask, decoder_input, labels, ...). Before: keyword-only, and the fourth forward
    argument was the labels."""
    spec = get_gpt_layer_local_spec(None, False, False)  # num_experts, grouped GEMM, qk norm
    torch.manual_seed(0)
    tied = GPTModel(_config(), spec, VOCAB, SEQ, True, True, False, True, True).eval()
    assert tied.output_layer is None and tied.share_embeddings_and_output_weights
    ids, labels = _batch()
    torch.testing.assert_close(tied(ids, None, None, None, labels), tied(ids, labels=labels))
    # decoder_input replaces the embedding's output.
    embedded = tied.embedding(ids, None)
    torch.testing.assert_close(tied(None, None, None, embedded), tied(ids))
    loss_mask = torch.ones(BATCH, SEQ)  # upstream's, for multi-token prediction only
    torch.testing.assert_close(
        tied(ids, labels=labels, loss_mask=loss_mask), tied(ids, None, None, None, labels)
    )
    with pytest.raises(ValueError, match="packed_seq_params=.* \\(not built\\)"):
        tied(ids, packed_seq_params=object())


def test_untied_output_layer_is_separate():
    model = _model()
    assert model.output_layer.weight is not model.embedding.word_embeddings.weight
    assert model.output_layer.weight.shape == (VOCAB, HIDDEN)
    assert not torch.equal(model.output_layer.weight, model.embedding.word_embeddings.weight)


VARIANTS = {
    "learned": (dict(), dict()),
    "rope_gqa": (dict(num_query_groups=2), dict(position_embedding_type="rope")),
    "mqa_partial_rope": (
        dict(num_query_groups=1),
        dict(position_embedding_type="rope", rotary_percent=0.5),
    ),
    "nope": (dict(), dict(position_embedding_type="none")),
    "swiglu_rmsnorm": (
        dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm"),
        dict(),
    ),
    "gpt_oss": (
        dict(
            num_query_groups=2,
            window_size=(2, 0),
            window_attn_skip_freq=2,
            softmax_type="learnable",
            gated_linear_unit=True,
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=7.0,
        ),
        dict(position_embedding_type="rope"),
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_are_causal(variant):
    config_overrides, model_kwargs = VARIANTS[variant]
    model = _model(_config(**config_overrides), **model_kwargs).eval()
    ids, _ = _batch()
    logits = model(ids)
    assert logits.shape == (BATCH, SEQ, VOCAB) and torch.isfinite(logits).all()
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    changed_logits = model(changed)
    torch.testing.assert_close(changed_logits[:, :10], logits[:, :10])
    assert not torch.allclose(changed_logits[:, 10:], logits[:, 10:])


def test_swiglu_rmsnorm_model_learns():
    config = _config(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm")
    model = _model(config, position_embedding_type="rope")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids, labels = _batch()
    losses = []
    for _ in range(10):
        loss = model(ids, labels=labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def _weights_checksum_across_ranks(seed: int) -> tuple[bool, float]:
    torch.manual_seed(seed)
    model = GPTModel(_config(), get_gpt_layer_local_spec(), VOCAB, SEQ)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    if dist.get_backend() == "nccl":
        flat = flat.cuda()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered), flat.double().sum().item()


def test_same_seed_gives_the_same_weights_on_every_rank():
    results = run_distributed(_weights_checksum_across_ranks, 2, 1234)
    assert all(equal for equal, _ in results)
    local = _model(seed=1234)
    local_sum = torch.cat([p.detach().flatten() for p in local.parameters()]).double().sum()
    assert [checksum for _, checksum in results] == [local_sum.item()] * 2
    other_seed = _model(seed=1)
    other_sum = torch.cat([p.detach().flatten() for p in other_seed.parameters()]).double().sum()
    assert local_sum.item() != pytest.approx(other_sum.item())


def _build_on_meta(config=None, seed=0, **kwargs):
    with torch.device("meta"):
        model = _model(config or _config(hidden_size=64, num_attention_heads=4), **kwargs)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_meta_construction_then_reset_parameters(tied):
    model = _build_on_meta(share_embeddings_and_output_weights=tied)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    std, scaled_std = 0.02, 0.02 / (2 * 2) ** 0.5
    layer = model.decoder.layers[1]
    checks = {
        model.embedding.word_embeddings.weight: std,
        model.embedding.position_embeddings.weight: std,
        layer.self_attention.linear_qkv.weight: std,
        layer.self_attention.linear_proj.weight: scaled_std,
        layer.mlp.linear_fc1.weight: std,
        layer.mlp.linear_fc2.weight: scaled_std,
    }
    if not tied:
        checks[model.output_layer.weight] = std
    for weight, expected in checks.items():
        assert weight.mean().abs() < 0.2 * expected
        assert weight.std().item() == pytest.approx(expected, rel=0.1)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(param == 0), name
        elif "layernorm" in name:
            assert torch.all(param == 1), name
    ids, labels = _batch()
    loss = model(ids, labels=labels)
    assert torch.isfinite(loss).all()
    assert abs(loss.mean().item() - torch.log(torch.tensor(VOCAB)).item()) < 0.5


@pytest.mark.parametrize(
    "variant, tied",
    [
        ("learned", False),
        ("learned", True),
        ("rope_gqa", True),
        ("swiglu_rmsnorm", False),
        ("gpt_oss", False),
    ],
)
def test_meta_construction_then_reset_parameters_matches_a_normal_build_bit_for_bit(variant, tied):
    # Deferred (meta) initialisation must give exactly the weights of a normal build with the
    # same seed: `model.modules()` visits the modules in construction order, and each
    # `reset_parameters()` draws what the constructor drew.
    config_overrides, model_kwargs = VARIANTS[variant]
    config = _config(**config_overrides)
    kwargs = dict(model_kwargs, share_embeddings_and_output_weights=tied)
    deferred = _build_on_meta(config, seed=1234, **kwargs).state_dict()
    normal = _model(config, seed=1234, **kwargs).state_dict()
    assert deferred.keys() == normal.keys()
    for name, tensor in normal.items():
        assert torch.equal(deferred[name], tensor), name


def test_reset_parameters_touches_only_direct_parameters():
    model = _model()
    for module in model.modules():
        if not hasattr(module, "reset_parameters"):
            continue
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.fill_(7.0)  # make the reset visible even for ones/zeros inits
        module.reset_parameters()
        own = {id(p) for p in module.parameters(recurse=False)}
        for name, p in model.named_parameters():
            if id(p) in own:
                assert not torch.all(p == 7.0), name
            else:
                assert torch.equal(p, before[name]), f"{type(module).__name__} reset {name}"


def test_bf16_parameters_forward_backward():
    config = _config(params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.1)
    model = _model(config, position_embedding_type="rope", share_embeddings_and_output_weights=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids, labels = _batch()
    assert model(ids).dtype == torch.bfloat16
    loss = model(ids, labels=labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(p.grad).all(), name


def test_pipeline_style_split_matches_the_full_model():
    full = _model().eval()
    stage_config = _config(num_layers=1)
    first = _model(stage_config, post_process=False).eval()
    last = _model(stage_config, pre_process=False).eval()
    assert first.output_layer is None and first.decoder.final_layernorm is None
    assert not hasattr(last, "embedding")
    first.embedding.load_state_dict(full.embedding.state_dict())
    first.decoder.layers[0].load_state_dict(full.decoder.layers[0].state_dict())
    last.decoder.layers[0].load_state_dict(full.decoder.layers[1].state_dict())
    last.decoder.final_layernorm.load_state_dict(full.decoder.final_layernorm.state_dict())
    last.output_layer.load_state_dict(full.output_layer.state_dict())

    ids, _ = _batch()
    with pytest.raises(ValueError, match="set_input_tensor"):
        last(None)
    hidden = first(ids)
    assert hidden.shape == (SEQ, BATCH, HIDDEN)
    last.set_input_tensor(hidden)
    torch.testing.assert_close(last(None), full(ids))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(fp16_lm_cross_entropy=True), "fp16_lm_cross_entropy=True .the loss is computed"),
        (dict(scatter_embedding_sequence_parallel=False), "scatter_embedding_sequence_parallel"),
        (dict(mtp_block_spec=get_gpt_layer_local_spec()), "multi-token prediction"),
        (dict(vp_stage=1), "vp_stage=1 is outside the pipeline of 1 rank.s. x 1 virtual"),
    ],
)
def test_bad_model_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _model(**kwargs)


def test_seq_length_longer_than_learned_positions_raises():
    with pytest.raises(ValueError, match="seq_length"):
        _model(_config(seq_length=SEQ + 1))
    _model(_config(seq_length=SEQ + 1), position_embedding_type="rope")  # fine with RoPE
