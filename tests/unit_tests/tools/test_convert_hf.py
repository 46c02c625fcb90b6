"""`tools/convert_hf.py` on tiny random Hugging Face models saved locally (`hf_models.py`): Llama
2 and 3 (RoPE scaling), Mistral (sharded files, wide heads), Qwen2 (QKV bias, tied and padded
embeddings), Qwen3 (query-key norms), Mixtral, Qwen2-MoE and Qwen3-MoE (experts, shared expert,
a dense layer) and DeepSeek-V3 (multi-latent attention with YaRN, grouped sigmoid routing with
the expert bias, shared experts, multi-token prediction; `test_convert_hf_deepseek_v3.py` tests
what is its own).

`import` gives flags that `pretrain_gpt.py`'s own parser turns into the arguments recorded in
the checkpoint, and a checkpoint whose model computes transformers' logits (fp32, max abs
difference < 1e-4, while a wrong RoPE layout or scaling, or another routing, is
off by far more), also with the experts split over 2 expert-parallel ranks; `export` gives back
the original tensors bit for bit and a directory transformers loads; `pretrain_gpt.py --load
--finetune` trains from the import, starting from the loss transformers computes; and every
refusal names the problem and writes nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pretrain_gpt
from megatron.core import parallel_state
from megatron.core.datasets import MockGPTDataset
from megatron.training import checkpointing
from megatron.training.checkpoint_layout import (
    COMMON_FILENAME,
    CheckpointError,
    checkpoint_dir,
    read_metadata,
)
from megatron.training.hf_conversion import HF_CONFIG_KEY, HFConversionError
from megatron.training.hf_conversion.config import (
    hf_config_from_model_args,
    model_args_from_hf_config,
    model_flags,
    vocab_args,
)
from megatron.training.hf_conversion.config_fields import ARCHITECTURE_DEFAULTS
from megatron.training.offline_checkpoint import read_checkpoint
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.program_launcher import run_program
from tests.unit_tests.tools.hf_models import (
    MODELS,
    SEQ_LENGTH,
    hf_config,
    hf_logits,
    load_hf_model,
    parse_flags,
    project_model,
    safetensors_of,
    save_hf_model,
)
from tests.unit_tests.training.checkpoint_checks import edit_common
from tests.unit_tests.training.log_capture import capture_training_log

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "convert_hf.py"

if str(REPO / "tools") not in sys.path:  # the tool is a script: import it by path
    sys.path.insert(0, str(REPO / "tools"))
convert_hf = importlib.import_module("convert_hf")

PARITY = 1e-4
"""The largest max-abs logit difference to transformers accepted (fp32)."""


def convert(*argv: Any) -> dict[str, Any]:
    return convert_hf.main([str(arg) for arg in argv])


def tokens_for(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ_LENGTH), generator=torch.Generator().manual_seed(seed))


def checkpoint_logits(flags: list[str], path: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of this project's model built from `flags`, with the checkpoint's weights."""
    model = project_model(flags)
    model.load_state_dict(read_checkpoint(path, lambda nesting: nesting[0] == "model")["model"])
    with torch.no_grad():
        return model(tokens)


