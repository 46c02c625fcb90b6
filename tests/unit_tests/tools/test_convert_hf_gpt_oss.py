"""`tools/convert_hf.py` on tiny random gpt-oss models (`GptOssForCausalLM`) saved locally by
transformers (no download): sinks, sliding windows on the layers `layer_types` marks, YaRN RoPE
past its original context, attention biases, the router's bias and the experts' clamped GLU with
its interleaved gate/up columns and biases; and on a Llama with YaRN RoPE.

`import` gives flags that `pretrain_gpt.py`'s parser turns into the recorded arguments, and a
checkpoint whose model computes transformers' logits (fp32, transformers' eager attention and
experts; max abs difference < 1e-4, while YaRN's band rounded, no concentration factor, another
window or no GLU offset are off by far more), also with the experts on 2 expert-parallel ranks;
`pretrain_gpt.py --load --finetune` starts from transformers' loss; `export` gives back the
original tensors bit for bit in a directory transformers loads to the same logits, with the
recorded config or one derived from the flags; what gpt-oss fields this project does not compute
are refused by name.
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
import torch.nn.functional as F

from megatron.core.datasets import MockGPTDataset
from megatron.training.checkpoint_layout import COMMON_FILENAME
from megatron.training.hf_conversion import HF_CONFIG_KEY, HFConversionError
from megatron.training.hf_conversion.config import (
    model_args_from_hf_config,
    model_flags,
    vocab_args,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.tools.hf_models import (
    SEQ_LENGTH,
    TRANSFORMERS_MIN_VERSION,
    hf_config,
    hf_logits,
    parse_flags,
    project_model,
    safetensors_of,
    save_hf_model,
)
from tests.unit_tests.tools.test_convert_hf import (
    PARITY,
    _expert_parallel_logits,
    _finetune,
    checkpoint_logits,
    tokens_for,
)
from tests.unit_tests.training.checkpoint_checks import edit_common

transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN_VERSION)
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))
convert_hf = importlib.import_module("convert_hf")

YARN = dict(
    rope_type="yarn",
    factor=8.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=32,
)
"""YaRN over 8 times a 32-position original context (the test sequences are 256 long), its band
unrounded as gpt-oss's (`rope_scaling`, which transformers 5 reads as `rope_parameters`)."""

GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # heads wider than hidden / heads: --kv-channels
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=96,
    max_position_embeddings=SEQ_LENGTH,
    sliding_window=8,  # each query sees itself and 7 before it: --window-size 7,0
    swiglu_limit=1.0,  # low enough to clamp many of the wide weights' activations
    rope_scaling=YARN,
    rope_theta=1000.0,  # low enough for every channel pair to turn
    tie_word_embeddings=False,
)
"""The test gpt-oss: windows on layers 1 and 3 (transformers' default `layer_types`)."""


def gpt_oss_config(**overrides: Any):
    return transformers.GptOssConfig(
        **{**GPT_OSS, **overrides}, architectures=["GptOssForCausalLM"]
    )


