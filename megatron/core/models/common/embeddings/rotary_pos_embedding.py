"""Rotary position embeddings (RoPE, Su et al. 2021) in Megatron-LM's layout.

`RotaryEmbedding` produces the rotation angles for a sequence once per forward; every attention
layer then rotates its queries and keys with `apply_rotary_pos_emb`. The module holds no
parameters or buffers: the frequencies are recomputed in `forward` (a handful of tiny kernels),
so a model built on the `meta` device needs no re-initialisation here, and casting the model to
bf16 cannot degrade them.

The cosines and sines of the angles are computed once per angles tensor (every layer of a forward
gets the same one), and the rotation is four elementwise kernels: the host launches them for every
query and key of every layer, forward and backward, so their count is part of the step's launch
overhead.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary


class RotaryEmbedding(torch.nn.Module):
    """Rotation angles for rotary position embeddings.

    The arguments after `rotary_percent` are keyword-only: Megatron-LM's third positional
    argument is `rotary_interleaved`, so a positional call ported from there must fail rather
    than set `rotary_base`.

    Args:
        kv_channels: Width of one attention head.
        rotary_percent: Fraction of each head's channels that is rotated (the rest pass
            through unchanged).
        rotary_base: Base of the geometric progression of frequencies.

    Raises:
        ValueError: `rotary_percent` is outside (0, 1] or the rotated width is not a positive
            even number.
    """

    def __init__(
        self, kv_channels: int, rotary_percent: float = 1.0, *, rotary_base: float = 10000
    ):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}.")
        dim = int(kv_channels * rotary_percent)
        if dim < 2 or dim % 2:
            raise ValueError(
                f"kv_channels * rotary_percent = {kv_channels} * {rotary_percent} gives {dim} "
                "rotated channels; it must be a positive even number, adjust rotary_percent."
            )
        self.dim = dim
        self.rotary_base = rotary_base

    def forward(
        self, max_seq_len: int, offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Angles for positions `offset .. offset + max_seq_len - 1`.

        Args:
            max_seq_len: Number of positions.
            offset: First position.
            device: Device of the result (where the attention runs).

        Returns:
            float32 tensor of shape [max_seq_len, 1, 1, dim] (broadcasts over batch and heads
            of the [s, b, n, d] query/key layout).
        """
        # Always float32: bf16 angles would be off by whole radians at long positions.
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        inv_freq = 1.0 / (self.rotary_base**exponents)
        positions = torch.arange(max_seq_len, dtype=torch.float32, device=device) + offset
        freqs = torch.outer(positions, inv_freq)
        # Megatron's non-interleaved layout: the two halves of the rotated channels form pairs.
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rotary_base={self.rotary_base}"


_tables: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Angles tensor -> (its version, {dtype: (cos, signed sin)}): see `_rotation_tables`."""


def _rotation_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos(freqs)` and `sin(freqs)` with its first half negated, in `dtype`, so that
    `t * cos + t.roll(rot_dim // 2, -1) * sin` rotates `t` (the roll swaps the halves, which
    Megatron's layout pairs).

    Kept for as long as `freqs` lives and is not modified in place; angles that require grad
    (trained ones) are not kept, so that each forward differentiates its own.
    """
    if freqs.requires_grad:
        return _compute_tables(freqs, dtype)
    version, by_dtype = _tables.get(freqs, (None, None))
    if version != freqs._version:
        by_dtype = {}
        _tables[freqs] = (freqs._version, by_dtype)
    tables = by_dtype.get(dtype)
    if tables is None:
        tables = by_dtype[dtype] = _compute_tables(freqs, dtype)
    return tables


def _compute_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    half = freqs.shape[-1] // 2
    sin = torch.sin(freqs)
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return torch.cos(freqs).to(dtype), signed_sin.to(dtype)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotates the first `freqs.shape[-1]` channels of `t` by the angles in `freqs`.

    Args:
        t: Queries or keys, [s, b, n, d].
        freqs: Angles from `RotaryEmbedding`, [s, 1, 1, rot_dim] with rot_dim <= d.

    Returns:
        Tensor like `t`, in `t`'s dtype: `t * cos + rotate_half(t) * sin` on the rotated
        channels, with `rotate_half(x) = cat(-x2, x1)` over the halves x1, x2 of `x`.
    """
    rot_dim = freqs.shape[-1]
    cos, sin = _rotation_tables(freqs, t.dtype)
    partial = rot_dim < t.shape[-1]
    t_rot = t[..., :rot_dim] if partial else t
    t_rot = t_rot * cos + t_rot.roll(rot_dim // 2, dims=-1) * sin
    return torch.cat((t_rot, t[..., rot_dim:]), dim=-1) if partial else t_rot
