"""`tools/convert_hf.py` on DeepSeek-V3 (`DeepseekV3ForCausalLM`) models built locally from small
configs (`hf_models.py`), beyond what `test_convert_hf.py` checks for every architecture.

Parity is fp32 with a maximum absolute logit difference under `PARITY` (1e-4) to transformers:
the model's logits, and each multi-token prediction depth's against transformers' own reading of
the depth's weights (`MtpModel`); a wrong layout (the rotary channel pairing, the depth's input
order) is off by far more. Each variant of the config (rotary channels in halves, no query
compression, plain RoPE, YaRN's coefficients as transformers reads them, ungrouped and top-1
routing, tied embeddings) imports to transformers' logits, exports back to the original tensors
bit for bit (to the same function where the config is derived), and the export imports back to
the same checkpoint bit for bit. Configs and checkpoints this project does not compute are
refused by name, and an import trains on 2 ranks, starting from transformers' losses.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pretrain_gpt
from megatron.core.datasets import MockGPTDataset
from megatron.training.hf_conversion import HF_CONFIG_KEY, HFConversionError
from megatron.training.offline_checkpoint import read_checkpoint
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.tools.hf_models import (
    SEQ_LENGTH,
    TRANSFORMERS_MIN_VERSION,
    hf_config,
    hf_logits,
    load_hf_model,
    load_hf_mtp_model,
    project_model,
    safetensors_of,
    save_hf_model,
)
from tests.unit_tests.training.checkpoint_checks import edit_common
from tests.unit_tests.training.log_capture import capture_training_log

pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN_VERSION)
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "tools") not in sys.path:  # the tool is a script: import it by path
    sys.path.insert(0, str(REPO / "tools"))
convert_hf = importlib.import_module("convert_hf")

PARITY = 1e-4
"""The largest max-abs logit difference to transformers accepted (fp32)."""

NAME = "deepseek_v3"


def convert(*argv: Any) -> dict[str, Any]:
    return convert_hf.main([str(arg) for arg in argv])


def tokens_for(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ_LENGTH), generator=torch.Generator().manual_seed(seed))


def checkpoint_model(flags: list[str], path: str) -> torch.nn.Module:
    model = project_model(flags)
    model.load_state_dict(read_checkpoint(path, lambda nesting: nesting[0] == "model")["model"])
    return model


def checkpoint_state(path: str) -> dict[str, torch.Tensor]:
    return read_checkpoint(path, lambda nesting: nesting[0] == "model")["model"]


def mtp_logits(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each prediction depth's [b, s, vocab] logits of this project's model (depth k's position
    i sees token i + k)."""
    with torch.no_grad():
        hidden = model.decoder(model.embedding(tokens, None))
        depths = model.mtp(tokens, None, hidden, None, None, model.embedding)
        layer = model.output_layer
        output = model.embedding.word_embeddings.weight if layer is None else layer.weight
        return [F.linear(states, output).transpose(0, 1) for states in depths]


def hf_mtp_logits(directory: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The same from transformers' `MtpModel`, over the positions whose tokens exist (depth k:
    the first s - k), its positions shifted with the tokens as its drafting loop does."""
    main, mtp = load_hf_mtp_model(directory)
    positions = torch.arange(tokens.shape[1])[None]
    logits = []
    with torch.no_grad():
        hidden = main.model(tokens).last_hidden_state
        for depth in range(1, len(mtp.layers) + 1):
            hidden = mtp.forward_layer(
                depth - 1, hidden[:, :-1], positions[:, depth:], None, input_ids=tokens[:, depth:]
            )
            logits.append(mtp.shared_head(hidden))  # the model's lm_head
    return logits


@pytest.mark.parametrize("depths", [1, 2])
def test_multi_token_prediction_matches_transformers(depths, tmp_path):
    """Every depth's logits are those of transformers' `MtpModel` reading the same directory;
    the depth's input halves exchanged (the hidden state first) are far off."""
    save_hf_model(NAME, tmp_path / "hf", num_nextn_predict_layers=depths)
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    flags = summary["flags"]
    assert flags[flags.index("--mtp-num-layers") + 1] == str(depths)
    tokens = tokens_for(96)
    expected = hf_mtp_logits(tmp_path / "hf", tokens)
    model = checkpoint_model(flags, summary["path"])
    for depth, (ours, theirs) in enumerate(zip(mtp_logits(model, tokens), expected), start=1):
        difference = (ours[:, : tokens.shape[1] - depth] - theirs).abs().max().item()
        print(f"depth {depth}: max abs logit difference to transformers {difference:.3g}")
        assert difference < PARITY

    projection = model.mtp.layers[0].eh_proj.weight
    with torch.no_grad():
        projection.copy_(torch.cat(projection.chunk(2, dim=1)[::-1], dim=1))
    off = mtp_logits(model, tokens)[0][:, : tokens.shape[1] - 1] - expected[0]
    assert off.abs().max().item() > 100 * PARITY


