"""`tools/convert_checkpoint.py` end to end, on checkpoints of real (tiny) training runs on two
ranks: Megatron-FSDP ZeRO-3, whose tensors are saved as sharded DTensors, the DDP engine
with `--bf16` (fp32 master weights in the optimizer state), and ZeRO-3 with FP8 delayed
scaling, whose state the full file carries and `--model-only` leaves out.

`to-torch` gives the full tensors the ranks held (gathered at save time, independently of the
checkpoint); `to-torch` -> `from-torch` -> `--load` resumes training with exactly the losses of
resuming from the original checkpoint; a bare `GPTModel.state_dict()` -> `from-torch` ->
`--finetune` trains from those weights; and every input and output problem is an error that
names it, leaving nothing written. The tool runs here, in the test process, which has no
process group (as it would from the command line)."""

from __future__ import annotations

import importlib
import io
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

import pretrain_gpt
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import training_loop
from megatron.training.checkpointing import (
    CHECKPOINT_VERSION,
    COMMON_FILENAME,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_dir,
)
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.program_launcher import run_program

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "convert_checkpoint.py"

# The tool is a script, not a package module: import it by path.
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))
convert_checkpoint = importlib.import_module("convert_checkpoint")

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --mock-data --vocab-size 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0 --log-interval 100"
).split()
"""A tiny run on 2 ranks: one microbatch of 2 per rank and iteration."""

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
ENGINES = {
    "zero3": ZERO3,
    "ddp_bf16": ["--bf16"],
    "zero3_sgd": [*ZERO3, "--optimizer", "sgd", "--sgd-momentum", "0"],
    "zero3_fp16": [*ZERO3, "--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "1"],
    "zero3_fp8_delayed": [
        *ZERO3,
        "--bf16",
        "--fp8-format",
        "hybrid",
        "--fp8-amax-history-len",
        "4",
        "--fp8-amax-compute-algo",
        "max",
    ],  # fmt: skip
}
"""Megatron-FSDP ZeRO-3 (sharded DTensors), the DDP engine with bf16 weights (fp32 masters
in the optimizer state), an optimizer without state tensors (only parameter groups),
`--fp16`, whose dynamic loss scale (doubled after every step here) is optimizer state too, and
FP8 delayed scaling, whose amax histories and scales are a non-tensor entry of the model's
state dict (`FP8_STATE`)."""

FP8_STATE = "decoder.fp8_state._extra_state"

WORLD_SIZE = 2
PADDED_VOCAB_SIZE = 128  # --vocab-size 64 padded to a multiple of 128, as pretrain_gpt does


def _full(tree: Any) -> Any:
    """`tree` with every DTensor gathered (a collective: every rank calls it) and every tensor
    copied to the CPU."""
    if isinstance(tree, dict):
        return {key: _full(value) for key, value in tree.items()}
    if isinstance(tree, DTensor):
        return tree.full_tensor().cpu()
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    return tree


def _pretrain(flags: list[str]) -> dict[str, Any]:
    """Runs pretrain_gpt on this rank. Returns its losses and start iteration, the full model
    and optimizer tensors of each checkpoint it saved (gathered as they are saved), and the
    error it raised (as text, so a failed load does not cost the worker pool)."""
    gathered: dict[int, dict[str, Any]] = {}
    save_checkpoint = training_loop.save_checkpoint

    def gather_and_save(train_state, model, optimizer, scheduler, args):
        optimizer_state = optimizer.sharded_state_dict()
        optimizer_state.pop("param_groups")
        # The model chunks (one without virtual pipeline stages).
        model_state = {name: t for chunk in model for name, t in chunk.state_dict().items()}
        gathered[train_state.iteration] = _full(
            {"model": model_state, "optimizer": optimizer_state}
        )
        save_checkpoint(train_state, model, optimizer, scheduler, args)

    training_loop.save_checkpoint = gather_and_save
    try:
        history = pretrain_gpt.main([*flags, "--distributed-backend", dist.get_backend()])
    except Exception as error:  # noqa: BLE001 - returned to the test, which asserts on it
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        training_loop.save_checkpoint = save_checkpoint
    return {
        "error": None,
        "losses": history.loss_curve(),
        "start_iteration": history.start_iteration,
        "gathered": gathered if dist.get_rank() == 0 else None,
    }


def pretrain(*flags: Any) -> dict[str, Any]:
    """pretrain_gpt with `TINY` and `flags` on 2 ranks; rank 0's result (the ranks agree)."""
    return run_distributed(_pretrain, WORLD_SIZE, [*TINY, *map(str, flags)])[0]


def convert(*argv: str) -> dict[str, Any]:
    return convert_checkpoint.main([str(arg) for arg in argv])


def load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_tensors_equal(actual: Any, expected: Any, where: str = "") -> None:
    """Nested dicts of tensors with the same keys, and tensors equal in dtype and value; a
    module's extra state (the bytes of a `torch.save`) holding such a dict."""
    if isinstance(expected, io.BytesIO):
        assert isinstance(actual, io.BytesIO), where
        assert_tensors_equal(_extra_state(actual), _extra_state(expected), where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert sorted(actual) == sorted(expected), where
        for key in expected:
            assert_tensors_equal(actual[key], expected[key], f"{where}/{key}")
    else:
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where


def _extra_state(value: io.BytesIO) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(value.getvalue()), weights_only=True)


def _model_tensors(model: dict[str, Any]) -> list[torch.Tensor]:
    return [value for value in model.values() if isinstance(value, torch.Tensor)]


def without_empty(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` less its empty dicts (a checkpoint has no entry for them)."""
    return {
        key: without_empty(value) if isinstance(value, dict) else value
        for key, value in tree.items()
        if not (isinstance(value, dict) and not value)
    }


@pytest.fixture(scope="module", params=list(ENGINES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """A 4-iteration run of an engine on 2 ranks, checkpointed at iterations 2 and 4."""
    save = tmp_path_factory.mktemp(request.param)
    result = pretrain(
        *ENGINES[request.param], "--train-iters", "4", "--save", save, "--save-interval", "2"
    )
    assert result["error"] is None, result["error"]
    return {**result, "engine": request.param, "save": save}


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> dict[str, Any]:
    """A 2-iteration ZeRO-3 run on 2 ranks, checkpointed at iteration 2."""
    save = tmp_path_factory.mktemp("zero3_only")
    result = pretrain(*ZERO3, "--train-iters", "2", "--save", save)
    assert result["error"] is None, result["error"]
    return {**result, "save": save}


def test_to_torch_gives_the_full_tensors_of_every_rank(run, tmp_path, capsys):
    if run["engine"].startswith("zero3"):
        # The premise: each rank wrote only its shards of the (2-D) weights.
        metadata = FileSystemReader(str(checkpoint_dir(run["save"], 4))).read_metadata()
        key = "model.embedding.word_embeddings.weight"
        assert len(metadata.state_dict_metadata[key].chunks) == WORLD_SIZE
    for step, flags in ((4, []), (2, ["--ckpt-step", "2"])):  # the tracker's, then --ckpt-step
        output = tmp_path / f"iter{step}.pt"
        summary = convert("to-torch", "--load", run["save"], "--output", output, *flags)
        contents = load(output)
        expected = run["gathered"][step]
        assert_tensors_equal(contents["model"], expected["model"], "model")
        if run["engine"] == "zero3_sgd":  # no state tensors: no "optimizer" entry
            assert sorted(contents) == ["common", "model"]
            assert not without_empty(expected["optimizer"])
        else:
            assert sorted(contents) == ["common", "model", "optimizer"]
            assert_tensors_equal(contents["optimizer"], without_empty(expected["optimizer"]))
        if run["engine"] == "ddp_bf16":
            assert len(contents["optimizer"]["fp32_from_fp16_params"]) == len(contents["model"])
        if run["engine"] == "zero3_fp16":  # 1024 doubled after each of `step` steps
            assert contents["optimizer"]["grad_scaler"]["scale"] == 1024 * 2**step
        common = load(checkpoint_dir(run["save"], step) + f"/{COMMON_FILENAME}")
        assert contents["common"]["iteration"] == step
        assert contents["common"]["consumed_train_samples"] == 4 * step
        assert contents["common"]["param_groups"] == common["param_groups"]
        assert contents["common"]["opt_param_scheduler"] == common["opt_param_scheduler"]

        optimizer = contents.get("optimizer", {})
        tensors = [t for values in optimizer.get("state", {}).values() for t in values.values()]
        tensors += _model_tensors(contents["model"])
        tensors += [*optimizer.get("fp32_from_fp16_params", {}).values()]
        tensors += [*optimizer.get("grad_scaler", {}).values()]
        assert summary["tensors"] == len(tensors)
        assert summary["bytes"] == sum(t.numel() * t.element_size() for t in tensors)
        assert summary["parameters"] == sum(t.numel() for t in _model_tensors(contents["model"]))
        if run["engine"] == "zero3_fp8_delayed":  # the state is carried, not the initial one
            assert (_extra_state(contents["model"][FP8_STATE])["scale_fwd"] != 1).all()
        printed = capsys.readouterr().out
        assert f"{summary['tensors']} tensors, {summary['parameters']:,} model parameters" in (
            printed
        )
        assert str(output) in printed


def test_model_only_is_a_gpt_model_state_dict(zero3_run, tmp_path):
    output = tmp_path / "model.pt"
    summary = convert("to-torch", "--load", zero3_run["save"], "--output", output, "--model-only")
    state_dict = torch.load(output, weights_only=True)  # tensors only: no pickled objects
    assert_tensors_equal(state_dict, zero3_run["gathered"][2]["model"])
    assert summary["tensors"] == len(state_dict)

    model = _tiny_gpt(seed=5)
    model.load_state_dict(state_dict, strict=True)
    assert_tensors_equal(dict(model.state_dict()), state_dict)


def test_model_only_leaves_out_extra_states(run, tmp_path, capsys):
    """`--model-only` of every engine's checkpoint holds the model's tensors, loadable with
    `weights_only=True`: the FP8 delayed-scaling state, a pickled object, is left out (the
    tool says so), and a delayed-scaling model loading the file starts from its initial
    state."""
    output = tmp_path / "model.pt"
    convert("to-torch", "--load", run["save"], "--output", output, "--model-only")
    state_dict = torch.load(output, weights_only=True)
    expected = run["gathered"][4]["model"]
    delayed = run["engine"] == "zero3_fp8_delayed"
    assert (expected.pop(FP8_STATE, None) is not None) == delayed
    assert_tensors_equal(state_dict, expected)
    assert (f"left out {FP8_STATE}" in capsys.readouterr().out) == delayed
    if not delayed:
        return
    model = _tiny_gpt(seed=5, fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    model(torch.zeros(1, 16, dtype=torch.long)).sum().backward()  # a state of its own
    model.load_state_dict(state_dict, strict=True)
    assert_tensors_equal(
        model.decoder.fp8_state.scaling_tensors(),
        {
            "amax_history_fwd": torch.zeros(4, 8),
            "scale_fwd": torch.ones(8),
            "amax_history_bwd": torch.zeros(4, 8),
            "scale_bwd": torch.ones(8),
        },
    )


def test_round_trip_resumes_training_exactly(run, tmp_path):
    """to-torch -> from-torch -> --load: the same losses as resuming from the original."""
    first = tmp_path / "iter2.pt"
    convert("to-torch", "--load", run["save"], "--ckpt-step", "2", "--output", first)
    converted = tmp_path / "converted"
    summary = convert("from-torch", "--input", first, "--save", converted)
    assert summary["iteration"] == 2
    assert (converted / TRACKER_FILENAME).read_text() == "2\n"
    assert sorted(os.listdir(converted)) == ["iter_0000002", TRACKER_FILENAME]

    # The converted checkpoint holds what the original does.
    second = tmp_path / "again.pt"
    convert("to-torch", "--load", converted, "--output", second)
    original, again = load(first), load(second)
    assert sorted(again) == sorted(original)
    assert_tensors_equal(again["model"], original["model"])
    assert_tensors_equal(again.get("optimizer", {}), original.get("optimizer", {}))
    assert again["common"].keys() == original["common"].keys()
    for key in ("iteration", "consumed_train_samples", "param_groups", "opt_param_scheduler"):
        assert again["common"][key] == original["common"][key]

    engine = ENGINES[run["engine"]]
    from_original = pretrain(
        *engine, "--train-iters", "4", "--load", run["save"], "--ckpt-step", "2"
    )
    from_converted = pretrain(*engine, "--train-iters", "4", "--load", converted)
    assert from_converted["error"] is None, from_converted["error"]
    assert from_converted["start_iteration"] == from_original["start_iteration"] == 2
    assert len(from_converted["losses"]) == 2
    assert from_converted["losses"] == from_original["losses"]
    # ... which are the uninterrupted run's (no dropout, deterministic mock data).
    torch.testing.assert_close(from_converted["losses"], run["losses"][2:])


def _tiny_gpt(seed: int, **fp8: Any) -> GPTModel:
    """The GPT that `TINY` trains, with weights from `seed`; `fp8`: the config's FP8 fields."""
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, **fp8
    )
    torch.manual_seed(seed)
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=PADDED_VOCAB_SIZE,
        max_sequence_length=16,
        share_embeddings_and_output_weights=True,
    )


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory) -> dict[str, Any]:
    """A bare `GPTModel.state_dict()` file, and the checkpoint from-torch writes from it."""
    tmp_path = tmp_path_factory.mktemp("bare")
    weights = {name: tensor.clone() for name, tensor in _tiny_gpt(seed=99).state_dict().items()}
    torch.save(weights, tmp_path / "model.pt")
    save = tmp_path / "checkpoint"
    summary = convert("from-torch", "--input", tmp_path / "model.pt", "--save", save)
    return {"weights": weights, "save": save, "summary": summary, "dir": tmp_path}


def test_bare_state_dict_loads_with_finetune(bare_checkpoint, tmp_path):
    save, weights = bare_checkpoint["save"], bare_checkpoint["weights"]
    assert bare_checkpoint["summary"]["iteration"] == 0
    assert bare_checkpoint["summary"]["tensors"] == len(weights)
    assert sorted(os.listdir(save)) == ["iter_0000000", TRACKER_FILENAME]
    common = load(checkpoint_dir(save, 0) + f"/{COMMON_FILENAME}")
    assert common["checkpoint_version"] == CHECKPOINT_VERSION
    assert common["args"] == {} and common["param_groups"] is None

    # With --lr 0 the step leaves the weights as they loaded; the saved ones are compared.
    resaved = tmp_path / "resaved"
    result = pretrain(
        *ZERO3, "--train-iters", "1", "--lr", "0", "--load", save, "--finetune",
        "--save", resaved,
    )  # fmt: skip
    assert result["error"] is None, result["error"]
    assert result["start_iteration"] == 0
    assert_tensors_equal(result["gathered"][1]["model"], weights)


def test_model_entry_alone_is_a_weights_only_checkpoint(bare_checkpoint, tmp_path):
    """`{"model": state_dict}` (a full file without the rest) converts as the bare dict does."""
    path = tmp_path / "wrapped.pt"
    torch.save({"model": bare_checkpoint["weights"]}, path)
    summary = convert("from-torch", "--input", path, "--save", tmp_path / "out", "--iteration", 3)
    assert summary["iteration"] == 3
    assert load(checkpoint_dir(tmp_path / "out", 3) + f"/{COMMON_FILENAME}")["param_groups"] is None
    convert("to-torch", "--load", tmp_path / "out", "--output", tmp_path / "back.pt")
    back = load(tmp_path / "back.pt")
    assert sorted(back) == ["common", "model"]  # no optimizer state to convert
    assert_tensors_equal(back["model"], bare_checkpoint["weights"])

    with pytest.raises(SystemExit):  # argparse's error: exit status 2 and the usage
        convert("from-torch", "--input", path, "--save", tmp_path / "neg", "--iteration", -1)
    assert not (tmp_path / "neg").exists()


def test_bare_state_dict_needs_finetune_or_no_load_optim(bare_checkpoint):
    result = pretrain(*ZERO3, "--train-iters", "1", "--load", bare_checkpoint["save"])
    assert result["error"] is not None
    assert "holds no optimizer state" in result["error"]
    assert "pass --no-load-optim or --finetune" in result["error"]

    result = pretrain(
        *ZERO3, "--train-iters", "3", "--load", bare_checkpoint["save"],
        "--no-load-optim", "--no-load-rng",
    )  # fmt: skip
    assert result["error"] is None, result["error"]
    assert result["start_iteration"] == 0 and len(result["losses"]) == 3


MOE_FIXTURE = REPO / "tests/unit_tests/transformer/moe/fixtures/moe_layer_fixture.pt"
"""Megatron-core 0.19.2 MoE layers' state dicts (tests/unit_tests/transformer/moe/fixtures)."""


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "model_entry"])
def test_megatron_core_moe_state_dict_converts_to_stacked_experts(tmp_path, wrapped):
    """Upstream's per-expert names (`local_experts.<i>`) become the stacked tensors this
    project saves, in expert order; its None `_extra_state` entries are left out."""
    upstream = torch.load(MOE_FIXTURE)["deepseek_v3"]["state_dict"]
    prefix = "decoder.layers.1.mlp."
    model = {f"{prefix}{key}": value for key, value in upstream.items()}
    model["decoder.final_layernorm.weight"] = torch.ones(16)
    path = tmp_path / "upstream.pt"
    torch.save({"model": model} if wrapped else model, path)
    convert("from-torch", "--input", path, "--save", tmp_path / "ckpt")
    convert("to-torch", "--load", tmp_path / "ckpt", "--output", tmp_path / "back.pt")
    back = load(tmp_path / "back.pt")["model"]
    experts = range(8)
    expected = {
        f"{prefix}experts.{name}": torch.stack(
            [upstream[f"experts.local_experts.{i}.{name}"] for i in experts]
        )
        for name in ("linear_fc1.weight", "linear_fc2.weight")
    }
    for name in ("router.weight", "router.expert_bias", "shared_experts.gate_weight"):
        expected[prefix + name] = upstream[name]
    for name in ("linear_fc1.weight", "linear_fc2.weight"):
        expected[f"{prefix}shared_experts.{name}"] = upstream[f"shared_experts.{name}"]
    expected["decoder.final_layernorm.weight"] = torch.ones(16)
    assert_tensors_equal(back, expected)


def test_megatron_core_moe_state_dict_missing_an_expert_is_refused(tmp_path):
    upstream = dict(torch.load(MOE_FIXTURE)["deepseek_v3"]["state_dict"])
    del upstream["experts.local_experts.5.linear_fc2.weight"]
    torch.save(upstream, tmp_path / "upstream.pt")
    with pytest.raises(CheckpointError, match=r"experts \[5\] are missing"):
        convert("from-torch", "--input", tmp_path / "upstream.pt", "--save", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_from_torch_iteration_and_force(zero3_run, tmp_path, capsys):
    source = tmp_path / "full.pt"
    convert("to-torch", "--load", zero3_run["save"], "--output", source)
    save = tmp_path / "out"
    summary = convert("from-torch", "--input", source, "--save", save, "--iteration", "7")
    assert summary["iteration"] == 7
    assert load(checkpoint_dir(save, 7) + f"/{COMMON_FILENAME}")["iteration"] == 7
    assert "writing it as iteration 7" in capsys.readouterr().out

    # An existing checkpoint is not replaced without --force, and is left as it was.
    before = sorted(os.listdir(checkpoint_dir(save, 7)))
    with pytest.raises(CheckpointError, match=r"iter_0000007 exists already; pass --force"):
        convert("from-torch", "--input", source, "--save", save, "--iteration", "7")
    assert sorted(os.listdir(checkpoint_dir(save, 7))) == before
    # An older iteration than the tracker's is refused without --force (--load would take it).
    with pytest.raises(CheckpointError, match="names iteration 7, newer than 2: pointing it"):
        convert("from-torch", "--input", source, "--save", save)  # the file's iteration, 2
    assert (save / TRACKER_FILENAME).read_text() == "7\n"
    assert sorted(os.listdir(save)) == ["iter_0000007", TRACKER_FILENAME]
    convert("from-torch", "--input", source, "--save", save, "--force")
    assert (save / TRACKER_FILENAME).read_text() == "2\n"
    assert "named iteration 7, now 2" in capsys.readouterr().out

    # With --force the bare weights replace iteration 2 (and nothing is left over).
    bare = tmp_path / "bare.pt"
    torch.save({k: v.clone() for k, v in load(source)["model"].items()}, bare)
    convert("from-torch", "--input", bare, "--save", save, "--iteration", "2", "--force")
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000007", TRACKER_FILENAME]
    assert load(checkpoint_dir(save, 2) + f"/{COMMON_FILENAME}")["param_groups"] is None
    assert convert("to-torch", "--load", save, "--output", tmp_path / "a.pt")["tensors"] == len(
        load(bare)
    )


def test_to_torch_refuses_to_overwrite(zero3_run, tmp_path):
    output = tmp_path / "out.pt"
    output.write_bytes(b"precious")
    with pytest.raises(CheckpointError, match=r"exists already; pass --force"):
        convert("to-torch", "--load", zero3_run["save"], "--output", output)
    assert output.read_bytes() == b"precious"
    convert("to-torch", "--load", zero3_run["save"], "--output", output, "--force")
    assert sorted(load(output)) == ["common", "model", "optimizer"]
    assert sorted(os.listdir(tmp_path)) == ["out.pt"]  # no temporary file left

    with pytest.raises(CheckpointError, match=r"is a directory; pass a file name"):
        convert("to-torch", "--load", zero3_run["save"], "--output", tmp_path)


def _checkpoint_copy(zero3_run: dict[str, Any], tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(zero3_run["save"], copy)
    return copy


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", r"no such directory\. Pass the --save directory"),
        ("file", r"is a file, not a checkpoint directory.*use from-torch"),
        ("empty", r"is not a checkpoint directory: it has no latest_checkpointed_iteration"),
        ("no_tracker", r"no latest_checkpointed_iteration\.txt; it holds iterations \[2\]: pass "),
        ("iter_dir", r"is one checkpoint's directory: pass the directory it is in"),
        ("bad_tracker", r"holds 'two', not an iteration number"),
        ("no_metadata", r"iter_0000002 is incomplete \(no \.metadata\).*--ckpt-step"),
        ("no_common", r"iter_0000002 is incomplete \(no common\.pt\)"),
        ("short_shard", r"iter_0000002 is incomplete: __0_0\.distcp has 100 of \d+ bytes"),
        ("corrupt_shard", r"iter_0000002 is damaged: __0_0\.distcp bytes \[0, \d+\) have CRC-32"),
        (
            "corrupt_shard_no_checksums",
            r"The tensors of .*iter_0000002 cannot be read \(.*\); its files are",
        ),
        ("ckpt_step", r"iter_0000009 does not exist \(it holds iterations \[2\]\); pass --ckpt"),
    ],
)
def test_to_torch_errors(zero3_run, tmp_path, damage, message):
    load_dir = _checkpoint_copy(zero3_run, tmp_path)
    iteration = load_dir / "iter_0000002"
    flags: list[Any] = []
    if damage == "missing":
        load_dir = tmp_path / "nowhere"
    elif damage == "file":
        load_dir = iteration / COMMON_FILENAME
    elif damage == "empty":
        load_dir = tmp_path / "empty"
        load_dir.mkdir()
    elif damage == "no_tracker":
        (load_dir / TRACKER_FILENAME).unlink()
    elif damage == "iter_dir":
        load_dir = iteration
    elif damage == "bad_tracker":
        (load_dir / TRACKER_FILENAME).write_text("two\n")
    elif damage == "no_metadata":
        (iteration / ".metadata").unlink()
    elif damage == "no_common":
        (iteration / COMMON_FILENAME).unlink()
    elif damage == "short_shard":
        (iteration / "__0_0.distcp").write_bytes(b"x" * 100)
    elif damage.startswith("corrupt_shard"):
        if damage == "corrupt_shard_no_checksums":  # saved before checksums were recorded
            (iteration / "checksums.json").unlink()
        for shard in iteration.glob("*.distcp"):
            shard.write_bytes(bytes(shard.stat().st_size))
    elif damage == "ckpt_step":
        flags = ["--ckpt-step", 9]
    output = tmp_path / "out.pt"
    with pytest.raises(CheckpointError, match=message):
        convert("to-torch", "--load", load_dir, "--output", output, *flags)
    assert not output.exists()
    assert not list(tmp_path.glob("out.pt*"))  # no temporary file either


def _input_contents(kind: str, full: dict[str, Any]) -> Any:
    model = full["model"]
    exp_avg = {"exp_avg": torch.zeros(1)}
    return {
        "list": [1, 2],
        "not_tensors": {"weight": [1.0, 2.0], "bias": "zero"},
        "empty": {},
        "extra_entry": {**full, "scheduler": {}},
        "optimizer_stranger": {**full, "optimizer": {"state": {"nope.weight": exp_avg}}},
        "optimizer_shape": {**full, "optimizer": {"state": {"x": torch.zeros(1)}}},
        "optimizer_no_common": {"model": model, "optimizer": full["optimizer"]},
        "old_version": {**full, "common": {**full["common"], "checkpoint_version": 0}},
        "common_incomplete": {**full, "common": {"checkpoint_version": CHECKPOINT_VERSION}},
    }[kind]


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", r"--input .*: no such file"),
        ("directory", r"is a directory; from-torch reads a torch\.save file.*use to-torch"),
        ("garbage", r"is not a torch\.save file \(.*\)\. Pass a file written by to-torch"),
        ("list", r"holds a list, not a state dict"),
        ("not_tensors", r"is not a model state dict \(\{name: tensor\}\): 2 entr\(ies\)"),
        ("empty", r"is empty: it holds no model weights"),
        ("extra_entry", r"has entries \['scheduler'\] besides \['model', 'optimizer', 'common'\]"),
        ("optimizer_stranger", r"parameters the model does not have \(\['nope\.weight'\]\)"),
        ("optimizer_shape", r"'state' that is not \{param name: \{state name: tensor\}\}"),
        ("optimizer_no_common", r"has optimizer state but no 'common'"),
        ("old_version", r"is of checkpoint version 0; this code writes version"),
        ("common_incomplete", r"'common' lacks \['ckpt_format', 'iteration'"),
        ("save_is_file", r"--save .* is a file, not a directory"),
        ("replaced_leftover", r"iter_0000002\.replaced\.tmp is left from an interrupted .* rename"),
    ],
)
def test_from_torch_errors(zero3_run, tmp_path, kind, message):
    full_file = tmp_path / "full.pt"
    convert("to-torch", "--load", zero3_run["save"], "--output", full_file)
    path = tmp_path / "input.pt"
    save = tmp_path / "out"
    if kind == "missing":
        path = tmp_path / "nothing.pt"
    elif kind == "directory":
        path = zero3_run["save"]
    elif kind == "garbage":
        path.write_bytes(b"not a torch file")
    elif kind == "save_is_file":
        path = full_file
        save.write_text("")
    elif kind == "replaced_leftover":
        path = full_file
        (save / "iter_0000002.replaced.tmp").mkdir(parents=True)
    else:
        torch.save(_input_contents(kind, load(full_file)), path)
    with pytest.raises(CheckpointError, match=message):
        convert("from-torch", "--input", path, "--save", save)
    if kind == "replaced_leftover":  # nothing written beside the leftover
        assert os.listdir(save) == ["iter_0000002.replaced.tmp"]
    else:
        assert not save.is_dir()  # nothing written


def test_command_line_error_exit(tmp_path):
    """Run as a script: an error is one line on stderr and exit status 1, no traceback."""
    flags = ["to-torch", "--load", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out.pt")]
    process = run_program(TOOL, flags, cwd=tmp_path, timeout=120)
    assert process.returncode == 1
    assert process.stderr.startswith("convert_checkpoint.py: error: --load ")
    assert "no such directory" in process.stderr
    assert "Traceback" not in process.stderr
