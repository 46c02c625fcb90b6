"""The safetensors files of a Hugging Face model directory, read one tensor at a time and
written one group of tensors (one transformer layer) at a time.

A directory holds `model.safetensors`, or shards named by `model.safetensors.index.json`'s
`weight_map` (as `save_pretrained()` writes them). `HFWeights` reads a tensor by opening its
file for that tensor alone: safetensors maps the file and the tensor's pages stay mapped (and
counted in the process's memory) only as long as the tensor lives.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping

import torch

from megatron.training.hf_conversion.config import HFConversionError

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
"""The safetensors dtypes of weights that convert (others: integer or quantised data)."""

_COMPARED_BYTES = 64 * 2**20
"""The float64 bytes of each block of rows `HFWeights.equal` compares by default."""


def _safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError as error:
        raise HFConversionError(
            "reading and writing Hugging Face weights needs the safetensors package: pip "
            "install safetensors"
        ) from error
    return safetensors


class HFWeights:
    """The tensors of a Hugging Face model directory: their files, shapes and dtypes.

    Args:
        directory: The model directory.

    Raises:
        HFConversionError: it holds no safetensors weights, the index or a weights file is
            damaged or names a missing file, or a tensor has a dtype that does not convert.
    """

    def __init__(self, directory: str):
        safetensors = _safetensors()
        index = os.path.join(directory, INDEX_FILENAME)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as stream:
                    contents = json.load(stream)
            except ValueError as error:  # not JSON, or not UTF-8
                raise HFConversionError(
                    f"{index} is not JSON ({error}); it is damaged: save the model again."
                ) from error
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFConversionError(f"{index} has no weight_map; it is damaged.")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(directory, SINGLE_FILENAME)):
            files = [SINGLE_FILENAME]
        else:
            present = sorted(os.listdir(directory))
            raise HFConversionError(
                f"{directory} holds no safetensors weights (neither {SINGLE_FILENAME} nor "
                f"{INDEX_FILENAME}; it has {present[:8]}). Save the model with "
                "save_pretrained(directory, safe_serialization=True)."
            )
        self.directory = directory
        self.files: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for file in files:
            path = os.path.join(directory, file)
            if not os.path.isfile(path):
                raise HFConversionError(f"{index} names {file}, which is not in {directory}.")
            try:
                self._read_header(safetensors, path)
            except safetensors.SafetensorError as error:
                raise HFConversionError(
                    f"{path} is not a readable safetensors file ({error}); it is damaged or "
                    "incomplete: save or download the model again."
                ) from error

    def _read_header(self, safetensors: types.ModuleType, path: str) -> None:
        """Records the names, shapes and dtypes of the tensors in the file `path`."""
        with safetensors.safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                entry = handle.get_slice(name)
                dtype = entry.get_dtype()
                if dtype not in _DTYPES:
                    raise HFConversionError(
                        f"{name} in {path} is of dtype {dtype}; only floating-point weights "
                        f"({', '.join(_DTYPES)}) convert, not quantised ones."
                    )
                self.files[name] = path
                self.shapes[name] = tuple(entry.get_shape())
                self.dtypes[name] = _DTYPES[dtype]

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` (backed by its file's pages until it is freed)."""
        with _safetensors().safe_open(self.files[name], framework="pt") as handle:
            return handle.get_tensor(name)

    def equal(self, first: str, second: str, block_bytes: int = _COMPARED_BYTES) -> bool:
        """Whether the tensors `first` and `second` (of one dimension or more) hold the same
        values in the same shape, in any dtypes; read a block of rows at a time (about
        `block_bytes` in float64), not whole."""
        shape = self.shapes[first]
        if shape != self.shapes[second]:
            return False
        row = max(1, torch.Size(shape[1:]).numel()) * 8  # bytes of a row in float64
        step = max(1, block_bytes // row)
        safetensors = _safetensors()
        with (
            safetensors.safe_open(self.files[first], framework="pt") as one,
            safetensors.safe_open(self.files[second], framework="pt") as other,
        ):
            rows, other_rows = one.get_slice(first), other.get_slice(second)
            for start in range(0, shape[0], step):
                block = slice(start, start + step)
                # float64 holds every value of the other dtypes exactly.
                if not torch.equal(rows[block].double(), other_rows[block].double()):
                    return False
        return True


def write_shard(path: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Writes `tensors` as the safetensors file `path`, marked as PyTorch's."""
    _safetensors().torch.save_file(dict(tensors), path, metadata={"format": "pt"})


def write_index(directory: str, weight_map: Mapping[str, str], total_size: int) -> None:
    """Writes `model.safetensors.index.json`: each tensor's file, and the tensors' bytes."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, INDEX_FILENAME), "w", encoding="utf-8") as stream:
        json.dump(index, stream, indent=2)
        stream.write("\n")
