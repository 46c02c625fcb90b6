"""Converts training checkpoints to single `torch.save` files of full tensors, and back.

A checkpoint is an `iter_NNNNNNN` directory under a `--save` directory
(`megatron/training/checkpointing.py` describes the layout): torch.distributed.checkpoint (DCP)
shards, sharded as the ranks held them, plus `common.pt`. This tool reads and writes them in one
process, without a process group and at any size the host memory holds:

    # The tracker's (latest) checkpoint, everything, as one file of full tensors:
    python tools/convert_checkpoint.py to-torch --load ckpts --output ckpt.pt
    # Iteration 100's model weights only, as `GPTModel.state_dict()`:
    python tools/convert_checkpoint.py to-torch --load ckpts --ckpt-step 100 \\
        --output model.pt --model-only

    # Back: training resumes from a full file's checkpoint (pretrain_gpt.py ... --load ckpts2)
    # as from the original: exactly at its data-parallel size, resharded at another:
    python tools/convert_checkpoint.py from-torch --input ckpt.pt --save ckpts2
    # A bare model state dict gives a weights-only checkpoint (iteration 0 unless --iteration),
    # loaded with --finetune (a new run from the weights) or --no-load-optim:
    python tools/convert_checkpoint.py from-torch --input model.pt --save ckpts3
    # pretrain_gpt.py ... --load ckpts3 --finetune

The files:

- full (`to-torch`): `{"model": {name: tensor}, "optimizer": {"state": {param name: {state
  name: tensor}}, "fp32_from_fp16_params": {param name: tensor}, "grad_scaler": {name:
  tensor}}, "common": {...}}`, where "common" is the checkpoint's `common.pt` dict (iteration,
  consumed samples, arguments, schedule, optimizer hyperparameters, RNG states). "optimizer"
  is left out for a checkpoint without optimizer state, its "fp32_from_fp16_params" where the
  optimizer keeps no fp32 masters, and its "grad_scaler" (the dynamic loss scale of `--fp16`)
  where there is none. "model" is exactly the unwrapped model's `state_dict()`: of a model
  trained with FP8 delayed scaling it also holds `decoder.fp8_state._extra_state` (with
  multi-token prediction also `mtp.fp8_state._extra_state`), the amax histories and scales (an
  `io.BytesIO`), which `from-torch` writes back, so training resumes from the converted
  checkpoint exactly. "common" holds Python objects: read the file with
  `torch.load(path, weights_only=False)`, as this tool does, only if you trust where it came
  from.
- model only (`to-torch --model-only`): `{name: tensor}`, the unwrapped model's `state_dict()`
  less its non-tensor `_extra_state` entries (the FP8 delayed-scaling state): the file holds
  tensors only, so `model.load_state_dict(torch.load(path))` takes it with
  `weights_only=True`; a model trained with FP8 delayed scaling that loads it starts from fresh
  amax histories and scales of 1.

`from-torch` takes either (and also `{"model": {...}}` without the rest). Without "common" it
writes what loading reads and nothing else: no arguments (so only the tensor names and shapes
are checked against the model), no schedule, no RNG states, 0 consumed samples. Tensors are
written whole; loading reshards them. A model state dict saved by Megatron-core converts too:
its MoE experts' per-expert entries (`experts.local_experts.<i>.*`, or Transformer Engine's
`experts.linear_fc1.weight<i>`, of all experts) are stacked into this project's tensors
(`experts.linear_fc1.weight` [num_experts, ...]), and the None `_extra_state` entries of its
linears are left out.

Nothing is overwritten without `--force`: an existing output file or checkpoint directory is
an error, and so is a tracker that names a newer iteration than the one written (pointing it
back would make `--load` take the older checkpoint). Writes are atomic: `to-torch` renames a
finished temporary file, `from-torch` writes `iter_N.tmp` and renames it (as a training save
does) before it points the tracker at it. A missing or incomplete checkpoint, and an input
file that is not one of these formats, are errors that name the fix. Checksums: `from-torch`
records those of every file it writes, as a training save does, and `to-torch` checks a
checkpoint's files against them before it reads a tensor.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.transformer.moe.upstream_names import stack_upstream_experts  # noqa: E402

# The layout is checkpointing.py's: its names, checks and atomic writes, not copies of them.
from megatron.training.checkpoint_layout import (  # noqa: E402
    CHECKPOINT_VERSION,
    COMMON_FILENAME,
    COMMON_KEYS,
    OPTIONAL_COMMON_KEYS,
    CheckpointError,
    atomic_torch_save,
    make_common,
    read_common,
)
from megatron.training.offline_checkpoint import (  # noqa: E402
    check_save_root,
    find_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from megatron.training.train_state import TrainState  # noqa: E402

FULL_KEYS = ("model", "optimizer", "common")
"""The entries of a full file; "model" is required."""

OPTIMIZER_KEYS = ("state", "fp32_from_fp16_params", "grad_scaler")
"""The optimizer's tensor entries (`MegatronOptimizer.sharded_state_dict()` less its
"param_groups", which live in "common")."""

EXTRA_STATE_SUFFIX = "_extra_state"
"""Model state entries that may hold any object (modules' extra states: Transformer Engine's,
and the FP8 delayed-scaling state); DCP saves them as bytes."""


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the subcommand and its flags."""
    parser = argparse.ArgumentParser(
        description="Convert training checkpoints to single torch.save files and back."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    to_torch = commands.add_parser(
        "to-torch", help="checkpoint directory -> one torch.save file of full tensors"
    )
    to_torch.add_argument("--load", required=True, help="the --save directory of a run.")
    to_torch.add_argument(
        "--ckpt-step", type=int, help="iteration to convert (default: the tracker file's)."
    )
    to_torch.add_argument("--output", required=True, help="the torch.save file to write.")
    to_torch.add_argument(
        "--model-only",
        action="store_true",
        help="write only the model's state dict, {name: tensor} (no optimizer or common).",
    )
    to_torch.add_argument("--force", action="store_true", help="replace an existing --output.")

    from_torch = commands.add_parser(
        "from-torch", help="torch.save file (to-torch's, or a model state dict) -> checkpoint"
    )
    from_torch.add_argument("--input", required=True, help="the torch.save file to read.")
    from_torch.add_argument(
        "--save", required=True, help="directory to write the checkpoint into (created)."
    )
    from_torch.add_argument(
        "--iteration",
        type=int,
        help="the checkpoint's iteration (default: the file's; 0 for a model state dict).",
    )
    from_torch.add_argument(
        "--force", action="store_true", help="replace an existing checkpoint of that iteration."
    )
    args = parser.parse_args(argv)
    if getattr(args, "iteration", None) is not None and args.iteration < 0:
        parser.error(f"--iteration {args.iteration}: an iteration is 0 or more.")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the subcommand in `argv` (None: the command line).

    Returns:
        What was written: `path`, `tensors`, `parameters` (model elements), `bytes` (of
        the tensors), `seconds`, and for `from-torch` the `iteration`.

    Raises:
        CheckpointError: the input is missing, not a checkpoint or not a convertible file, or
            the output exists (without `--force`); nothing was written.
    """
    args = get_args(argv)
    start = time.perf_counter()
    if args.command == "to-torch":
        summary = to_torch(args.load, args.output, args.ckpt_step, args.model_only, args.force)
    else:
        summary = from_torch(args.input, args.save, args.iteration, args.force)
    summary["seconds"] = time.perf_counter() - start
    print(
        f"> wrote {summary['path']}: {summary['tensors']} tensors, "
        f"{summary['parameters']:,} model parameters, {_format_bytes(summary['bytes'])} of "
        f"tensors, in {summary['seconds']:.2f} s"
    )
    return summary


def to_torch(
    root: str, output: str, ckpt_step: int | None, model_only: bool, force: bool
) -> dict[str, Any]:
    """Writes the checkpoint of `ckpt_step` (None: the tracker's) under `root` to `output`
    with full tensors: the full format, or with `model_only` the model's state dict.

    Returns:
        The summary `main()` reports (less `seconds`).

    Raises:
        CheckpointError: no such checkpoint, or `output` exists and not `force`.
    """
    path = find_checkpoint(root, ckpt_step)
    _check_output_file(output, force)
    print(f"> reading {path}{' (model only)' if model_only else ''}")
    common = None if model_only else read_common(path)
    state = read_checkpoint(path, (lambda nesting: nesting[0] == "model") if model_only else None)
    if model_only:
        contents: dict[str, Any] = _weights(state["model"])
    else:
        contents = {key: state[key] for key in ("model", "optimizer") if key in state}
        contents["common"] = common
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    atomic_torch_save(contents, output)
    return _summary(output, state)


def _weights(model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of the model state dict `model`: its `_extra_state` entries are pickled
    objects, which `torch.load(weights_only=True)` refuses."""
    left_out = sorted(name for name, value in model.items() if not isinstance(value, torch.Tensor))
    if left_out:
        print(
            f"> left out {', '.join(left_out)}: not a tensor (a module's extra state, such as "
            "the FP8 delayed-scaling state); a model loading the file starts from its initial "
            "one"
        )
    return {name: value for name, value in model.items() if isinstance(value, torch.Tensor)}


def from_torch(input_path: str, root: str, iteration: int | None, force: bool) -> dict[str, Any]:
    """Writes the contents of the torch.save file `input_path` (see the module docstring) as a
    checkpoint under `root`, of `iteration` (None: the file's, or 0), and points the tracker
    file at it.

    Returns:
        The summary `main()` reports (less `seconds`).

    Raises:
        CheckpointError: `input_path` is missing or not a convertible file, `root` is not a
            directory, or the checkpoint exists and not `force`.
    """
    check_save_root(root)
    contents = _load_input(input_path)
    model, optimizer, common = parse_contents(contents, input_path)
    if common is None:
        common = make_common(TrainState(iteration=iteration or 0))  # weights only
    if iteration is None:
        iteration = common["iteration"]
    elif iteration != common["iteration"]:
        print(
            f"> the file is of iteration {common['iteration']}; writing it as iteration "
            f"{iteration} (its schedule and consumed samples are kept as they are)"
        )
        common = {**common, "iteration": iteration}
    state: dict[str, Any] = {"model": model}
    if optimizer:
        state["optimizer"] = optimizer
    final = write_checkpoint(root, state, common, force)
    return {**_summary(final, state), "iteration": iteration}


def parse_contents(
    contents: Any, source: str
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """Splits the contents of a torch.save file into the model's state dict, the optimizer's
    tensors and `common` (None where the file has none), checking each.

    Raises:
        CheckpointError: the contents are not a full file nor a model state dict.
    """
    if not isinstance(contents, Mapping):
        raise CheckpointError(
            f"{source} holds a {type(contents).__name__}, not a state dict: pass a file written "
            "by `to-torch` or by torch.save(model.state_dict(), ...)."
        )
    if not isinstance(contents.get("model"), Mapping):
        return _check_model(contents, source), None, None
    unknown = sorted(map(str, contents.keys() - set(FULL_KEYS)))
    if unknown:
        raise CheckpointError(
            f"{source} has entries {unknown} besides {list(FULL_KEYS)}: it is not a file "
            "written by `to-torch`. Pass one, or a bare model state dict."
        )
    model = _check_model(contents["model"], f"{source}'s 'model'")
    optimizer = contents.get("optimizer")
    if optimizer is not None:
        optimizer = _check_optimizer(optimizer, model, source)
    common = contents.get("common")
    if common is not None:
        common = _check_common(common, optimizer, source)
    elif optimizer:
        raise CheckpointError(
            f"{source} has optimizer state but no 'common' (parameter groups, schedule, "
            "iteration), without which training cannot resume from it; convert the checkpoint "
            "again with `to-torch`, or drop 'optimizer' to write the weights only."
        )
    return model, optimizer, common


def _check_model(state: Mapping, source: str) -> dict[str, Any]:
    if not state:
        raise CheckpointError(f"{source} is empty: it holds no model weights.")
    bad = [
        repr(name)
        for name, value in state.items()
        if not isinstance(name, str)
        or not (isinstance(value, torch.Tensor) or name.endswith(EXTRA_STATE_SUFFIX))
    ]
    if bad:
        raise CheckpointError(
            f"{source} is not a model state dict ({{name: tensor}}): {len(bad)} entr(ies) are "
            f"not named tensors (e.g. {', '.join(bad[:3])}). Pass a file written by `to-torch` "
            "or by torch.save(model.state_dict(), ...)."
        )
    return _in_stacked_expert_names(dict(state), source)


def _in_stacked_expert_names(state: dict[str, Any], source: str) -> dict[str, Any]:
    """`state` with Megatron-core's per-expert MoE entries stacked as this project saves them,
    and without the None `_extra_state` entries of Megatron-core's local linears (they hold
    nothing; this project's extra states are never None)."""
    try:
        stack_upstream_experts(state)
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from error
    return {
        name: value
        for name, value in state.items()
        if not (value is None and name.endswith(EXTRA_STATE_SUFFIX))
    }


def _check_optimizer(optimizer: Any, model: Mapping, source: str) -> dict[str, Any]:
    def fail(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{source}'s 'optimizer' {problem}; it must be {{'state': {{param name: {{state "
            "name: tensor}}, 'fp32_from_fp16_params': {param name: tensor}, 'grad_scaler': "
            "{name: tensor}} as `to-torch` writes it. Convert the checkpoint again."
        )

    if not isinstance(optimizer, Mapping):
        raise fail(f"is a {type(optimizer).__name__}")
    unknown = sorted(map(str, optimizer.keys() - set(OPTIMIZER_KEYS)))
    if unknown:
        raise fail(f"has entries {unknown}")
    state = optimizer.get("state", {})
    masters = optimizer.get("fp32_from_fp16_params", {})
    scaler = optimizer.get("grad_scaler", {})
    if not isinstance(scaler, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in scaler.values()
    ):
        raise fail("has a 'grad_scaler' that is not {name: tensor}")
    if not isinstance(state, Mapping) or not all(
        isinstance(values, Mapping) and all(isinstance(v, torch.Tensor) for v in values.values())
        for values in state.values()
    ):
        raise fail("has a 'state' that is not {param name: {state name: tensor}}")
    if not isinstance(masters, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in masters.values()
    ):
        raise fail("has 'fp32_from_fp16_params' that are not {param name: tensor}")
    strangers = sorted((state.keys() | masters.keys()) - model.keys())
    if strangers:
        raise fail(f"holds state of parameters the model does not have ({strangers[:3]})")
    return {key: dict(optimizer[key]) for key in OPTIMIZER_KEYS if optimizer.get(key)}


def _check_common(common: Any, optimizer: dict[str, Any] | None, source: str) -> dict[str, Any]:
    if not isinstance(common, Mapping):
        raise CheckpointError(
            f"{source}'s 'common' is a {type(common).__name__}, not the dict of a checkpoint's "
            f"{COMMON_FILENAME}. Convert the checkpoint again with `to-torch`."
        )
    version = common.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{source} is of checkpoint version {version}; this code writes version "
            f"{CHECKPOINT_VERSION}. Convert the checkpoint with the code that saved it, or pass "
            "only its model weights."
        )
    missing = [key for key in COMMON_KEYS if key not in common and key not in OPTIONAL_COMMON_KEYS]
    if missing or not isinstance(common.get("iteration"), int):
        raise CheckpointError(
            f"{source}'s 'common' lacks {missing or ['an integer iteration']}, which loading "
            "reads. Convert the checkpoint again with `to-torch`."
        )
    if optimizer and common["param_groups"] is None:
        raise CheckpointError(
            f"{source} has optimizer state, but its 'common' has no parameter groups (the "
            "mark of a weights-only checkpoint), so loading would ignore it. Convert the "
            "checkpoint again with `to-torch`, or drop 'optimizer'."
        )
    return dict(common)


def _load_input(path: str) -> Any:
    if not os.path.exists(path):
        raise CheckpointError(f"--input {path}: no such file. Pass a file written by to-torch.")
    if os.path.isdir(path):
        raise CheckpointError(
            f"--input {path} is a directory; from-torch reads a torch.save file (to convert a "
            "checkpoint directory, use to-torch)."
        )
    print(f"> reading {path}")
    try:
        # A full file holds Python objects (RNG states, arguments): not loadable with
        # weights_only=True. mmap: tensors are paged in as DCP writes them, not all held.
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:
        raise CheckpointError(
            f"--input {path} is not a torch.save file ({type(error).__name__}: {error}). Pass "
            "a file written by to-torch or by torch.save(model.state_dict(), ...)."
        ) from error


def _check_output_file(output: str, force: bool) -> None:
    if os.path.isdir(output):
        raise CheckpointError(f"--output {output} is a directory; pass a file name.")
    if os.path.exists(output) and not force:
        raise CheckpointError(
            f"--output {output} exists already; pass --force to replace it, or another --output."
        )


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, Mapping):
        return [tensor for value in tree.values() for tensor in _tensors(value)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _summary(path: str, state: Mapping[str, Any]) -> dict[str, Any]:
    tensors = _tensors(state)
    return {
        "path": path,
        "tensors": len(tensors),
        "parameters": sum(tensor.numel() for tensor in _tensors(state["model"])),
        "bytes": sum(tensor.numel() * tensor.element_size() for tensor in tensors),
    }


def _format_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


if __name__ == "__main__":
    try:
        main()
    except CheckpointError as error:
        sys.exit(f"{os.path.basename(__file__)}: error: {error}")
