"""Multi-token prediction (MTP): the depths' losses and gradients equal a plain-torch reference
written from DeepSeek-V3's equations and Megatron-core 0.19.2 itself on the same weights (golden
data made by `fixtures/make_upstream_mtp_fixture.py`), the returned loss stays the next-token
one, full recompute and meta-device builds change nothing, a depth's layer is the decoder's last
layer's kind (MoE included), tensor and sequence parallelism (2 gloo ranks) give the unsplit
model's losses and gradients, bad configurations are refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.models.gpt import (
    GPTModel,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    model_parallel_cuda_manual_seed,
    named_tensor_parallel_layouts,
)
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    get_mtp_loss_logging_helper,
    roll_tensor,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests import upstream_parity
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.models.fixtures import mtp_cases
from tests.unit_tests.models.test_gpt_tensor_parallel import _gather_full

FIXTURE = Path(__file__).with_name("fixtures") / "upstream_mtp.pt"


@pytest.fixture(autouse=True)
def clean_state():
    """Each test starts and ends with nothing recorded and the default loss scale (1)."""
    get_mtp_loss_logging_helper().clear()
    yield
    get_mtp_loss_logging_helper().clear()
    MTPLossAutoScaler.set_loss_scale(torch.ones(()))


def case_config(case: dict, **overrides) -> TransformerConfig:
    """The case's config without dropout (upstream's fixtures ran without it)."""
    no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    return upstream_parity.case_config(case["config"], **no_dropout, **overrides)


def build(case: dict, seed: int = 0, **overrides) -> GPTModel:
    config = case_config(case, **overrides)
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(seed)
    return GPTModel(
        config,
        spec,
        vocab_size=case["vocab"],
        max_sequence_length=case["seq"],
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
        **case["model"],
    )


def run(model: GPTModel, batch: dict) -> torch.Tensor:
    return model(
        batch["tokens"],
        batch["position_ids"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


# --- Megatron-core 0.19.2 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden() -> dict:
    return torch.load(FIXTURE, weights_only=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", sorted(mtp_cases.CASES))
def test_matches_megatron_core(golden, name, device):
    """Upstream's weights load under the same names; the returned loss, each depth's logged
    loss and every gradient of the case's objective are upstream's."""
    assert golden["version"] == "0.19.2"
    case, expected = mtp_cases.CASES[name], golden[name]
    model = build(case).train()
    assert sorted(model.state_dict()) == sorted(expected["state_dict"])
    model.load_state_dict(expected["state_dict"])
    model.to(device)
    expected = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in expected.items()}

    loss = run(model, expected)
    torch.testing.assert_close(loss, expected["loss"])
    depths = model.config.mtp_num_layers
    logged = get_mtp_loss_logging_helper().report(depths, num_microbatches=1)
    assert list(logged) == [f"mtp_{depth} loss" for depth in range(1, depths + 1)]
    torch.testing.assert_close(torch.tensor(list(logged.values())), expected["mtp_losses"].cpu())

    per_token = model.config.calculate_per_token_loss
    mtp_cases.objective(loss, expected["loss_mask"], per_token).backward()
    for param_name, grad in grads(model).items():
        torch.testing.assert_close(grad.cpu(), expected["grads"][param_name].cpu(), msg=param_name)


# --- DeepSeek-V3's equations in plain torch ---------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def shifted(x: torch.Tensor, k: int) -> torch.Tensor:
    """Position i holds x's position i + k; the last k positions hold zeros."""
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], dim=1)


