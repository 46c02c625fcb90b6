"""Module specs: which class fills each slot of a layer, decided outside the layer.

A layer such as `TransformerLayer` names its parts (norms, attention, MLP) but does not pick their
classes; a `ModuleSpec` does. The same layer code therefore builds a torch-only model, an apex- or
Transformer-Engine-backed model, or a test double, depending on the spec it is given (Megatron-LM's
`megatron.core.transformer.spec_utils`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModuleSpec:
    """What to build for one slot.

    Attributes:
        module: The class (or factory function) to call, or a `(module_path, name)` tuple that
            is imported when the spec is built.
        params: Extra keyword arguments for the constructor, fixed by the spec.
        submodules: The submodules dataclass handed to the constructor as `submodules=`, for
            modules that are themselves built from specs.
    """

    module: type | Callable | tuple[str, str]
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def import_module(module_path: tuple[str, str]) -> Any:
    """Imports `name` from the module at `module_path[0]`."""
    base_path, name = module_path
    return getattr(importlib.import_module(base_path), name)


def get_module(spec_or_module: ModuleSpec | type | Callable) -> Any:
    """Returns the class or function a spec names, without building it."""
    if not isinstance(spec_or_module, ModuleSpec):
        return spec_or_module
    if isinstance(spec_or_module.module, tuple):
        return import_module(spec_or_module.module)
    return spec_or_module.module


def build_module(spec_or_module: ModuleSpec | type | Callable, *args, **kwargs) -> Any:
    """Builds what a spec describes.

    A class is called with `*args`, the spec's `params`, `submodules=` (when the spec has
    submodules) and `**kwargs`. Anything else (a function, also a built-in such as `F.gelu`) is
    returned as is, un-called, as in Megatron-LM: such slots hold callables like activations.

    Args:
        spec_or_module: A `ModuleSpec`, a class or a function.
        *args: Positional constructor arguments.
        **kwargs: Keyword constructor arguments supplied by the caller.

    Returns:
        The built module (or the function).

    Raises:
        ValueError: The slot is empty (None).
    """
    module = get_module(spec_or_module)
    if module is None:
        raise ValueError("a module spec slot is empty (None); give it a class or a ModuleSpec.")
    if not isinstance(module, type):
        return module
    params = dict(getattr(spec_or_module, "params", None) or {})
    submodules = getattr(spec_or_module, "submodules", None)
    if submodules is not None:
        kwargs["submodules"] = submodules
    try:
        return module(*args, **params, **kwargs)
    except Exception as error:
        # The traceback alone does not say which slot of which spec failed to build.
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"(while building {module.__qualname__} from a module spec)")
        raise
