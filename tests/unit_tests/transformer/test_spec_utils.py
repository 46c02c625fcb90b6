"""ModuleSpec / build_module: how specs turn into modules."""

import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class _Parts:
    width: int = 3


class _Block(torch.nn.Module):
    def __init__(self, size, *, scale=1.0, submodules=None):
        super().__init__()
        self.size, self.scale, self.submodules = size, scale, submodules


def test_class_is_called_with_args_params_and_submodules():
    spec = ModuleSpec(module=_Block, params={"scale": 2.0}, submodules=_Parts(width=5))
    block = build_module(spec, 7)
    assert (block.size, block.scale, block.submodules.width) == (7, 2.0, 5)
    assert build_module(_Block, 4).size == 4


def test_functions_are_returned_uncalled():
    assert build_module(F.gelu) is F.gelu
    assert build_module(ModuleSpec(module=F.silu)) is F.silu


def test_module_path_tuple_is_imported():
    linear = build_module(ModuleSpec(module=("torch.nn", "Linear")), 2, 3)
    assert isinstance(linear, torch.nn.Linear) and linear.out_features == 3


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_build_errors_name_the_class():
    with pytest.raises(TypeError) as info:
        build_module(ModuleSpec(module=_Block, params={"unknown": 1}), 1)
    assert "_Block" in "".join(getattr(info.value, "__notes__", []))


def test_empty_slot_raises():
    with pytest.raises(ValueError, match="empty"):
        build_module(None)