def reference_objective(model: GPTModel, batch: dict, per_token: bool):
    """The training objective of an MTP model, from the DeepSeek-V3 report: with h_0 the
    decoder's output and D depths,

        h_k(i) = RMSNorm_k(T_k(W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1}(i))]))
        L_k = mean over unmasked i of CE(Out h_k(i), t_{i+k+1})

    and the objective L_main + f / D * sum_k L_k (with per-token losses: sums, depth k's
    weighted by N_0 / N_k). The transformer layers T_k and the decoder are the model's modules;
    everything else is written out here. Returns (objective, main per-token loss, [L_k])."""
    config = model.config
    eps = config.layernorm_epsilon
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    seq = tokens.shape[1]
    rotary = model.rotary_pos_emb(seq, device=tokens.device)
    out_weight = model.output_layer.weight
    embedding_table = model.embedding.word_embeddings.weight

    def cross_entropy(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = hidden.transpose(0, 1) @ out_weight.t()  # [b, s, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(
            targets.shape
        )

    hidden = model.decoder(model.embedding(tokens), rotary_pos_emb=rotary)
    main = cross_entropy(hidden, labels)
    total = (main * mask).sum()
    main_tokens = mask.sum()
    objective = total if per_token else total / main_tokens
    depth_losses = []
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for k, layer in enumerate(model.mtp.layers, start=1):
        embedded = F.embedding(shifted(tokens, k), embedding_table).transpose(0, 1)
        combined = torch.cat(
            [
                rms_norm(embedded, layer.enorm.weight, eps),
                rms_norm(hidden, layer.hnorm.weight, eps),
            ],
            dim=-1,
        )
        projected = combined @ layer.eh_proj.weight.t()
        hidden = rms_norm(
            layer.transformer_layer(projected, None, rotary)[0], layer.final_layernorm.weight, eps
        )
        depth_mask = shifted(mask, k)
        depth_sum = (cross_entropy(hidden, shifted(labels, k)) * depth_mask).sum()
        depth_tokens = depth_mask.sum()
        depth_losses.append(depth_sum / depth_tokens)
        if per_token:
            objective = objective + scale * depth_sum * main_tokens / depth_tokens
        else:
            objective = objective + scale * depth_sum / depth_tokens
    return objective, main, depth_losses


@pytest.mark.parametrize("per_token", [False, True])
def test_matches_the_deepseek_v3_equations(per_token):
    case = mtp_cases.CASES["rope_swiglu_untied_2_depths"]
    model = build(case, seed=3, calculate_per_token_loss=per_token).train()
    mtp_cases.perturb_norms(model, seed=4)
    reference = copy.deepcopy(model)
    batch = mtp_cases.batch(case)

    loss = run(model, batch)
    mtp_cases.objective(loss, batch["loss_mask"], per_token).backward()
    objective, main, depth_losses = reference_objective(reference, batch, per_token)
    objective.backward()

    # The returned loss is the next-token one alone; the depths' losses are logged.
    torch.testing.assert_close(loss, main)
    logged = get_mtp_loss_logging_helper().report(2, num_microbatches=1)
    torch.testing.assert_close(list(logged.values()), [v.item() for v in depth_losses])
    expected = grads(reference)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected[name], msg=name)
    # Each depth's projection learns from its loss alone, the first depth's from both.
    assert all(layer.eh_proj.weight.grad.abs().sum() > 0 for layer in model.mtp.layers)


def test_the_loss_scale_multiplies_the_depths_gradient_only():
    """`MTPLossAutoScaler.set_loss_scale` (the training loop's loss scale over microbatches)
    scales what the depths' losses contribute: the MTP-only weights' gradients scale with it,
    the returned loss does not."""
    case = mtp_cases.CASES["rope_swiglu_untied_2_depths"]
    batch = mtp_cases.batch(case)
    results = []
    for scale in (1.0, 0.25):
        MTPLossAutoScaler.set_loss_scale(torch.tensor(scale))
        model = build(case, seed=5)
        loss = run(model, batch)
        loss.mean().backward()
        results.append((loss.detach(), model.mtp.layers[1].eh_proj.weight.grad))
    (loss_1, grad_1), (loss_quarter, grad_quarter) = results
    torch.testing.assert_close(loss_quarter, loss_1)
    torch.testing.assert_close(grad_quarter, grad_1 * 0.25)