def test_weights_without_multi_token_prediction_import_without_it(tmp_path, capsys):
    """transformers' own `save_pretrained` leaves the depths out though the config states one:
    the import builds none (and says so), and the export keeps the config as it was."""
    save_hf_model(NAME, tmp_path / "hf", mtp_layers=False)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"]
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    assert "--mtp-num-layers" not in summary["flags"]
    assert "the weights hold no multi-token prediction layer" in capsys.readouterr().out
    assert not any(name.startswith("mtp.") for name in checkpoint_state(summary["path"]))

    convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() != ""
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == 1
    original = safetensors_of(tmp_path / "hf")
    assert sorted(safetensors_of(tmp_path / "out")) == sorted(original)


VARIANTS: dict[str, dict[str, Any]] = {
    # transformers' rotate-half pairing of the rotated channels (permuted on import).
    "rope_halves": dict(rope_interleave=False),
    # Queries projected from the hidden state (linear_q_proj), plain RoPE.
    "no_q_lora": dict(q_lora_rank=None, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    # transformers scales the rotated channels by yarn_mscale(factor) when mscale_all_dim is 0,
    # whatever mscale says (--mscale 1).
    "mscale_alone": dict(
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707,
                             original_max_position_embeddings=64)
    ),
    # One group (no group limit) and a routed scaling factor of 1 (no --moe-router-topk-...).
    "ungrouped": dict(n_group=1, topk_group=1, routed_scaling_factor=1.0),
    # One expert per token: its sigmoid score, not renormalised.
    "top1": dict(num_experts_per_tok=1, norm_topk_prob=False, n_group=1, topk_group=1),
    # Tied embeddings: the depth's shared_head.head is the embedding.
    "tied": dict(tie_word_embeddings=True),
}  # fmt: skip

VARIANT_FLAGS = {
    "rope_halves": ["--rope-type", "yarn"],
    "no_q_lora": ["--rope-type", "rope"],
    "mscale_alone": ["--mscale", "1.0", "--mscale-all-dim", "0.0"],
    "ungrouped": [],
    "top1": ["--moe-router-topk", "1"],
    "tied": [],
}
"""Flags each variant's import must print (in this order)."""


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_round_trip_and_match_transformers(variant, tmp_path):
    model = save_hf_model(NAME, tmp_path / "hf", **VARIANTS[variant])
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    flags = summary["flags"]
    line = " ".join(flags)
    assert " ".join(VARIANT_FLAGS[variant]) in line
    assert ("--q-lora-rank" in flags) == (variant != "no_q_lora")
    assert ("--moe-router-num-groups" in flags) == (variant not in ("ungrouped", "top1"))
    assert ("--moe-router-topk-scaling-factor" in flags) == (variant != "ungrouped")
    assert ("--untie-embeddings-and-output-weights" in flags) == (variant != "tied")

    tokens = tokens_for(96)
    expected = hf_logits(model, tokens)
    ours = checkpoint_model(flags, summary["path"])
    with torch.no_grad():
        difference = (ours(tokens) - expected).abs().max().item()
    print(f"{variant}: max abs logit difference to transformers {difference:.3g}")
    assert difference < PARITY
    (depth,) = mtp_logits(ours, tokens)
    (expected_depth,) = hf_mtp_logits(tmp_path / "hf", tokens)
    assert (depth[:, :-1] - expected_depth).abs().max().item() < PARITY

    convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    original, exported = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    reimported = convert("import", "--hf-dir", tmp_path / "out", "--save", tmp_path / "again")
    again, first = checkpoint_state(reimported["path"]), checkpoint_state(summary["path"])
    assert sorted(again) == sorted(first)
    for name, tensor in first.items():
        assert torch.equal(again[name], tensor), name

    # Without the recorded config, the one derived from the flags computes the same function
    # (with the rotated channels in adjacent pairs, rope_interleave true).
    edit_common(summary["path"], lambda common: common.pop(HF_CONFIG_KEY))
    convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "derived")
    derived = json.loads((tmp_path / "derived" / "config.json").read_text())
    assert derived["rope_interleave"] is True
    derived_logits = hf_logits(load_hf_model(tmp_path / "derived"), tokens)
    assert (derived_logits - expected).abs().max().item() < PARITY