def digest(directory: Path) -> dict[str, str]:
    """Every file under `directory` -> the SHA-256 of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module", params=list(MODELS))
def imported(request, tmp_path_factory) -> dict[str, Any]:
    """A test model saved by transformers and imported, with its flags written to a file."""
    root = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, root / "hf")
    summary = convert(
        "import", "--hf-dir", root / "hf", "--save", root / "ckpt",
        "--flags-file", root / "model.flags",
    )  # fmt: skip
    if "max_shard_size" in MODELS[request.param]:  # the index and several files are read
        assert len(list((root / "hf").glob("model-*.safetensors"))) > 1
    vocab = model.config.vocab_size
    return {"name": request.param, "model": model, "root": root, "vocab": vocab, **summary}


def test_flags_give_the_recorded_arguments(imported):
    root = imported["root"]
    assert (root / "model.flags").read_text() == shlex.join(imported["flags"]) + "\n"
    parsed = parse_flags(imported["flags"])
    for name, value in imported["args"].items():
        assert getattr(parsed, name) == value, name
    common = torch.load(Path(imported["path"]) / COMMON_FILENAME, weights_only=False)
    assert common["args"] == imported["args"]
    assert common["param_groups"] is None  # weights only: loads with --finetune
    assert common[HF_CONFIG_KEY] == json.loads((root / "hf" / "config.json").read_text())
    assert parsed.padded_vocab_size >= imported["vocab"]
    if imported["name"] != "qwen2":  # the one tokenizer with more ids than embedding rows
        assert parsed.padded_vocab_size == imported["vocab"]


def test_logits_match_transformers(imported):
    tokens = tokens_for(imported["vocab"])
    expected = hf_logits(imported["model"], tokens)
    logits = checkpoint_logits(imported["flags"], imported["path"], tokens)
    vocab = imported["vocab"]
    assert torch.equal(logits[..., vocab:], torch.zeros_like(logits[..., vocab:]))  # padding
    difference = (logits[..., :vocab] - expected).abs().max().item()
    print(f"{imported['name']}: max abs logit difference to transformers {difference:.3g}")
    assert difference < PARITY

    # The tolerance tells layouts apart: the other RoPE channel pairing, or Llama 3 without
    # its frequency scaling (multi-latent attention: RoPE instead of YaRN, no routed scaling),
    # moves the logits by far more.
    if "--multi-latent-attention" in imported["flags"]:
        wrong = [
            [*imported["flags"], "--rope-type", "rope"],
            [*imported["flags"], "--moe-router-topk-scaling-factor", "1"],
        ]
    else:
        wrong = [[*imported["flags"], "--rotary-interleaved"]]
    if "--use-rope-scaling" in imported["flags"]:
        wrong.append([flag for flag in imported["flags"] if flag != "--use-rope-scaling"])
    softmax_routing = "--moe-router-score-function" not in imported["flags"]
    if "--num-experts" in imported["flags"] and softmax_routing:  # renormalised or not
        pre_softmax = "--moe-router-pre-softmax"
        flags = imported["flags"]
        wrong.append(
            [flag for flag in flags if flag != pre_softmax]
            if pre_softmax in flags
            else [*flags, pre_softmax]
        )
    for flags in wrong:
        off = checkpoint_logits(flags, imported["path"], tokens)[..., :vocab] - expected
        assert off.abs().max().item() > 100 * PARITY


def test_export_gives_back_the_original(imported, tmp_path):
    original = imported["root"] / "hf"
    summary = convert("export", "--load", imported["root"] / "ckpt", "--hf-dir", tmp_path / "out")
    exported = safetensors_of(tmp_path / "out")
    assert sorted(exported) == sorted(safetensors_of(original))
    for name, tensor in safetensors_of(original).items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == imported["model"].config.architectures
    assert summary["architecture"] == config["architectures"][0]

    tokens = tokens_for(imported["vocab"])
    reloaded = load_hf_model(tmp_path / "out")
    assert torch.equal(hf_logits(reloaded, tokens), hf_logits(imported["model"], tokens))


DERIVED_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
"""The architecture of the config derived from each test model's flags (else Llama's)."""


def test_export_derives_a_config_from_the_saved_flags(imported, tmp_path):
    """A checkpoint without the recorded config (as a training run saves them): Llama's, or
    Qwen2's for the QKV bias, Qwen3's for query-key norms, Mixtral's, Qwen2-MoE's or
    Qwen3-MoE's for experts, DeepSeek-V3's for multi-latent attention, from the saved flags,
    with every padded row kept."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(imported["root"] / "ckpt", checkpoint)
    edit_common(str(checkpoint / "iter_0000000"), lambda common: common.pop(HF_CONFIG_KEY))

    convert("export", "--load", checkpoint, "--hf-dir", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    derived = DERIVED_ARCHITECTURES.get(imported["name"], "LlamaForCausalLM")
    assert config["architectures"] == [derived]
    exported, original = safetensors_of(tmp_path / "out"), safetensors_of(imported["root"] / "hf")
    assert sorted(exported) == sorted(original)
    vocab = imported["vocab"]
    for name, tensor in original.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(exported[name][:vocab], tensor), name
            assert not exported[name][vocab:].any(), name  # the zero rows import padded
        else:
            assert torch.equal(exported[name], tensor), name

    tokens = tokens_for(vocab)
    logits = hf_logits(load_hf_model(tmp_path / "out"), tokens)
    if imported["args"]["padded_vocab_size"] == vocab:  # padded rows add (zero) logits
        assert torch.equal(logits, hf_logits(imported["model"], tokens))


def _finetune(flags: list[str]) -> dict[str, Any]:
    with capture_training_log() as log:
        history = pretrain_gpt.main([*flags, "--distributed-backend", dist.get_backend()])
    return {"losses": history.loss_curve(), "log": log}


def test_pretrain_gpt_finetunes_the_import(tmp_path):
    """Iteration 1's loss is transformers' on the same batch; with --lr 0 the saved
    checkpoint exports back to the same model (its config derived from the run's flags)."""
    model = save_hf_model("llama2", tmp_path / "hf")
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    flags = [
        *summary["flags"], "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "2", "--lr", "0", "--mock-data",
        "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
        "--load", tmp_path / "ckpt", "--finetune", "--save", tmp_path / "finetuned",
    ]  # fmt: skip
    (result,) = run_distributed(_finetune, 1, [str(flag) for flag in flags])
    assert any("loaded checkpoint of iteration 0" in line for line in result["log"])

    vocab = model.config.vocab_size
    samples = [MockGPTDataset(2, 16, vocab, seed=1234)[i] for i in range(2)]
    tokens = torch.stack([sample["tokens"] for sample in samples])
    labels = torch.stack([sample["labels"] for sample in samples])
    expected = F.cross_entropy(hf_logits(model, tokens).flatten(0, 1), labels.flatten())
    assert len(result["losses"]) == 2
    torch.testing.assert_close(torch.tensor(result["losses"][0]), expected)

    convert("export", "--load", tmp_path / "finetuned", "--hf-dir", tmp_path / "out")
    check = tokens_for(vocab)
    exported = hf_logits(load_hf_model(tmp_path / "out"), check)
    assert torch.equal(exported, hf_logits(model, check))

    other = hf_config("llama2", rope_theta=20000.0).to_dict()
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(HFConversionError, match="rotary_base 10000 .the config's: 20000"):
        convert(
            "export", "--load", tmp_path / "finetuned", "--hf-dir", tmp_path / "no",
            "--hf-config", tmp_path / "other.json",
        )  # fmt: skip
    assert not (tmp_path / "no").exists()


def test_export_of_an_fp8_delayed_scaling_run_writes_the_weights_only(tmp_path):
    """The import (weights only) finetuned with FP8 delayed scaling at --lr 0: its checkpoint
    also holds the amax histories and scales (`decoder.fp8_state._extra_state`), which have no
    place in Hugging Face files; the export writes the original weights and nothing else."""
    save_hf_model("llama2", tmp_path / "hf")
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    flags = [
        *summary["flags"], "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "2", "--lr", "0", "--mock-data",
        "--num-workers", "0", "--eval-iters", "0", "--fp8-format", "hybrid",
        "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max",
        "--load", tmp_path / "ckpt", "--finetune", "--save", tmp_path / "finetuned",
    ]  # fmt: skip
    run_distributed(_finetune, 1, [str(flag) for flag in flags])
    saved = read_metadata(checkpoint_dir(str(tmp_path / "finetuned"), 2)).state_dict_metadata
    assert "model.decoder.fp8_state._extra_state" in saved  # the premise

    convert("export", "--load", tmp_path / "finetuned", "--hf-dir", tmp_path / "out")
    exported, original = safetensors_of(tmp_path / "out"), safetensors_of(tmp_path / "hf")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def _expert_parallel_logits(flags: list[str], path: str, tokens: torch.Tensor) -> torch.Tensor:
    """On each rank: logits of the model `flags` build (with their expert-parallel size), each
    rank's experts taken from the checkpoint's global expert tensors."""
    ep = int(flags[flags.index("--expert-model-parallel-size") + 1])
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model = project_model(flags, world_size=dist.get_world_size())
    state = read_checkpoint(path, lambda nesting: nesting[0] == "model")["model"]
    rank = parallel_state.get_expert_model_parallel_rank()
    for name, tensor in state.items():
        if ".experts." in name:
            local = tensor.shape[0] // ep
            state[name] = tensor[rank * local : (rank + 1) * local]
    model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)


