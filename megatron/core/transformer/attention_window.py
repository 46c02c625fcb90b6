"""Sliding-window attention: which key positions a query sees, and which layers have a window.

Megatron-LM's `window_size = (left, right)` lets query i attend to the keys j with
`i - left <= j <= i + right`, -1 meaning unlimited on that side. The decoder is causal, so a
key after its query is masked whatever `right` says: `right` must be 0 or -1 (Transformer
Engine's causal attention, upstream's training path, sets it to 0 likewise), and a window of
`left` narrows causal attention to the query's own position and the `left` before it (gpt-oss's
`127,0` sees 128 positions). `left = -1` is plain causal attention.

`window_attn_skip_freq` picks the layers that keep full (causal) attention, as upstream: an int N
gives every N-th layer full attention (layers N, 2N, ..., counted from 1) and the others the
window; a list holds one entry per layer, 1 for a windowed layer and 0 for a full one. None: every
layer has the window.

`causal_window_mask` is the window as a dense boolean mask (Megatron's convention, True = masked
out); `causal_window_mask_mod` the same as a FlexAttention `mask_mod`, from which a block-sparse
`BlockMask` skips the blocks outside the window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

UNLIMITED = -1
"""A side of `window_size` without a limit (Megatron-core's and Transformer Engine's -1)."""


def check_window_config(config: TransformerConfig) -> None:
    """Checks `window_size` and `window_attn_skip_freq` (called by `TransformerConfig`).

    Raises:
        ValueError: a window that is not two ints, a left side below -1, a right side other
            than 0 or -1, or a skip frequency that is not an int >= 1 or a 0/1 list of one entry
            per layer (or is given without a window); the message names the fix.
    """
    window, freq = config.window_size, config.window_attn_skip_freq
    if window is None:
        if freq is not None:
            raise ValueError(
                f"window_attn_skip_freq picks the layers without a sliding window ({freq!r}), "
                "but no window_size is set; set window_size or drop window_attn_skip_freq."
            )
        return
    if len(window) != 2 or any(type(side) is not int for side in window):
        raise ValueError(
            f"window_size must be two ints (left, right), got {window!r}; e.g. (127, 0) for "
            "gpt-oss's window of 128 positions."
        )
    left, right = window
    if left < UNLIMITED:
        raise ValueError(
            f"window_size's left side {left} must be >= 0 (positions before the query) or -1 "
            "(unlimited)."
        )
    if right not in (0, UNLIMITED):
        raise ValueError(
            f"window_size's right side {right}: the decoder is causal and never attends to "
            "later positions (Transformer Engine's causal attention sets it to 0 as well); pass "
            "0 (or -1)."
        )
    if isinstance(freq, list):
        if len(freq) != config.num_layers or any(v not in (0, 1) for v in freq):
            raise ValueError(
                f"window_attn_skip_freq as a list needs one 1 (sliding window) or 0 (full "
                f"attention) per layer ({config.num_layers}), got {freq}."
            )
    elif freq is not None and (type(freq) is not int or freq < 1):
        raise ValueError(
            f"window_attn_skip_freq must be an int N >= 1 (every N-th layer has full attention) "
            f"or a list of 0/1 per layer, got {freq!r}."
        )


def is_layer_window_attention(
    window_size: tuple[int, int] | None,
    window_attn_skip_freq: int | list[int] | None,
    layer_number: int,
) -> bool:
    """Whether layer `layer_number` (1-based) has the sliding window (Megatron-core's function
    of `megatron.core.transformer.utils`, with its arguments)."""
    if window_size is None:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, list):
        return bool(window_attn_skip_freq[layer_number - 1])
    return layer_number % window_attn_skip_freq != 0


def layer_window(config: TransformerConfig, layer_number: int) -> int | None:
    """The left window of layer `layer_number` (1-based): the positions before the query it
    sees; None for full causal attention (no window, or an unlimited one)."""
    if not is_layer_window_attention(
        config.window_size, config.window_attn_skip_freq, layer_number
    ):
        return None
    left = config.window_size[0]
    return None if left == UNLIMITED else left


def causal_window_mask(
    seq_len: int, window: int | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """[seq_len, seq_len] boolean, True where query i may not see key j: j > i, or with a
    window j < i - window."""
    query = torch.arange(seq_len, device=device).unsqueeze(1)
    key = torch.arange(seq_len, device=device).unsqueeze(0)
    masked = key > query
    if window is not None:
        masked |= key < query - window
    return masked


def causal_window_mask_mod(
    window: int | None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The FlexAttention `mask_mod` of `causal_window_mask` (True where the query sees the
    key)."""

    def mask_mod(
        batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> torch.Tensor:
        visible = query >= key
        if window is not None:
            visible = visible & (query - key <= window)
        return visible

    return mask_mod
