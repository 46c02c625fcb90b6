"""MLASelfAttention against the plain-torch DeepSeek reference (forward and backward, fp32), its
recompute, its spec and config errors, and a GPT built of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from tests.unit_tests.transformer.mla_reference import MLAShape, mla_reference

SEQ, BATCH, HIDDEN, HEADS = 12, 2, 32, 4
# Every width different, so that a mixed-up split or layout cannot pass.
WIDTHS = dict(kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5)
# YaRN with the sequence past its original length and a concentration factor other than 1.
YARN = dict(
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=8.0,
    beta_slow=0.5,
    mscale=0.9,
    mscale_all_dim=0.6,
)
ROPE = dict(rope_type="rope", rotary_base=500.0)


def mla_config(**overrides) -> MLATransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        q_lora_rank=12,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **WIDTHS,
        **YARN,
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def reference_shape(config: MLATransformerConfig) -> MLAShape:
    names = {field.name for field in dataclasses.fields(MLAShape)} - {"heads", "eps"}
    return MLAShape(
        heads=config.num_attention_heads,
        eps=config.layernorm_epsilon,
        **{name: getattr(config, name) for name in names},
    )


def build_mla(config: MLATransformerConfig, seed: int = 0) -> MLASelfAttention:
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    attention = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():  # norm weights and the bias away from their init, so they count
        for name, param in attention.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.uniform_(0.5, 1.5)
    return attention


def run_against_reference(config: MLATransformerConfig, **reference_kwargs) -> None:
    attention = build_mla(config).train()
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    output, bias = attention(x, **reference_kwargs)
    assert bias is None and output.shape == (SEQ, BATCH, HIDDEN)
    grad_output = torch.randn_like(output)
    output.backward(grad_output)

    weights = {
        name: p.detach().double().requires_grad_() for name, p in attention.named_parameters()
    }
    x64 = x.detach().double().transpose(0, 1).requires_grad_()
    expected = mla_reference(x64, weights, reference_shape(config), **reference_kwargs)
    expected.backward(grad_output.double().transpose(0, 1))

    torch.testing.assert_close(output, expected.transpose(0, 1).float())
    torch.testing.assert_close(x.grad, x64.grad.transpose(0, 1).float())
    for name, param in attention.named_parameters():
        torch.testing.assert_close(param.grad, weights[name].grad.float(), msg=name)


@pytest.mark.parametrize("rope", [YARN, ROPE], ids=["yarn", "rope"])
@pytest.mark.parametrize("q_lora_rank", [12, None])
@pytest.mark.parametrize("backend", [AttnBackend.auto, AttnBackend.local])
def test_mla_matches_the_deepseek_reference(rope, q_lora_rank, backend):
    run_against_reference(mla_config(q_lora_rank=q_lora_rank, attention_backend=backend, **rope))


def test_mla_without_latent_norms_and_with_a_mask_matches_the_reference():
    """`qk_layernorm=False` builds no norms (as upstream); an explicit mask replaces the causal
    one."""
    config = mla_config(qk_layernorm=False, add_bias_linear=False)
    attention = build_mla(config)
    assert attention.q_layernorm is None and attention.kv_layernorm is None
    mask = torch.rand(SEQ, SEQ) < 0.3
    mask.fill_diagonal_(False)
    run_against_reference(config, attention_mask=mask)


def test_flash_backend_pads_the_values_to_the_query_width():
    """FlashAttention needs one head width: the values are padded for it, and the context is
    the unpadded one (CPU's flash kernel takes the padded values like CUDA's)."""
    x = torch.randn(SEQ, BATCH, HIDDEN)
    outputs = {}
    for backend in (AttnBackend.flash, AttnBackend.unfused):
        attention = build_mla(mla_config(attention_backend=backend)).eval()
        outputs[backend] = attention(x)[0]
        assert attention.pad_value is (backend == AttnBackend.flash)
    torch.testing.assert_close(outputs[AttnBackend.flash], outputs[AttnBackend.unfused])


class _CountOps(TorchDispatchMode):
    """Counts the aten operators run under it, by overload."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _saved_bytes_and_ops(config: MLATransformerConfig) -> tuple[dict, int, dict[str, int]]:
    """Gradients of one step, the bytes autograd saved for backward, and the operators run."""
    attention = build_mla(config).train()
    torch.manual_seed(3)
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    with _CountOps() as ops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output, _ = attention(x)
        output.square().sum().backward()
    grads = {"x": x.grad, **{name: p.grad for name, p in attention.named_parameters()}}
    return grads, sum(saved), ops.counts