def test_moe_import_at_expert_parallel_size_2(tmp_path):
    """--target-ep 2 writes the checkpoint --target-ep 1 writes (global expert tensors) and adds
    --expert-model-parallel-size 2 to the flags; the model they build on 2 ranks, each with
    half of the experts, computes transformers' logits."""
    model = save_hf_model("mixtral", tmp_path / "hf")
    whole = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ep1")
    split = convert(
        "import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ep2", "--target-ep", 2
    )  # fmt: skip
    assert split["flags"] == [*whole["flags"], "--expert-model-parallel-size", "2"]
    # DCP's .metadata has a new save id in every save, and checksums.json its checksum.
    changing = {"iter_0000000/.metadata", "iter_0000000/checksums.json"}
    assert {k: v for k, v in digest(tmp_path / "ep1").items() if k not in changing} == {
        k: v for k, v in digest(tmp_path / "ep2").items() if k not in changing
    }

    tokens = tokens_for(model.config.vocab_size)
    expected = hf_logits(model, tokens)
    for logits in run_distributed(
        _expert_parallel_logits, 2, split["flags"], split["path"], tokens
    ):
        assert (logits - expected).abs().max().item() < PARITY


def test_loading_checks_the_recorded_moe_flags(tmp_path):
    """The import records the MoE flags; a run whose flags route otherwise (weights not
    renormalised) is refused by name, one with the printed flags is not."""
    save_hf_model("mixtral", tmp_path / "hf")
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    common = torch.load(Path(summary["path"]) / COMMON_FILENAME, weights_only=False)
    checkpointing._check_arguments(common, summary["path"], parse_flags(summary["flags"]))
    other = parse_flags([*summary["flags"], "--moe-router-pre-softmax"])
    refused = re.escape("--moe-router-pre-softmax False (here True)")
    with pytest.raises(CheckpointError, match=refused):
        checkpointing._check_arguments(common, summary["path"], other)


