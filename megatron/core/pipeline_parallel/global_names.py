"""The names a pipeline chunk's state has in the whole model, as Megatron-core's sharded state
dicts give them: what a checkpoint holds, so that it loads at any pipeline size.

A chunk's decoder numbers its layers from 0 (`decoder.layers.0` is the chunk's first layer);
in the whole model that layer is `decoder.layers.<its global index>` (`TransformerBlock.
layer_range`). The last stage's copies of the first stage's embeddings (`tied_embeddings.
embedding_copies`: the tied word embeddings as its `output_layer.weight`, or the embedding the
multi-token prediction depths use) are the whole model's `embedding.word_embeddings.weight`
(and `embedding.position_embeddings.weight`): the first stage holds the originals, which a
checkpoint saves; the copies load from them. The FP8 delayed-scaling state of a decoder that
holds part of the layers (`decoder.fp8_state._extra_state`: the amax histories and scales of
its FP8 layers, one state per chunk) is `decoder.fp8_state.layers_<start>_<stop>._extra_state`,
the chunk's layers [start, stop): each chunk's loads back at the same split, and a chunk of
another split finds none and starts its histories afresh. With one stage every name is its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from megatron.core.pipeline_parallel.tied_embeddings import embedding_copies

EMBEDDING_NAMES = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
"""The whole model's names of the embeddings the last stage may copy, in the order of
`embedding_copies`."""

_LAYER = re.compile(r"(decoder\.layers\.)(\d+)(\..*)")
_FP8_STATE = "decoder.fp8_state._extra_state"


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def embedding_copy_names(chunk: torch.nn.Module) -> dict[str, str]:
    """The chunk's copies of the first stage's embeddings (on a chunk without the embedding's
    originals: the last stage's), by local name -> the whole model's name; empty elsewhere."""
    module = _unwrapped(chunk)
    if getattr(module, "pre_process", True):
        return {}
    copies = embedding_copies(module)
    if not copies:
        return {}
    local = {id(param): name for name, param in module.named_parameters()}
    return {local[id(param)]: whole for param, whole in zip(copies, EMBEDDING_NAMES)}


def global_names(chunk: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Each of `names` (keys of the unwrapped chunk's state dict, or its parameters' names) ->
    its name in the whole model (module docstring)."""
    copies = embedding_copy_names(chunk)
    decoder = getattr(_unwrapped(chunk), "decoder", None)
    whole = {}
    for name in names:
        match = _LAYER.fullmatch(name)
        if name in copies:
            whole[name] = copies[name]
        elif name == _FP8_STATE and decoder is not None and _holds_part(decoder):
            layers = decoder.layer_range
            whole[name] = f"decoder.fp8_state.layers_{layers.start}_{layers.stop}._extra_state"
        elif match is None or decoder is None:
            whole[name] = name
        else:
            layer = decoder.layers[int(match.group(2))]
            whole[name] = f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"
    return whole


def _holds_part(decoder: torch.nn.Module) -> bool:
    """Whether the decoder holds part of the model's layers (a pipeline chunk's)."""
    return len(decoder.layer_range) != decoder.config.num_layers


def global_name(chunk: torch.nn.Module, name: str) -> str:
    """One name as `global_names` gives it."""
    return global_names(chunk, [name])[name]