@pytest.mark.parametrize("recompute", [[], ["mla_up_proj"]], ids=["stored", "up_proj"])
def test_a_residual_is_added_by_the_output_projection(recompute):
    """`forward(..., residual=)` (the layer's residual connection, `adds_residual`) returns the
    attention's output plus the residual, also where the up-projections are recomputed; the
    gradients are those of the separate add."""
    selective = dict(recompute_granularity="selective", recompute_modules=recompute)
    config = mla_config(attention_backend=AttnBackend.flash, **(selective if recompute else {}))
    attention = build_mla(config).train()
    assert attention.adds_residual
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    residual = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    grad = torch.randn(SEQ, BATCH, HIDDEN)
    runs = []
    for joined in (True, False):
        if joined:
            output, bias = attention(x, residual=residual)
        else:
            output, bias = attention(x)
            output = residual + output
        assert bias is None
        output.backward(grad)
        grads = {"x": x.grad, "residual": residual.grad}
        grads.update({name: p.grad for name, p in attention.named_parameters()})
        runs.append((output.detach(), grads))
        attention.zero_grad()
        x.grad = residual.grad = None
    (joined_out, joined_grads), (added_out, added_grads) = runs
    assert torch.equal(joined_out, added_out)
    for name, value in added_grads.items():
        assert torch.equal(joined_grads[name], value), name


def test_mla_up_proj_recompute_is_exact_and_keeps_the_attention_kernel_output():
    """ "mla_up_proj" stores the latents instead of queries, keys and values, recomputes the
    up-projections (one more GEMM each) and not the attention kernel; with "core_attn" the
    kernel runs again too. Gradients are those of the run that stores everything. (The flash
    backend, for a fused kernel on CPU: SDPA's CPU kernel needs one head width.)"""
    selective = dict(recompute_granularity="selective", attention_backend=AttnBackend.flash)
    runs = {
        "plain": _saved_bytes_and_ops(mla_config(attention_backend=AttnBackend.flash)),
        "up_proj": _saved_bytes_and_ops(mla_config(**selective, recompute_modules=["mla_up_proj"])),
        "both": _saved_bytes_and_ops(
            mla_config(**selective, recompute_modules=["mla_up_proj", "core_attn"])
        ),
    }
    plain_grads, plain_bytes, plain_ops = runs["plain"]
    kernel = "aten._scaled_dot_product_flash_attention_for_cpu"
    for name, (grads, saved_bytes, ops) in runs.items():
        for key, grad in plain_grads.items():
            torch.testing.assert_close(grads[key], grad, msg=f"{name} {key}")
        if name == "plain":
            continue
        assert saved_bytes < plain_bytes, name
        assert ops["aten.mm"] == plain_ops["aten.mm"] + 2, name  # q_up and kv_up again
        assert ops[kernel] == (1 if name == "up_proj" else 2), name


def test_mla_state_dict_names_are_megatron_cores():
    with_lora = build_mla(mla_config()).state_dict()
    assert set(with_lora) == {
        "linear_q_down_proj.weight",
        "linear_q_up_proj.weight",
        "linear_kv_down_proj.weight",
        "linear_kv_up_proj.weight",
        "q_layernorm.weight",
        "kv_layernorm.weight",
        "linear_proj.weight",
        "linear_proj.bias",
    }
    assert with_lora["linear_kv_down_proj.weight"].shape == (10 + 4, HIDDEN)
    assert with_lora["linear_q_up_proj.weight"].shape == (HEADS * (6 + 4), 12)
    assert with_lora["linear_kv_up_proj.weight"].shape == (HEADS * (6 + 5), 10)
    assert with_lora["linear_proj.weight"].shape == (HIDDEN, HEADS * 5)
    without = build_mla(mla_config(q_lora_rank=None)).state_dict()
    assert without["linear_q_proj.weight"].shape == (HEADS * (6 + 4), HIDDEN)
    assert "q_layernorm.weight" not in without and "linear_q_down_proj.weight" not in without