def test_returned_loss_is_the_model_without_mtp_and_eval_records_nothing():
    case = mtp_cases.CASES["learned_tied_per_token_1_depth"]
    batch = mtp_cases.batch(case)
    with_mtp = build(case, seed=7).eval()
    config = case_config(case, mtp_num_layers=None)
    without = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=case["vocab"],
        max_sequence_length=case["seq"],
        **case["model"],
    ).eval()
    state = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    without.load_state_dict(state)
    torch.testing.assert_close(run(with_mtp, batch), run(without, batch))
    # Without labels the depths do not run: the logits are the plain model's.
    torch.testing.assert_close(with_mtp(batch["tokens"]), without(batch["tokens"]))
    assert get_mtp_loss_logging_helper().report(1, num_microbatches=1) == {"mtp_1 loss": 0.0}


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_gives_the_same_gradients(method):
    case = mtp_cases.CASES["rope_swiglu_untied_2_depths"]
    batch = mtp_cases.batch(case)
    results = []
    for fields in (
        {},
        dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=1),
    ):
        model = build(case, seed=9, **fields).train()
        loss = run(model, batch)
        mtp_cases.objective(loss, batch["loss_mask"], False).backward()
        results.append(grads(model))
    for name, grad in results[1].items():
        torch.testing.assert_close(grad, results[0][name], msg=name)


def test_meta_build_then_reset_parameters_equals_a_normal_build():
    case = mtp_cases.CASES["rope_swiglu_untied_2_depths"]
    eager = build(case, seed=1234)
    with torch.device("meta"):
        deferred = build(case, seed=1234)
    assert all(p.is_meta for p in deferred.mtp.parameters())
    deferred.to_empty(device="cpu")
    torch.manual_seed(1234)
    for module in deferred.modules():
        if hasattr(module, "reset_parameters") and module is not deferred:
            module.reset_parameters()
    assert {k: v.shape for k, v in deferred.state_dict().items()} == {
        k: v.shape for k, v in eager.state_dict().items()
    }
    for depth in deferred.mtp.layers:
        assert torch.isfinite(depth.eh_proj.weight).all() and depth.eh_proj.weight.std() > 0
        torch.testing.assert_close(depth.enorm.weight, torch.ones_like(depth.enorm.weight))


def test_roll_tensor_shifts_to_the_front_and_zeroes_the_end():
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert roll_tensor(x).tolist() == [[2, 3, 4, 0], [6, 7, 8, 0]]
    assert x.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]  # not in place
    assert roll_tensor(x, shifts=-3).tolist() == [[4, 0, 0, 0], [8, 0, 0, 0]]
    assert roll_tensor(x, shifts=2).tolist() == [[0, 0, 1, 2], [0, 0, 5, 6]]
    assert roll_tensor(x.t(), shifts=-1, dims=0).tolist() == [[2, 6], [3, 7], [4, 8], [0, 0]]


def test_bad_configurations_are_refused():
    case = mtp_cases.CASES["rope_swiglu_untied_2_depths"]
    with pytest.raises(ValueError, match="mtp_num_layers must be an integer >= 1"):
        case_config(case, mtp_num_layers=0)
    config = case_config(case)
    spec = get_gpt_layer_local_spec()
    with pytest.raises(ValueError, match="mtp_block_spec is None"):
        GPTModel(config, spec, vocab_size=64, max_sequence_length=8)
    plain = case_config(case, mtp_num_layers=None)
    assert get_gpt_mtp_block_spec(plain, spec, use_transformer_engine=False) is None
    with pytest.raises(ValueError, match="mtp_block_spec is given"):
        GPTModel(
            plain,
            spec,
            vocab_size=64,
            max_sequence_length=8,
            mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
        )
    with pytest.raises(ValueError, match="they live on the last pipeline stage"):
        GPTModel(
            config,
            spec,
            vocab_size=64,
            max_sequence_length=8,
            post_process=False,
            mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
        )
    model = build(case)
    decoder_input = torch.zeros(8, 2, 32)
    with pytest.raises(ValueError, match="needs input_ids, not decoder_input"):
        model(None, decoder_input=decoder_input, labels=torch.zeros(2, 8, dtype=torch.long))


