"""Comparisons with Megatron-core's golden results: a case's local model, and its loss and
gradients against those the fixture recorded from upstream on the same weights and batch.

A fixture case holds its `TransformerConfig` fields as plain values (the activation by name), so
that the fixture makers, which run upstream's package, and these tests build the same model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.activations import quick_gelu
from megatron.core.transformer.transformer_config import TransformerConfig

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "quick_gelu": quick_gelu}
"""The activations fixture cases name."""


def case_config(fields: dict[str, Any], **overrides) -> TransformerConfig:
    """The `TransformerConfig` of a case's fields (its `"activation"` by name), `overrides`
    replacing or adding fields."""
    fields = {**fields, **overrides}
    activation = ACTIVATIONS[fields.pop("activation")]
    return TransformerConfig(**fields, activation_func=activation)


def assert_matches_golden(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    expected: dict[str, Any],
    **tolerances: float,
) -> None:
    """`model`'s loss on the batch and the gradients of its sum are `expected`'s (`"loss"`,
    `"grads"` by parameter name, on CPU), within `torch.testing.assert_close`'s `tolerances`
    (its defaults when none are given)."""
    loss = model(tokens, labels=labels)
    torch.testing.assert_close(loss.cpu(), expected["loss"], **tolerances)
    loss.sum().backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    assert grads.keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(grads[name].cpu(), grad, msg=name, **tolerances)
