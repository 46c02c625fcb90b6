"""Checkpoints of pipeline stages: what each rank saves and loads of the whole model.

A checkpoint holds the whole model under the names it has without stages
(`megatron.core.pipeline_parallel.global_names`): each rank saves the tensors of its model
chunks under their global names, so the stages' writes together are the checkpoint a run with
one stage writes, and it loads at any pipeline size (each rank reads the tensors of the chunks
it holds now). The last stage's copies of the first stage's embeddings (the tied word
embeddings, or those of the multi-token prediction depths) are not saved (the first stage's
originals are) and load from the originals. The optimizer's states are keyed
by the same names (`MegatronOptimizer.sharded_state_dict`), and its parameter groups, of which
each stage holds a part, are merged into the whole model's (`merge_param_groups`) that every
stage's optimizer takes its part of on loading.

With several model chunks per rank (virtual pipeline stages) the chunks are the list
Megatron-core's training loop holds; one module is one chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.global_names import embedding_copy_names, global_names
from megatron.core.pipeline_parallel.stage import Model, model_chunks, pipeline_group
from megatron.training.checkpoint_layout import CheckpointError


@dataclasses.dataclass
class StageState:
    """This rank's model state under the whole model's names.

    Attributes:
        values: global name -> the value of the chunk's state dict entry.
        where: global name -> (index of the chunk, its local name).
        copies: global names this rank holds only as a copy of another stage's tensor (the
            last stage's copies of the first stage's embeddings): loaded, never saved.
    """

    values: dict[str, Any]
    where: dict[str, tuple[int, str]]
    copies: set[str]

    def saved(self) -> dict[str, Any]:
        """The entries this rank writes into a checkpoint."""
        return {name: value for name, value in self.values.items() if name not in self.copies}

    def shapes(self) -> dict[str, torch.Size]:
        """Each tensor's (global) shape."""
        return {
            name: value.shape
            for name, value in self.values.items()
            if isinstance(value, torch.Tensor)
        }


def stage_state(model: Model) -> StageState:
    """The state dicts of this rank's chunks, under the whole model's names.

    Raises:
        ValueError: two chunks hold an entry of the same global name (chunks of one rank
            overlap: they are not one pipeline's).
    """
    values: dict[str, Any] = {}
    where: dict[str, tuple[int, str]] = {}
    copies: set[str] = set()
    for index, chunk in enumerate(model_chunks(model)):
        copy_names = embedding_copy_names(chunk)
        state = chunk.state_dict()
        for name, whole in global_names(chunk, state).items():
            if whole in where:
                raise ValueError(
                    f"Model chunks {where[whole][0]} and {index} both hold {whole}: a rank's "
                    "chunks must be distinct parts of the model (its virtual pipeline stages)."
                )
            values[whole] = state[name]
            where[whole] = (index, name)
            if name in copy_names:
                copies.add(whole)
    return StageState(values, where, copies)


def load_stage_state(model: Model, state: StageState, values: dict[str, Any]) -> None:
    """Loads `values` (global name -> value, for the entries of `state`; an entry left out is
    left to its module, as `load_state_dict` does) into the chunks."""
    chunks = model_chunks(model)
    per_chunk: list[dict[str, Any]] = [{} for _ in chunks]
    for whole, (index, name) in state.where.items():
        if whole in values:
            per_chunk[index][name] = values[whole]
    for chunk, chunk_values in zip(chunks, per_chunk):
        chunk.load_state_dict(chunk_values)


def whole_model_shapes(state: StageState, config: Any) -> dict[str, torch.Size]:
    """The shape of every tensor of the whole model: this rank's with one stage, else those of
    every stage of its pipeline (gathered over the pipeline group, which holds the model once),
    so that every rank checks a checkpoint against the same tensors."""
    shapes = state.shapes()
    group = pipeline_group(None) if _stages(config) > 1 else None
    if group is None:
        return shapes
    gathered: list[dict[str, torch.Size] | None] = [None] * group.size()
    dist.all_gather_object(gathered, shapes, group=group)
    whole: dict[str, torch.Size] = {}
    for stage_shapes in gathered:
        whole.update(stage_shapes)
    return whole


def _stages(config: Any) -> int:
    return 1 if config is None else config.pipeline_model_parallel_size


def merge_param_groups(per_rank: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The parameter groups of the whole model from those of every rank's optimizer (each
    saved with its parameters' global names): groups of the same hyperparameters are one
    group, holding every rank's parameters once, in the order they first appear."""
    merged: dict[tuple, dict[str, Any]] = {}
    # Each group's names as an ordered set: a list scan per name would cost parameters x ranks
    # per name (every data-parallel rank of a stage lists the same names).
    names: dict[tuple, dict[str, None]] = {}
    for groups in per_rank:
        for group in groups:
            hyperparameters = {key: value for key, value in group.items() if key != "params"}
            key = tuple(sorted((name, repr(value)) for name, value in hyperparameters.items()))
            if key not in merged:
                merged[key] = hyperparameters
                names[key] = {}
            names[key].update(dict.fromkeys(group["params"]))
    return [{**merged[key], "params": list(names[key])} for key in merged]


def saved_optimizer_tensors_here(
    saved: dict[tuple[str, ...], Any], elsewhere: set[str]
) -> dict[tuple[str, ...], Any]:
    """The checkpoint's optimizer tensors less the states and fp32 masters of parameters that
    only other pipeline stages hold (`elsewhere`)."""
    return {
        path: value
        for path, value in saved.items()
        if not (path[0] in ("state", "fp32_from_fp16_params") and path[1] in elsewhere)
    }


def without_copies(optimizer_state: dict[str, Any], copies: set[str]) -> dict[str, Any]:
    """An optimizer's `sharded_state_dict()` less the states and fp32 masters of `copies` (the
    last stage's copies of the first stage's embeddings: the originals' are saved, and
    equal)."""
    return {
        key: (
            {name: value for name, value in entry.items() if name not in copies}
            if key in ("state", "fp32_from_fp16_params")
            else entry
        )
        for key, entry in optimizer_state.items()
    }


def raise_on_every_rank(error: Exception | None) -> None:
    """Raises `error` on the rank that found it and its message on every other rank (checks
    of a rank's own part of the model can fail on some ranks only; every rank must stop rather
    than wait at the next collective).

    Raises:
        CheckpointError: some rank found an error (its message; the first rank's of several).
    """
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else str(error))
    first = next((message for message in messages if message is not None), None)
    if first is None:
        return
    if error is not None and str(error) == first:
        raise error
    raise CheckpointError(first) from error