def test_rotary_channels_in_halves_are_not_adjacent_pairs(tmp_path):
    """The weights of a `rope_interleave` false model read as adjacent pairs (the config edited)
    compute another function: the permutation the import applies is needed."""
    model = save_hf_model(NAME, tmp_path / "hf", rope_interleave=False)
    config_file = tmp_path / "hf" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "rope_interleave": True}))
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    tokens = tokens_for(96)
    with torch.no_grad():
        off = checkpoint_model(summary["flags"], summary["path"])(tokens) - hf_logits(model, tokens)
    assert off.abs().max().item() > 100 * PARITY


def _config_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _yarn(**fields: Any) -> dict[str, Any]:
    base = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.9, mscale_all_dim=0.7,
                original_max_position_embeddings=64)  # fmt: skip
    return {"rope_parameters": {**base, **fields}}


CONFIG_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "fp8": (
        {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                 "weight_block_size": [128, 128]}},
        "DeepseekV3ForCausalLM with quantization_config (quant_method 'fp8')",
    ),
    "kv_heads": ({"num_key_value_heads": 2}, "num_key_value_heads 2 and num_attention_heads 4"),
    "epsilon": (
        {"rms_norm_eps": 1e-5},
        "rms_norm_eps 1e-05: transformers normalises the query and key/value latents with "
        "epsilon 1e-06",
    ),
    "group_score": (
        {"num_experts_per_tok": 2},
        "transformers scores each group by its best 2 experts, this project by its best "
        "num_experts_per_tok // topk_group (1)",
    ),
    "unnormalised": ({"norm_topk_prob": False}, "norm_topk_prob False and num_experts_per_tok 4"),
    "scaling": ({"routed_scaling_factor": 0}, "routed_scaling_factor 0: a positive number"),
    "mscale_all_dim_alone": (
        _yarn(mscale=None), "mscale_all_dim 0.7 and mscale None: transformers then scales"
    ),
    "truncate": (_yarn(truncate=False), "yarn rope_scaling with truncate false"),
    "attention_factor": (_yarn(attention_factor=1.5), "yarn rope_scaling attention_factor 1.5"),
    "context": (
        {"max_position_embeddings": 512},
        "yarn rope_scaling factor 4.0, but max_position_embeddings 512 / "
        "original_max_position_embeddings 64 is 8",
    ),
    "rope_kind": (
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        "DeepseekV3ForCausalLM with rope_type 'linear'",
    ),
    "all_dense": (
        {"first_k_dense_replace": 3}, "first_k_dense_replace 3 leaves none of its 3 layers"
    ),
    "scoring": (
        {"scoring_func": "softmax", "topk_method": "greedy"},
        "scoring_func 'softmax' (transformers computes 'sigmoid'); topk_method 'greedy'",
    ),
    "bias": ({"attention_bias": True}, "attention_bias true"),
    "interleave": ({"rope_interleave": "yes"}, "rope_interleave is 'yes'"),
    "aliases": ({"num_local_experts": 16}, "states n_routed_experts 8 and num_local_experts 16"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_config_refusals(case, tmp_path):
    fields, message = CONFIG_REFUSALS[case]
    directory = _config_dir(tmp_path, {**hf_config(NAME).to_dict(), **fields})
    with pytest.raises(HFConversionError, match=re.escape(message)):
        convert("import", "--hf-dir", directory, "--save", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("deepseek") / "hf"
    save_hf_model(NAME, directory)
    return directory


def _edited_copy(source: Path, target: Path, name: str, tensor: torch.Tensor) -> Path:
    """A copy of the model directory `source` with the tensor `name` replaced."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    file = target / index["weight_map"][name]
    tensors = load_file(file)
    tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})
    return target


def test_weight_refusals(deepseek_dir, tmp_path):
    """A depth whose copy of the embedding differs from the model's (this project's depths share
    it), and a config stating more depths than the weights hold."""
    embedding = safetensors_of(deepseek_dir)["model.embed_tokens.weight"]
    copy = _edited_copy(
        deepseek_dir, tmp_path / "copy", "model.layers.3.embed_tokens.weight", embedding + 1
    )
    with pytest.raises(HFConversionError, match=re.escape(
        "model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight"
    )):  # fmt: skip
        convert("import", "--hf-dir", copy, "--save", tmp_path / "ckpt")

    more = tmp_path / "more"
    shutil.copytree(deepseek_dir, more)
    config = json.loads((more / "config.json").read_text())
    (more / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(HFConversionError, match=re.escape(
        "hold only some of the multi-token prediction layers (missing ['model.layers.4.*'])"
    )):  # fmt: skip
        convert("import", "--hf-dir", more, "--save", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


EXPORT_REFUSALS = {
    "group_topk": (
        dict(moe_router_group_topk=1), "--moe-router-topk 4 // --moe-router-group-topk 1"
    ),
    "mscale": (dict(mscale=0.5, mscale_all_dim=0.0), "--mscale 0.5 with --mscale-all-dim 0.0"),
    "softmax": (dict(moe_router_score_function="softmax"), "--moe-router-score-function softmax"),
    "dense_last": (dict(moe_layer_freq=[1, 1, 0]), "--moe-layer-freq [1, 1, 0]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EXPORT_REFUSALS))
def test_export_refuses_models_deepseek_v3_does_not_compute(case, deepseek_dir, tmp_path):
    """A checkpoint without a recorded config whose flags no DeepSeek-V3 config computes."""
    summary = convert("import", "--hf-dir", deepseek_dir, "--save", tmp_path / "ckpt")
    changes, message = EXPORT_REFUSALS[case]

    def edit(common: dict[str, Any]) -> None:
        common.pop(HF_CONFIG_KEY)
        common["args"].update(changes)

    edit_common(summary["path"], edit)
    with pytest.raises(HFConversionError, match=re.escape(message)):
        convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _train(flags: list[str]) -> dict[str, Any]:
    with capture_training_log() as log:
        history = pretrain_gpt.main([*flags, "--distributed-backend", dist.get_backend()])
    return {"losses": history.losses, "log": log}


def test_pretrain_gpt_trains_an_import_on_2_ranks(tmp_path):
    """`pretrain_gpt.py --load --finetune` on 2 ranks at --expert-model-parallel-size 2: the
    first iteration reports transformers' loss and its depth's (`MtpModel`) on the same batch;
    three iterations train the weights and the expert bias, and the result exports to a
    directory transformers loads."""
    model = save_hf_model(NAME, tmp_path / "hf")
    summary = convert(
        "import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt", "--target-ep", 2
    )
    flags = [
        *summary["flags"], "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
        "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
        "--load", tmp_path / "ckpt", "--finetune", "--save", tmp_path / "trained",
        "--save-interval", "3",
    ]  # fmt: skip
    results = run_distributed(_train, 2, [str(flag) for flag in flags])

    samples = [MockGPTDataset(2, 16, model.config.vocab_size, seed=1234)[i] for i in range(2)]
    tokens = torch.stack([sample["tokens"] for sample in samples])
    labels = torch.stack([sample["labels"] for sample in samples])
    expected = F.cross_entropy(hf_logits(model, tokens).flatten(0, 1), labels.flatten())
    (depth_logits,) = hf_mtp_logits(tmp_path / "hf", tokens)
    expected_mtp = F.cross_entropy(depth_logits.flatten(0, 1), labels[:, 1:].flatten())
    assert any("loaded checkpoint of iteration 0" in line for r in results for line in r["log"])
    for result in results:
        losses = result["losses"]
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(list(step.values()))).all()
                                         for step in losses)  # fmt: skip
        torch.testing.assert_close(torch.tensor(losses[0]["lm loss"]), expected)
        torch.testing.assert_close(torch.tensor(losses[0]["mtp_1 loss"]), expected_mtp)

    convert("export", "--load", tmp_path / "trained", "--hf-dir", tmp_path / "out")
    original, trained = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "out")
    assert sorted(trained) == sorted(original)
    for name in ("mlp.gate.e_score_correction_bias", "mlp.gate.weight"):
        name = f"model.layers.1.{name}"  # an MoE layer's router: its bias trains too
        assert not torch.equal(trained[name], original[name]), name
    tokens = tokens_for(96)
    assert torch.isfinite(hf_logits(load_hf_model(tmp_path / "out"), tokens)).all()