def test_export_compares_the_moe_model_not_its_spelling(tmp_path):
    """A training run's checkpoint spells the MoE layers and the expert width its own way
    (`--moe-layer-freq [1,1]`, `--moe-ffn-hidden-size` unset): export takes it as the config's
    model, and still refuses another expert width."""
    save_hf_model("mixtral", tmp_path / "hf")
    summary = convert("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    args = torch.load(Path(summary["path"]) / COMMON_FILENAME, weights_only=False)["args"]
    layers, width = args["num_layers"], args["moe_ffn_hidden_size"]

    def respell(common: dict[str, Any]) -> None:
        common["args"].update(moe_layer_freq=[1] * layers, moe_ffn_hidden_size=None)
        common["args"].update(ffn_hidden_size=width)

    edit_common(summary["path"], respell)
    convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert sorted(safetensors_of(tmp_path / "out")) == sorted(safetensors_of(tmp_path / "hf"))

    edit_common(summary["path"], lambda common: common["args"].update(ffn_hidden_size=2 * width))
    with pytest.raises(HFConversionError, match="moe_ffn_hidden_size"):
        convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out2")


def test_pretrain_gpt_finetunes_an_moe_import_at_expert_parallel_size_2(tmp_path):
    """`pretrain_gpt.py --load --finetune` on 2 ranks at --expert-model-parallel-size 2 (the
    data-parallel engine splits the checkpoint's global expert tensors): iteration 1's loss is
    transformers' on the same batch."""
    model = save_hf_model("qwen2_moe", tmp_path / "hf")
    summary = convert(
        "import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt", "--target-ep", 2
    )  # fmt: skip
    flags = [
        *summary["flags"], "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "0", "--mock-data",
        "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
        "--load", tmp_path / "ckpt", "--finetune",
    ]  # fmt: skip
    results = run_distributed(_finetune, 2, [str(flag) for flag in flags])

    samples = [MockGPTDataset(2, 16, model.config.vocab_size, seed=1234)[i] for i in range(2)]
    tokens = torch.stack([sample["tokens"] for sample in samples])
    labels = torch.stack([sample["labels"] for sample in samples])
    expected = F.cross_entropy(hf_logits(model, tokens).flatten(0, 1), labels.flatten())
    logs = [line for result in results for line in result["log"]]
    assert any("loaded checkpoint of iteration 0" in line for line in logs)
    losses = [result["losses"] for result in results if result["losses"]]
    assert losses
    for loss_curve in losses:
        torch.testing.assert_close(torch.tensor(loss_curve[0]), expected)


def test_pretrain_gpt_finetunes_an_import_at_tensor_parallel_size_2(tmp_path):
    """--target-tp 2 adds --tensor-model-parallel-size 2 --sequence-parallel to the flags and
    pads the vocabulary for TP 2; `pretrain_gpt.py --load --finetune` on 2 ranks splits the
    checkpoint's whole tensors: iteration 1's loss is transformers' on the same batch (Llama 3:
    GQA, a tokenizer with fewer ids than the embedding has rows)."""
    model = save_hf_model("llama3", tmp_path / "hf")
    summary = convert(
        "import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt", "--target-tp", 2
    )  # fmt: skip
    assert summary["flags"][-3:] == ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    flags = [
        *summary["flags"], "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "0", "--mock-data",
        "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
        "--load", tmp_path / "ckpt", "--finetune",
    ]  # fmt: skip
    results = run_distributed(_finetune, 2, [str(flag) for flag in flags])

    samples = [MockGPTDataset(2, 16, 100, seed=1234)[i] for i in range(2)]
    tokens = torch.stack([sample["tokens"] for sample in samples])
    labels = torch.stack([sample["labels"] for sample in samples])
    expected = F.cross_entropy(hf_logits(model, tokens).flatten(0, 1), labels.flatten())
    losses = [result["losses"] for result in results if result["losses"]]
    assert losses
    for loss_curve in losses:
        torch.testing.assert_close(torch.tensor(loss_curve[0]), expected)


@pytest.mark.parametrize("step, dense_layers", [(1, []), (2, []), (3, [0]), (1, [1, 2])])
def test_qwen2_moe_sparse_layers_are_the_moe_layers(step, dense_layers):
    """--moe-layer-freq makes MoE layers of exactly the layers transformers makes sparse."""
    import transformers

    config = hf_config(
        "qwen2_moe", num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=dense_layers
    )
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    sparse = [
        type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in hf_model.model.layers
    ]
    args = model_args_from_hf_config(config.to_dict())
    flags = model_flags({**args, **vocab_args(config.vocab_size, None, None)})
    with torch.device("meta"):
        ours = project_model(flags)
    assert [hasattr(layer.mlp, "router") for layer in ours.decoder.layers] == sparse


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("qwen3", {"add_qkv_bias": True}, "both --add-qkv-bias and --qk-layernorm"),
        ("qwen3_moe", {"add_qkv_bias": True}, "both --add-qkv-bias and --qk-layernorm"),
        (
            "qwen3_moe",
            {"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True},
            "shared experts without --moe-shared-expert-gate and --add-qkv-bias, or with "
            "--qk-layernorm",
        ),
    ],
)
def test_derived_config_refuses_what_no_qwen_computes(name, changes, message):
    """Query-key norms with a QKV bias, or with shared experts: neither Qwen2 nor Qwen3."""
    args = model_args_from_hf_config(hf_config(name).to_dict())
    hf_config_from_model_args(args, 96, "float32")
    with pytest.raises(HFConversionError, match=re.escape(message)):
        hf_config_from_model_args({**args, **changes}, 96, "float32")


@pytest.fixture(scope="module")
def llama2_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama2_only") / "hf"
    save_hf_model("llama2", directory)
    return directory


def _config_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