def test_gpt_block_spec_builds_mla_layers_and_no_model_rotary_embedding():
    config = mla_config()
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=64,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    assert model.rotary_pos_emb is None
    assert all(isinstance(layer.self_attention, MLASelfAttention) for layer in model.decoder.layers)
    tokens = torch.randint(0, 64, (BATCH, SEQ))
    loss = model(tokens, labels=tokens)
    assert loss.shape == (BATCH, SEQ) and torch.isfinite(loss).all()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_query_groups=2), "multi-latent attention has no query groups"),
        (dict(rotary_interleaved=True), "rotary_interleaved=True"),
        (dict(softmax_scale=0.5), "softmax_scale=0.5"),
        (dict(cache_mla_latents=True), "latent cache"),
        (dict(mla_down_proj_fusion=True), "fused down-projection"),
        (dict(qk_l2_norm=True), "qk_l2_norm=True"),
        (dict(rope_type="mrope"), "rope_type must be one of"),
        (dict(rotary_percent=0.5), "rotary_percent=0.5 applies to rope_type='rope'"),
        (dict(mscale_all_dim=-8.0), "mscale_all_dim=-8.0"),
        (dict(qk_pos_emb_head_dim=5), "must be even"),
        (dict(q_lora_rank=0), "q_lora_rank must be an integer >= 1"),
        (dict(multi_latent_attention=False), "use a TransformerConfig"),
        (dict(rotary_scaling_factor=0.0), "rotary_scaling_factor=0.0 must be > 0"),
    ],
)
def test_bad_mla_configs_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        mla_config(**overrides)


def test_mla_up_proj_recompute_needs_mla():
    with pytest.raises(ValueError, match="'mla_up_proj' recomputes multi-latent attention"):
        TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=4,
            recompute_granularity="selective",
            recompute_modules=["mla_up_proj"],
        )
    with pytest.raises(ValueError, match="build an MLATransformerConfig"):
        TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, multi_latent_attention=True
        )


def test_specs_and_configs_must_agree():
    standard = get_gpt_layer_local_spec().submodules.self_attention
    with pytest.raises(
        ValueError, match="get_gpt_layer_local_spec\\(multi_latent_attention=True\\)"
    ):
        build_module(standard, config=mla_config(), layer_number=1)
    mla = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="needs an MLATransformerConfig"):
        build_module(mla, config=config, layer_number=1)
    no_norms = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=False)
    with pytest.raises(ValueError, match="kv_layernorm and q_layernorm is empty|is empty"):
        build_module(no_norms.submodules.self_attention, config=mla_config(), layer_number=1)
    with pytest.raises(ValueError, match="qk_l2_norm=True with multi_latent_attention"):
        get_gpt_layer_local_spec(multi_latent_attention=True, qk_l2_norm=True)
    with pytest.raises(ValueError, match="Transformer Engine is not built"):
        get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
    attention = build_mla(mla_config())
    with pytest.raises(ValueError, match="rotary_pos_emb=None"):
        attention(torch.randn(SEQ, BATCH, HIDDEN), rotary_pos_emb=torch.zeros(SEQ, 1, 1, 4))
    assert not isinstance(attention, SelfAttention)


@pytest.mark.parametrize("recompute", [None, ["mla_up_proj"]], ids=["stored", "mla_up_proj"])
def test_compiled_mla_layers_match_eager(recompute):
    """`compile_layers` (the `aot_eager` backend, which traces without generating kernels): the
    loss and gradients of eager, with the up-projections recomputed outside the graph too."""
    results = []
    selective = dict(recompute_granularity="selective", recompute_modules=recompute)
    for compile_layers in (False, True):
        config = mla_config(
            num_layers=1,
            compile_layers=compile_layers,
            compile_backend="aot_eager",
            **(selective if recompute else {}),
        )
        torch.manual_seed(0)
        model = GPTModel(
            config,
            get_gpt_decoder_block_spec(config, use_transformer_engine=False),
            vocab_size=64,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
        )
        tokens = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss)
    for compiled, eager in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled, eager)