def test_the_depths_live_on_the_last_pipeline_chunk():
    """As Megatron-core places them by default: the last stage's last virtual stage."""
    case = mtp_cases.CASES["rope_swiglu_untied_2_depths"]
    spec = get_gpt_layer_local_spec()
    staged = case_config(case, pipeline_model_parallel_size=2, num_layers=4)
    virtual = case_config(
        case, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4
    )
    placements = [
        (staged, 0, None, False),
        (staged, 1, None, True),
        (virtual, 1, 0, False),
        (virtual, 0, 1, False),
        (virtual, 1, 1, True),
    ]
    for config, pp_rank, vp_stage, built in placements:
        block = get_gpt_mtp_block_spec(
            config, spec, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank
        )
        assert (block is not None) == built, (pp_rank, vp_stage)
    # One stage (pp_rank None: parallel_state's, or 0 without it) holds them.
    assert get_gpt_mtp_block_spec(case_config(case), spec, use_transformer_engine=False)
    # With virtual stages, no chunk is "the only one": the caller must say which it builds.
    with pytest.raises(ValueError, match="pass the chunk's vp_stage"):
        get_gpt_mtp_block_spec(virtual, spec, use_transformer_engine=False, pp_rank=1)


@pytest.mark.parametrize(("freq", "mtp_is_moe"), [([0, 1], True), ([1, 0], False)])
def test_a_depths_layer_is_like_the_decoders_last_and_records_moe_metrics_after_it(
    freq, mtp_is_moe
):
    """The depth's layer has the decoder's last layer's spec; an MoE one records its auxiliary
    loss as layer num_layers + 1 (Megatron-core's numbering), after the decoder's."""
    destroy_moe_metrics_tracker()
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        num_moe_experts=4,
        moe_ffn_hidden_size=16,
        moe_aux_loss_coeff=0.01,
        moe_layer_freq=freq,
        mtp_num_layers=1,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    torch.manual_seed(0)
    model = GPTModel(
        config,
        spec,
        vocab_size=64,
        max_sequence_length=8,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    ).train()
    assert model.mtp.layers[0].transformer_layer.is_moe_layer is mtp_is_moe
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).mean().backward()
    recorded = get_moe_metrics_tracker().metrics["load_balancing_loss"]
    assert recorded.shape == (3,)
    assert (recorded > 0).tolist() == [bool(v) for v in freq] + [mtp_is_moe]
    if mtp_is_moe:
        # Its router learns from the depth's loss.
        assert model.mtp.layers[0].transformer_layer.mlp.router.weight.grad.abs().sum() > 0
    destroy_moe_metrics_tracker()


# --- tensor and sequence parallelism ----------------------------------------------------------


def _tensor_parallel_matches_tp1(name: str, sequence_parallel: bool) -> None:
    """On 2 ranks: the model split over both (tensor parallelism, sequence parallelism if
    asked) gives the TP 1 model's loss, depth losses and (gathered) gradients."""
    case = mtp_cases.CASES[name]
    device = current_device()
    batch = {key: t.to(device) for key, t in mtp_cases.batch(case).items()}
    group = dist.new_group([0, 1])
    model_parallel_cuda_manual_seed(1234, tp_rank=group.rank())
    per_token = case["config"]["calculate_per_token_loss"]
    results = []
    for tp, pg_collection in ((1, None), (2, ProcessGroupCollection(tp=group))):
        fields = dict(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1)
        config = case_config(case, seq_length=case["seq"], **fields)
        spec = get_gpt_layer_local_spec()
        torch.manual_seed(21)
        model = GPTModel(
            config,
            spec,
            vocab_size=case["vocab"],
            max_sequence_length=case["seq"],
            mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
            pg_collection=pg_collection,
            **case["model"],
        ).train()
        mtp_cases.perturb_norms(model, seed=22)
        model.to(device)
        loss = run(model, batch)
        mtp_cases.objective(loss, batch["loss_mask"], per_token).backward()
        logged = get_mtp_loss_logging_helper().report(config.mtp_num_layers, 1, device)
        layouts = named_tensor_parallel_layouts(model) if tp > 1 else {}
        grads = {
            name: _gather_full(p.grad, layouts[name], group) if name in layouts else p.grad
            for name, p in model.named_parameters()
        }
        results.append((loss.detach(), logged, grads))
    (expected_loss, expected_logged, expected_grads), (loss, logged, grads) = results
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(logged, expected_logged)
    assert grads.keys() == expected_grads.keys()
    for param_name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[param_name], msg=param_name)


@pytest.mark.parametrize("name", sorted(mtp_cases.CASES))
def test_tensor_and_sequence_parallel_match_tp1(name):
    for sequence_parallel in (False, True):
        run_distributed(_tensor_parallel_matches_tp1, 2, name, sequence_parallel)