REFUSALS = {
    "gpt2": ("GPT2LMHeadModel is not supported; supported: LlamaForCausalLM, "
             "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
             "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM"),
    "tp": "--target-tp 3 does not divide the model's num_attention_heads 4",
    "tp_experts": "--target-tp 2 does not divide the model's moe_intermediate_size 33",
    "ep": "--target-ep 2: the model is dense (no experts to split)",
    "ep_divisor": "--target-ep 3 does not divide the model's 4 experts",
    "jitter": "router_jitter_noise 0.1: transformers multiplies the input of the router and",
    "top1": "num_experts_per_tok 1 and renormalised routing weights",
    "no_sparse_layer": "leave no sparse layer: it is a dense model; convert it as Qwen2ForCausalLM",
    "no_config": "has no config.json",
    "sliding_window": "windowed attention is not built",
    "qwen3_window": "Qwen3ForCausalLM with sliding-window attention",
    "qwen3_moe_window": "Qwen3MoeForCausalLM with sliding-window attention",
    "qwen3_bias": "Qwen3ForCausalLM with attention_bias=true: biases in the attention output",
    "qwen3_fp8": "Qwen3ForCausalLM with quantization_config (quant_method 'fp8'): its weights",
    "experts_twice": "states num_experts 4 and num_local_experts 8, which transformers reads as",
    "qwen3_moe_dense": "leave no sparse layer: it is a dense model; convert it as Qwen3ForCausalLM",
    "no_weights": "holds no safetensors weights",
    "weights_misfit": "weights do not fit its config.json: missing ['model.layers.2.",
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_import_refusals(case, llama2_dir, tmp_path):
    config = hf_config("llama2").to_dict()
    options: list[Any] = []
    moe_configs = {
        "ep_divisor": hf_config("mixtral"),
        "jitter": hf_config("mixtral", router_jitter_noise=0.1),
        "top1": hf_config("mixtral", num_experts_per_tok=1),
        "no_sparse_layer": hf_config("qwen2_moe", decoder_sparse_step=3),
        "tp_experts": hf_config("qwen2_moe", moe_intermediate_size=33),
        "qwen3_window": hf_config("qwen3", use_sliding_window=True, sliding_window=64),
        "qwen3_moe_window": hf_config("qwen3_moe", use_sliding_window=True, sliding_window=64),
        "qwen3_bias": hf_config("qwen3", attention_bias=True),
        "qwen3_fp8": hf_config("qwen3", quantization_config={"quant_method": "fp8"}),
        "qwen3_moe_dense": hf_config("qwen3_moe", mlp_only_layers=[0, 1]),
    }
    if case == "experts_twice":  # transformers 5 writes num_local_experts, 4 num_experts
        moe_configs[case] = {**hf_config("qwen3_moe").to_dict(), "num_experts": 4}
        moe_configs[case]["num_local_experts"] = 8
    if case in moe_configs:
        config_of_case = moe_configs[case]
        if not isinstance(config_of_case, dict):
            config_of_case = config_of_case.to_dict()
        directory = _config_dir(tmp_path, config_of_case)
        options = {"ep_divisor": ["--target-ep", 3], "tp_experts": ["--target-tp", 2]}.get(case, [])
    elif case == "gpt2":
        directory = _config_dir(tmp_path, {**config, "architectures": ["GPT2LMHeadModel"]})
    elif case in ("tp", "ep"):
        directory, options = llama2_dir, [f"--target-{case}", 3 if case == "tp" else 2]
    elif case == "no_config":
        directory = tmp_path / "hf"
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(
            (llama2_dir / "model.safetensors").read_bytes()
        )
    elif case == "sliding_window":
        directory = _config_dir(tmp_path, hf_config("mistral", sliding_window=64).to_dict())
    elif case == "no_weights":
        directory = _config_dir(tmp_path, config)
    else:
        directory = _config_dir(tmp_path, {**config, "num_hidden_layers": 3})
        (directory / "model.safetensors").write_bytes(
            (llama2_dir / "model.safetensors").read_bytes()
        )
    with pytest.raises(HFConversionError, match=re.escape(REFUSALS[case])):
        convert("import", "--hf-dir", directory, "--save", tmp_path / "ckpt", *options)
    assert not (tmp_path / "ckpt").exists()


def test_nothing_is_overwritten_without_force(llama2_dir, tmp_path):
    save, flags_file, out = tmp_path / "ckpt", tmp_path / "model.flags", tmp_path / "out"
    convert("import", "--hf-dir", llama2_dir, "--save", save, "--flags-file", flags_file)
    convert("export", "--load", save, "--hf-dir", out)
    before = digest(tmp_path)

    with pytest.raises(CheckpointError, match="iter_0000000 exists already; pass --force"):
        convert("import", "--hf-dir", llama2_dir, "--save", save)
    with pytest.raises(HFConversionError, match="--flags-file .* exists already"):
        convert("import", "--hf-dir", llama2_dir, "--save", tmp_path / "new", "--flags-file",
                flags_file)  # fmt: skip
    with pytest.raises(HFConversionError, match="exists and is not empty; pass --force"):
        convert("export", "--load", save, "--hf-dir", out)
    with pytest.raises(HFConversionError, match="one inside the other"):
        convert("export", "--load", save, "--hf-dir", save / "iter_0000000", "--force")
    assert digest(tmp_path) == before

    convert("import", "--hf-dir", llama2_dir, "--save", save, "--flags-file", flags_file, "--force")
    convert("export", "--load", save, "--hf-dir", out, "--force")
    again = digest(tmp_path)
    assert again.keys() == before.keys()
    # DCP's .metadata has a new save id in every save, and checksums.json its checksum.
    changing = {"ckpt/iter_0000000/.metadata", "ckpt/iter_0000000/checksums.json"}
    assert {k: v for k, v in again.items() if k not in changing} == {
        k: v for k, v in before.items() if k not in changing
    }


def test_transformers_4_and_5_config_keys_read_alike():
    """transformers 5's `rope_parameters` and 4's `rope_theta` with `rope_scaling` (whose
    kind older versions call `type`) give the same flags."""
    config = hf_config("llama3").to_dict()
    parameters = config.pop("rope_parameters", None) or {
        **config.pop("rope_scaling"),
        "rope_theta": config.pop("rope_theta"),
    }
    scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    newer = {**config, "rope_parameters": parameters}
    older = {**config, "rope_theta": parameters["rope_theta"], "rope_scaling": scaling}
    oldest = {**older, "rope_scaling": {"type": "llama3", **scaling}}
    del oldest["rope_scaling"]["rope_type"]
    args = model_args_from_hf_config(newer)
    assert args["use_rope_scaling"] and args["rotary_base"] == 500000
    assert model_args_from_hf_config(older) == args == model_args_from_hf_config(oldest)


def _read_as(config: dict[str, Any]) -> dict[str, Any] | str:
    """The flag values `config` imports as, or "refused"."""
    try:
        return model_args_from_hf_config(config)
    except HFConversionError:
        return "refused"


def _transformers_reads(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """`config` written as a `config.json` and read back by transformers, every field filled."""
    import transformers

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return transformers.AutoConfig.from_pretrained(directory).to_dict()


def _left_out(config: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    *parents, key = path
    inner = config
    for parent in parents:
        inner = inner[parent]
    del inner[key]
    return config


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("max_positions", [None, 8192])
def test_left_out_fields_read_as_transformers_reads_them(name, max_positions, tmp_path):
    """A `config.json` that leaves out a field the conversion reads imports as the config
    transformers makes of it (its class's default for the architecture), or is refused where
    that config is. 8192 positions make Mistral's default window (4096) a window (and YaRN's
    original context, DeepSeek-V3's, 8192 / its factor: the import refuses one that is not)."""
    config = hf_config(name).to_dict()
    if max_positions is not None:
        config["max_position_embeddings"] = max_positions
        rope = config["rope_parameters"]
        if rope["rope_type"] == "yarn":
            rope["original_max_position_embeddings"] = int(max_positions // rope["factor"])
    assert _read_as(config) != "refused"
    paths = [(key,) for key in ARCHITECTURE_DEFAULTS[config["architectures"][0]] if key in config]
    paths += [("rope_parameters", key) for key in ("rope_theta", "original_max_position_embeddings")
              if key in config["rope_parameters"]]  # fmt: skip
    assert len(paths) >= 4
    for index, path in enumerate(paths):
        edited = _left_out(config, path)
        full = _transformers_reads(edited, tmp_path / str(index))
        assert _read_as(edited) == _read_as(full), path


def test_left_out_fields_that_used_to_convert_wrong(tmp_path):
    """Mixtral's RoPE base and norm epsilon, Mistral's window and Llama 3's original context
    where `config.json` leaves them out (each was read with another model's default)."""
    mixtral = hf_config("mixtral").to_dict()
    args = model_args_from_hf_config(_left_out(mixtral, ("rope_parameters", "rope_theta")))
    assert args["rotary_base"] == 1_000_000
    assert (
        model_args_from_hf_config(_left_out(mixtral, ("rms_norm_eps",)))["layernorm_epsilon"]
        == 1e-5
    )
    mistral = {**hf_config("mistral").to_dict(), "max_position_embeddings": 8192}
    with pytest.raises(
        HFConversionError, match=r"sliding_window 4096, max_position_embeddings 8192"
    ):
        model_args_from_hf_config(_left_out(mistral, ("sliding_window",)))
    llama3 = _left_out(
        hf_config("llama3").to_dict(), ("rope_parameters", "original_max_position_embeddings")
    )
    with pytest.raises(
        HFConversionError, match="original_max_position_embeddings 16384 .config.json leaves"
    ):
        model_args_from_hf_config(llama3)
    at_8192 = model_args_from_hf_config({**llama3, "max_position_embeddings": 8192})
    assert at_8192["use_rope_scaling"] and at_8192["rope_scaling_factor"] == 8.0
    top_level = {**llama3, "original_max_position_embeddings": 8192}  # precedes the scaling's
    assert model_args_from_hf_config(top_level)["use_rope_scaling"]
    with pytest.raises(HFConversionError, match="llama3 rope_scaling without low_freq_factor"):
        model_args_from_hf_config(_left_out(llama3, ("rope_parameters", "low_freq_factor")))


def test_partial_rotary_factor_is_refused_where_it_is_stated():
    """At the top level (transformers 4) or inside `rope_parameters` (5)."""
    config = hf_config("llama3").to_dict()
    for stated in (
        {**config, "partial_rotary_factor": 0.5},
        {**config, "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": 0.5}},
    ):
        with pytest.raises(HFConversionError, match="partial_rotary_factor 0.5: only full-width"):
            model_args_from_hf_config(stated)


def _edit_config(directory: Path, **fields: Any) -> None:
    """Sets `fields` in the `config.json` of the model directory `directory`."""
    file = directory / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))


def _edit_weights(directory: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Adds (or replaces) the tensor `name` in the weights of `directory`, or deletes it
    (`tensor` None), keeping an index true to its files."""
    from safetensors.torch import load_file, save_file

    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    file = directory / (index["weight_map"].get(name, "model-extra.safetensors") if index else
                        "model.safetensors")  # fmt: skip
    tensors = load_file(file) if file.exists() else {}
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})
    if index:
        index["weight_map"].pop(name, None)
        if tensor is not None:
            index["weight_map"][name] = file.name
        index_file.write_text(json.dumps(index))


def _import_matches_transformers(directory: Path, save: Path) -> None:
    """Imports `directory` and checks the checkpoint's logits against transformers' from it."""
    summary = convert("import", "--hf-dir", directory, "--save", save)
    model = load_hf_model(directory)
    vocab = model.config.vocab_size
    tokens = tokens_for(vocab)
    logits = checkpoint_logits(summary["flags"], summary["path"], tokens)[..., :vocab]
    assert (logits - hf_logits(model, tokens)).abs().max().item() < PARITY


@pytest.mark.parametrize("name", list(MODELS))
def test_tied_config_with_an_lm_head_of_its_own_is_refused(name, tmp_path):
    """`tie_word_embeddings` true, and an `lm_head.weight` that is not the embedding:
    transformers 5 loads an output layer of its own, transformers 4 the tied embedding (it
    used to be imported tied, silently). Refused naming both; each fix the message names
    imports the model transformers then loads from the directory."""
    directory = tmp_path / "hf"
    # Without DeepSeek-V3's multi-token prediction layer, whose copy of the output layer would
    # have to change with it (`test_convert_hf_deepseek_v3.py` tests the copies).
    no_mtp = {"num_nextn_predict_layers": 0} if name == "deepseek_v3" else {}
    save_hf_model(name, directory, tie_word_embeddings=True, **no_mtp)
    embedding = safetensors_of(directory)["model.embed_tokens.weight"]
    head = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(1))
    _edit_weights(directory, "lm_head.weight", head.to(embedding.dtype))
    before = digest(directory)
    refused = (
        "config.json's tie_word_embeddings is true, but its weights hold an lm_head.weight that "
        "differs from model.embed_tokens.weight"
    )
    with pytest.raises(HFConversionError, match=re.escape(refused)):
        convert("import", "--hf-dir", directory, "--save", tmp_path / "refused")
    assert not (tmp_path / "refused").exists() and digest(directory) == before

    untied = tmp_path / "untied"
    shutil.copytree(directory, untied)
    _edit_config(untied, tie_word_embeddings=False)
    _import_matches_transformers(untied, tmp_path / "untied_ckpt")
    _edit_weights(directory, "lm_head.weight", None)
    _import_matches_transformers(directory, tmp_path / "tied_ckpt")


def test_tied_config_with_a_copy_of_the_embedding_imports_tied(tmp_path):
    """An `lm_head.weight` equal to the embedding (as some tools save tied weights, here in
    another dtype) is the tied output layer transformers loads."""
    directory = tmp_path / "hf"
    save_hf_model("qwen2", directory)
    embedding = safetensors_of(directory)["model.embed_tokens.weight"]
    _edit_weights(directory, "lm_head.weight", embedding.double())
    _import_matches_transformers(directory, tmp_path / "ckpt")


def test_weights_compare_block_by_block(tmp_path):
    """`HFWeights.equal` reads blocks of rows: a difference in the last block (here one row of
    two) counts, across files and dtypes."""
    from safetensors.torch import save_file

    from megatron.training.hf_conversion.safetensors_files import HFWeights

    first = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    last_row_off = first.clone()
    last_row_off[-1, -1] += 1
    save_file({"a": first, "b": last_row_off}, tmp_path / "model-1.safetensors")
    save_file({"c": first.double(), "d": first[:6]}, tmp_path / "model-2.safetensors")
    weight_map = {name: f"model-{1 if name in 'ab' else 2}.safetensors" for name in "abcd"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    weights = HFWeights(str(tmp_path))
    for block_bytes in (2 * 5 * 8, 10**6):  # two rows a block, or all of them
        assert weights.equal("a", "c", block_bytes)
        assert not weights.equal("a", "b", block_bytes)
        assert not weights.equal("a", "d", block_bytes)


def test_untied_config_without_lm_head_is_refused(tmp_path):
    """`tie_word_embeddings` false and no `lm_head.weight`: transformers would initialise the
    output layer at random. Refused naming both; with the fix the message names, the import
    computes transformers' logits."""
    directory = tmp_path / "hf"
    save_hf_model("llama2", directory)
    _edit_weights(directory, "lm_head.weight", None)
    refused = "tie_word_embeddings is false (transformers' default where it is left out), but"
    with pytest.raises(HFConversionError, match=re.escape(refused) + ".* no lm_head.weight"):
        convert("import", "--hf-dir", directory, "--save", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    _edit_config(directory, tie_word_embeddings=True)
    _import_matches_transformers(directory, tmp_path / "ckpt")


_LLAMA3_SCALING = dict(
    rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)  # fmt: skip

ROPE_STATED_TWICE = {
    "blocks": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
         "rope_scaling": _LLAMA3_SCALING},
        "config.json states RoPE twice, differently: rope_parameters {'rope_type': 'default', "
        "'rope_theta': 500000.0} and rope_scaling {'rope_type': 'llama3', 'factor': 32.0",
    ),
    "blocks_bases": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
         "rope_scaling": {"rope_type": "default"}},
        "states RoPE twice, differently: rope_parameters",
    ),
    "theta": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
         "rope_theta": 10000.0},
        "states rope_theta twice, differently: 10000.0 at the top level and 500000.0 in "
        "rope_parameters",
    ),
    "theta_in_scaling": (
        {"rope_scaling": {**_LLAMA3_SCALING, "rope_theta": 500000.0}, "rope_theta": 10000.0},
        "states rope_theta twice, differently: 10000.0 at the top level and 500000.0 in "
        "rope_scaling",
    ),
    "partial": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 1.0},
         "partial_rotary_factor": 0.5},
        "states partial_rotary_factor twice, differently: 0.5 at the top level and 1.0 in "
        "rope_parameters",
    ),
    "original_context": (
        {"rope_parameters": {**_LLAMA3_SCALING, "rope_theta": 500000.0},
         "original_max_position_embeddings": 4096, "max_position_embeddings": 16384},
        "states original_max_position_embeddings twice, differently: 4096 at the top level and "
        "8192 in rope_parameters",
    ),
}  # fmt: skip
"""Configs stating a RoPE parameter twice with different values (the fields replacing
Llama 2's), and the start of the refusal."""


