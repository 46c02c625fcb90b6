"""The names a pipeline chunk's state has in the whole model, as Megatron-core's sharded state
dicts give them: what a checkpoint holds, so that it loads at any pipeline size.

A chunk's decoder numbers its layers from 0 (`decoder.layers.0` is the chunk's first layer);
in the whole model that layer is `decoder.layers.<its global index>` (`TransformerBlock.
layer_range`). With tied embeddings the last stage's copy of the word embeddings
(`output_layer.weight`, `tied_embeddings`) is the whole model's `embedding.word_embeddings.
weight`: the first stage holds the original, which a checkpoint saves; the copy loads from it.
With one stage every name is its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from megatron.core.pipeline_parallel.tied_embeddings import tied_embedding_weight

EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
"""The word embeddings' name in the whole model (the first stage's parameter)."""

_LAYER = re.compile(r"(decoder\.layers\.)(\d+)(\..*)")


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def tied_copy_name(chunk: torch.nn.Module) -> str | None:
    """The local name of the chunk's copy of the tied word embeddings (the last stage's output
    layer, when the embedding lives on another stage); None where the chunk holds none."""
    module = _unwrapped(chunk)
    if getattr(module, "pre_process", True) or tied_embedding_weight(module) is None:
        return None
    return "output_layer.weight"


def global_name(chunk: torch.nn.Module, name: str) -> str:
    """`name`, a key of the (unwrapped) chunk's state dict or parameters, as the whole model
    names it (module docstring)."""
    if name == tied_copy_name(chunk):
        return EMBEDDING_WEIGHT
    match = _LAYER.fullmatch(name)
    decoder = getattr(_unwrapped(chunk), "decoder", None)
    if match is None or decoder is None:
        return name
    layer = decoder.layers[int(match.group(2))]
    return f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"


def global_names(chunk: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Each of `names` (keys of the chunk's state dict) -> its name in the whole model."""
    return {name: global_name(chunk, name) for name in names}