def save_gpt_oss(directory: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Saves a random test gpt-oss into `directory` (weights drawn wide, as `hf_models` draws
    them, sinks and biases included); returns it with transformers' eager attention."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        gpt_oss_config(**overrides), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.2)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
    model.save_pretrained(directory)
    return model


def convert(*argv: Any) -> dict[str, Any]:
    return convert_hf.main([str(arg) for arg in argv])


def load_hf_model(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gpt_oss")
    model = save_gpt_oss(root / "hf")
    summary = convert("import", "--hf-dir", root / "hf", "--save", root / "ckpt")
    return {"model": model, "root": root, **summary}


def test_import_gives_gpt_oss_flags_and_records_them(imported):
    flags = imported["flags"]
    for expected in (
        "--position-embedding-type yarn --rotary-base 1000 --rotary-scaling-factor 8.0 "
        "--yarn-original-max-position-embeddings 32 --yarn-beta-fast 32.0 --yarn-beta-slow 1.0 "
        "--mscale 1.0 --mscale-all-dim 0.0 --no-yarn-correction-range-round-to-int",
        "--kv-channels 32",
        "--num-experts 4 --moe-ffn-hidden-size 48 --moe-router-topk 2",
        "--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 1.0 "
        "--softmax-type learnable --window-size 7,0 --window-attn-skip-freq 2",
    ):
        assert expected in " ".join(flags), flags
    assert "--disable-bias-linear" not in flags and "--swiglu" not in flags
    parsed = parse_flags(flags)
    for name, value in imported["args"].items():
        assert getattr(parsed, name) == value, name
    common = torch.load(Path(imported["path"]) / COMMON_FILENAME, weights_only=False)
    assert common["args"] == imported["args"]
    assert common[HF_CONFIG_KEY] == json.loads(
        (imported["root"] / "hf" / "config.json").read_text()
    )


def test_logits_match_transformers(imported):
    tokens = tokens_for(GPT_OSS["vocab_size"])
    expected = hf_logits(imported["model"], tokens)
    logits = checkpoint_logits(imported["flags"], imported["path"], tokens)
    difference = (logits - expected).abs().max().item()
    print(f"gpt-oss: max abs logit difference to transformers {difference:.3g}")
    assert difference < PARITY

    # The tolerance tells the parts apart: YaRN's band rounded, no concentration factor (a
    # ratio of 1), another window, or the GLU without its offset move the logits by far more.
    flags = imported["flags"]
    for wrong in (
        ["--yarn-correction-range-round-to-int"],
        ["--mscale-all-dim", "1.0"],
        ["--window-size", "3,0"],
        ["--glu-linear-offset", "0.0"],
    ):
        off = checkpoint_logits([*flags, *wrong], imported["path"], tokens) - expected
        assert off.abs().max().item() > 100 * PARITY, wrong


def test_export_gives_back_the_original(imported, tmp_path):
    original = imported["root"] / "hf"
    summary = convert("export", "--load", imported["root"] / "ckpt", "--hf-dir", tmp_path / "out")
    assert summary["architecture"] == "GptOssForCausalLM"
    exported, tensors = safetensors_of(tmp_path / "out"), safetensors_of(original)
    assert sorted(exported) == sorted(tensors)
    for name, tensor in tensors.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    tokens = tokens_for(GPT_OSS["vocab_size"])
    reloaded = load_hf_model(tmp_path / "out")
    assert torch.equal(hf_logits(reloaded, tokens), hf_logits(imported["model"], tokens))


def test_export_derives_a_gpt_oss_config_from_the_saved_flags(imported, tmp_path):
    """A checkpoint without the recorded config (as a training run saves them): gpt-oss's
    config from its flags (windows, YaRN, clamp) computes the same logits in transformers."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(imported["root"] / "ckpt", checkpoint)
    edit_common(str(checkpoint / "iter_0000000"), lambda common: common.pop(HF_CONFIG_KEY))
    convert("export", "--load", checkpoint, "--hf-dir", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["sliding_window"] == 8 and config["swiglu_limit"] == 1.0
    tensors = safetensors_of(imported["root"] / "hf")
    exported = safetensors_of(tmp_path / "out")
    assert all(torch.equal(exported[name], tensor) for name, tensor in tensors.items())
    tokens = tokens_for(GPT_OSS["vocab_size"])
    reloaded = load_hf_model(tmp_path / "out")
    assert torch.equal(hf_logits(reloaded, tokens), hf_logits(imported["model"], tokens))


def test_gpt_oss_import_at_expert_parallel_size_2(imported, tmp_path):
    """The experts split over 2 expert-parallel ranks (each taking its half of the stacked
    expert tensors, biases included) compute transformers' logits."""
    flags = [*imported["flags"], "--expert-model-parallel-size", "2"]
    tokens = tokens_for(GPT_OSS["vocab_size"])
    expected = hf_logits(imported["model"], tokens)
    for logits in run_distributed(_expert_parallel_logits, 2, flags, imported["path"], tokens):
        assert (logits - expected).abs().max().item() < PARITY


def test_pretrain_gpt_finetunes_the_gpt_oss_import(imported):
    """Iteration 1's loss of `pretrain_gpt.py --load --finetune` is transformers' on the same
    batch (sequences of 16: the windows cut them)."""
    flags = [
        *imported["flags"], "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "0", "--mock-data",
        "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
        "--load", imported["root"] / "ckpt", "--finetune",
    ]  # fmt: skip
    (result,) = run_distributed(_finetune, 1, [str(flag) for flag in flags])
    vocab = GPT_OSS["vocab_size"]
    samples = [MockGPTDataset(2, 16, vocab, seed=1234)[i] for i in range(2)]
    tokens = torch.stack([sample["tokens"] for sample in samples])
    labels = torch.stack([sample["labels"] for sample in samples])
    logits = hf_logits(imported["model"], tokens)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(torch.tensor(result["losses"][0]), expected)


@pytest.mark.parametrize(
    "layer_types, window, skip",
    [
        (None, (7, 0), 2),  # transformers' default: windows on alternate layers, from the first
        (["sliding_attention"] * 4, (7, 0), None),
        (["full_attention", "sliding_attention", "sliding_attention", "full_attention"], (7, 0),
         [0, 1, 1, 0]),
        (["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"], (7, 0),
         3),
        (["full_attention"] * 4, None, None),
    ],
)  # fmt: skip
def test_windowed_layers_are_transformers_sliding_layers(layer_types, window, skip):
    config = gpt_oss_config(num_hidden_layers=4, layer_types=layer_types)
    args = model_args_from_hf_config(config.to_dict())
    assert (args["window_size"], args["window_attn_skip_freq"]) == (window, skip)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
        ours = project_model(model_flags({**args, **vocab_args(config.vocab_size, None, None)}))
    theirs = [layer.self_attn.sliding_window for layer in hf_model.model.layers]
    windows = [layer.self_attention.core_attention.window for layer in ours.decoder.layers]
    assert windows == [None if w is None else w - 1 for w in theirs]


def _config_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


REFUSALS = {
    "alpha": (dict(swiglu_alpha=1.5), "swiglu_alpha 1.5: --quick-geglu's gate is"),
    "no_attention_bias": (dict(attention_bias=False), "with attention_bias false: without the"),
    "top1": (dict(num_experts_per_tok=1), "GptOssForCausalLM with num_experts_per_tok 1"),
    "layer_types": (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
                    "layer_types ['sliding_attention', 'chunked_attention', 'full_attention']"),
    "attention_factor": ({"attention_factor": 2.0},
                         "attention_factor 2.0 is not the concentration factor 1.20794"),
}  # fmt: skip
"""Config fields (for "attention_factor", of the RoPE block) and the error they give."""


@pytest.mark.parametrize("case", list(REFUSALS))
def test_gpt_oss_import_refusals(case, tmp_path):
    fields, message = REFUSALS[case]
    config = gpt_oss_config().to_dict()
    if case == "attention_factor":
        block = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        config[block] = {**config[block], **fields}
    else:
        config.update(fields)
    directory = _config_dir(tmp_path, config)
    with pytest.raises(HFConversionError, match=re.escape(message)):
        convert("import", "--hf-dir", directory, "--save", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_model_with_sinks_that_gpt_oss_does_not_compute_is_not_exported(imported, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(imported["root"] / "ckpt", checkpoint)

    def dense(common: dict[str, Any]) -> None:
        common.pop(HF_CONFIG_KEY)
        common["args"].update(num_experts=None, swiglu=True, quick_geglu=False)

    edit_common(str(checkpoint / "iter_0000000"), dense)
    with pytest.raises(HFConversionError) as error:
        convert("export", "--load", checkpoint, "--hf-dir", tmp_path / "out")
    message = str(error.value)
    assert message.startswith("the checkpoint's model is not gpt-oss's: --quick-geglu False")
    assert "--swiglu True (gpt-oss's: False)" in message and "no --num-experts" in message


# --- YaRN RoPE in a Llama-family model ---


LLAMA_YARN = dict(
    rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    rope_theta=10000.0,
)
"""Qwen2.5's form of YaRN (the band rounded, transformers' default concentration factor)."""


def test_llama_with_yarn_imports_and_exports(tmp_path):
    model = save_hf_model("llama2", tmp_path / "hf", **LLAMA_YARN)
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    assert "--position-embedding-type yarn" in " ".join(summary["flags"])
    assert summary["args"]["yarn_correction_range_round_to_int"] is True
    tokens = tokens_for(model.config.vocab_size)
    expected = hf_logits(model, tokens)
    logits = checkpoint_logits(summary["flags"], summary["path"], tokens)
    difference = (logits - expected).abs().max().item()
    print(f"Llama with YaRN: max abs logit difference to transformers {difference:.3g}")
    assert difference < PARITY
    off = checkpoint_logits([*summary["flags"], "--rotary-scaling-factor", "2"], summary["path"],
                            tokens)  # fmt: skip
    assert (off - expected).abs().max().item() > 100 * PARITY

    edit_common(summary["path"], lambda common: common.pop(HF_CONFIG_KEY))
    convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", local_files_only=True
    ).eval()
    assert torch.equal(hf_logits(reloaded, tokens), expected)
    assert hf_config("llama2", **LLAMA_YARN).rope_scaling["factor"] == 4.0