@pytest.mark.parametrize("case", list(ROPE_STATED_TWICE))
def test_rope_stated_twice_differently_is_refused(case):
    """transformers 5 reads `rope_scaling` where a config also has `rope_parameters`, the
    block's `rope_theta` and `partial_rotary_factor` but the top-level
    `original_max_position_embeddings`; transformers 4 the other ones (the import read
    `rope_parameters`, silently)."""
    config = {key: value for key, value in hf_config("llama2").to_dict().items()
              if key not in ("rope_parameters", "rope_scaling", "rope_theta")}  # fmt: skip
    fields, refused = ROPE_STATED_TWICE[case]
    with pytest.raises(HFConversionError, match=re.escape(refused)):
        model_args_from_hf_config({**config, **fields})


def test_rope_stated_twice_refused_before_anything_is_written(llama2_dir, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(llama2_dir, directory)
    fields = ROPE_STATED_TWICE["blocks"][0]
    _edit_config(directory, **fields)
    with pytest.raises(HFConversionError, match="rope_parameters .* and rope_scaling .*delete"):
        convert("import", "--hf-dir", directory, "--save", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()

    checkpoint = tmp_path / "imported"
    convert("import", "--hf-dir", llama2_dir, "--save", checkpoint)
    with pytest.raises(HFConversionError, match="states RoPE twice, differently"):
        convert("export", "--load", checkpoint, "--hf-dir", tmp_path / "out",
                "--hf-config", directory)  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_rope_stated_twice_alike_imports_as_transformers_reads_it(tmp_path):
    """Llama 3's scaling in `rope_parameters` and again in `rope_scaling` (as `type`, its
    base at the top level), with the top-level `original_max_position_embeddings` the
    same: the model transformers loads from the directory."""
    directory = tmp_path / "hf"
    save_hf_model("llama3", directory)
    parameters = json.loads((directory / "config.json").read_text())["rope_parameters"]
    scaling = {"type": "llama3", **parameters}
    del scaling["rope_type"], scaling["rope_theta"]
    _edit_config(
        directory,
        rope_scaling=scaling,
        rope_theta=parameters["rope_theta"],
        original_max_position_embeddings=parameters["original_max_position_embeddings"],
    )
    _import_matches_transformers(directory, tmp_path / "ckpt")


def test_command_line_error_exit(tmp_path):
    """Run as a script: an error is one line on stderr and exit status 1, no traceback."""
    flags = ["import", "--hf-dir", str(tmp_path / "nowhere"), "--save", str(tmp_path / "ckpt")]
    process = run_program(TOOL, flags, cwd=tmp_path, timeout=120)
    assert process.returncode == 1
    assert process.stderr.startswith("convert_hf.py: error: ")
    assert "no such directory" in process.stderr and "Traceback" not in process.stderr
