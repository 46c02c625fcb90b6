"""Rotary position embeddings (RoPE, Su et al. 2021) in Megatron-LM's layout.

`RotaryEmbedding` produces the rotation angles for a sequence (computed at its first forward for
that length and kept); every attention layer then rotates its queries and keys with
`apply_rotary_pos_emb`. The module holds no parameters or buffers: the frequencies are computed
from its hyperparameters on the forward's device (a handful of tiny kernels), so a model built on
the `meta` device needs no re-initialisation here, and casting the model to bf16 cannot degrade
them.

The cosines and sines of the angles are computed once per angles tensor (every layer of a forward
gets the same one). `rotate_query_and_key` rotates a layer's queries and keys in one Triton
kernel per direction with `fused=True` (the config's `apply_rope_fusion`) where `fused_rope`
supports the call; otherwise, and in `apply_rotary_pos_emb`, the rotation of each tensor is four
elementwise PyTorch kernels.
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megatron.core.fusions.fused_rope import fused_rope_supported, fused_rotary_pos_emb


class RotaryEmbedding(torch.nn.Module):
    """Rotation angles for rotary position embeddings.

    The arguments after `rotary_percent` are keyword-only: Megatron-LM's third positional
    argument is `rotary_interleaved`, so a positional call ported from there must fail rather
    than set `rotary_base`.

    Args:
        kv_channels: Width of one attention head.
        rotary_percent: Fraction of each head's channels that is rotated (the rest pass
            through unchanged).
        rotary_interleaved: Angles laid out for pairs of adjacent channels (`[f0, f0, f1, f1,
            ...]`) instead of the two halves (`[f0, f1, ..., f0, f1, ...]`).
        seq_len_interpolation_factor: Divide the positions by it (linear position
            interpolation); None leaves them.
        rotary_base: Base of the geometric progression of frequencies.
        rope_scaling: Rescale the frequencies as Llama 3.x does (`llama3_inv_freq`).
        rope_scaling_factor: Llama 3's `factor` (8 in Llama 3.1).

    Raises:
        ValueError: `rotary_percent` is outside (0, 1], the rotated width is not a positive
            even number, or a scaling factor is not positive.
    """

    concentration_factor: float = 1.0
    """Multiplies the rotated channels (`apply_rotary_pos_emb`'s `mscale`): 1 for RoPE, YaRN's
    own for `YarnRotaryEmbedding`."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        *,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: float = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
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
        for name, value in (
            ("seq_len_interpolation_factor", seq_len_interpolation_factor),
            ("rope_scaling_factor", rope_scaling_factor),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}.")
        self.dim = dim
        self.rotary_base = rotary_base
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.rope_scaling = rope_scaling
        self.rope_scaling_factor = rope_scaling_factor
        self._kept_angles: dict[tuple[int, int, torch.device | str], torch.Tensor] = {}

    def forward(
        self, max_seq_len: int, offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Angles for positions `offset .. offset + max_seq_len - 1`.

        The angles of each (`max_seq_len`, `offset`, `device`) are computed once and returned
        again (as upstream's `lru_cache` does): every step asks for the same ones, and each
        layer of multi-latent attention asks for its own; with them their cosines and sines
        are kept too (`_rotation_tables`). Read them, do not modify them. Under `torch.compile`,
        during CUDA graph capture and under inference mode they are computed at each call.

        Args:
            max_seq_len: Number of positions.
            offset: First position.
            device: Device of the result (where the attention runs).

        Returns:
            float32 tensor of shape [max_seq_len, 1, 1, dim] (broadcasts over batch and heads
            of the [s, b, n, d] query/key layout).
        """
        if _computed_at_each_call():
            return self._angles(max_seq_len, offset, device)
        key = (max_seq_len, offset, torch.get_default_device() if device is None else device)
        angles = self._kept_angles.get(key)
        if angles is None:
            if len(self._kept_angles) == _KEPT_ANGLES:  # offsets of incremental decoding
                self._kept_angles.clear()
            angles = self._kept_angles[key] = self._angles(max_seq_len, offset, device)
        return angles

    def _angles(
        self, max_seq_len: int, offset: int, device: torch.device | str | None
    ) -> torch.Tensor:
        # Always float32: bf16 angles would be off by whole radians at long positions.
        inv_freq = self.inv_freq(device)
        positions = torch.arange(max_seq_len, dtype=torch.float32, device=device) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, inv_freq)
        if self.rotary_interleaved:
            # Adjacent channels form pairs: each angle repeated in place.
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            # Megatron's default layout: the two halves of the rotated channels form pairs.
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The float32 frequencies (radians per position) of the `dim / 2` channel pairs:
        `rotary_base ** (-2i / dim)`, rescaled as Llama 3.x with `rope_scaling`."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        inv_freq = 1.0 / (self.rotary_base**exponents)
        if self.rope_scaling:
            inv_freq = llama3_inv_freq(inv_freq, self.rope_scaling_factor)
        return inv_freq

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, rotary_base={self.rotary_base}, "
            f"rotary_interleaved={self.rotary_interleaved}, rope_scaling={self.rope_scaling}"
        )


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Llama 3.x's rescaling of the RoPE frequencies (Megatron-LM's `_apply_scaling`).

    Wavelengths shorter than `original / high_freq_factor` keep their frequency, those longer
    than `original / low_freq_factor` are divided by `factor`, and those in between are
    interpolated linearly in `original / wavelength` between the two.

    Args:
        inv_freq: Frequencies (radians per position), float32.
        factor: Division of the low frequencies.
        low_freq_factor: Bounds the low-frequency band.
        high_freq_factor: Bounds the high-frequency band.
        original_max_position_embeddings: Context length the model was pre-trained with.

    Returns:
        The rescaled frequencies, same shape.
    """
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


_KEPT_ANGLES = 32
"""How many angle tensors a `RotaryEmbedding` keeps (upstream's `lru_cache` size)."""


def _computed_at_each_call() -> bool:
    """Whether rotation angles and tables are computed, not kept: under `torch.compile`, which
    fuses computing them into the rotation; during CUDA graph capture, whose memory pool they
    would be allocated in; under inference mode, whose tensors autograd refuses to save later."""
    return (
        torch.compiler.is_compiling()
        or torch.is_inference_mode_enabled()
        # A capture needs CUDA initialised: the flag spares the per-layer call a device query.
        or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    )


_tables: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Angles tensor -> (its version, {(dtype, interleaved, mscale): (cos, signed sin)}): see
`_rotation_tables`."""


def _rotation_tables(
    freqs: torch.Tensor, dtype: torch.dtype, interleaved: bool, mscale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos(freqs)` and `sin(freqs)` with the sine of each pair's first channel negated, times
    `mscale` (YaRN's concentration factor; rounded to `dtype` after the product, as upstream),
    in `dtype`, so that `t * cos + swap(t) * sin` rotates `t` (and scales it by `mscale`), where
    `swap` exchanges the two channels of each pair (`_swap_pairs`).

    Kept for as long as `freqs` lives and is not modified in place (every layer's queries and
    keys reuse them); angles that require grad (trained ones) are not kept, so that each forward
    differentiates its own; nor are they where `_computed_at_each_call`.
    """
    if freqs.requires_grad or _computed_at_each_call():
        return _compute_tables(freqs, dtype, interleaved, mscale)
    version, tables_by_key = _tables.get(freqs, (None, None))
    if version != freqs._version:
        tables_by_key = {}
        _tables[freqs] = (freqs._version, tables_by_key)
    key = (dtype, interleaved, mscale)
    tables = tables_by_key.get(key)
    if tables is None:
        tables = tables_by_key[key] = _compute_tables(freqs, dtype, interleaved, mscale)
    return tables


def _compute_tables(
    freqs: torch.Tensor, dtype: torch.dtype, interleaved: bool, mscale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    if interleaved:
        signed_sin = torch.stack((-sin[..., ::2], sin[..., 1::2]), dim=-1).flatten(-2)
    else:
        half = freqs.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.to(dtype), signed_sin.to(dtype)


def _swap_pairs(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Exchanges the channels of each rotated pair: adjacent ones (`interleaved`), or the two
    halves (Megatron's default layout; a roll by half the width)."""
    if interleaved:
        return t.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return t.roll(t.shape[-1] // 2, dims=-1)


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    *,
    rotary_interleaved: bool = False,
    mscale: float = 1.0,
) -> torch.Tensor:
    """Rotates the first `freqs.shape[-1]` channels of `t` by the angles in `freqs`.

    Args:
        t: Queries or keys, [s, b, n, d].
        freqs: Angles from `RotaryEmbedding`, [s, 1, 1, rot_dim] with rot_dim <= d, laid out
            as `rotary_interleaved` says.
        rotary_interleaved: Pairs are adjacent channels (x0, x1), (x2, x3), ... instead of
            channel i and i + rot_dim / 2.
        mscale: Multiplies the rotated channels (YaRN's concentration factor,
            `YarnRotaryEmbedding.concentration_factor`; upstream's `mscale` argument).

    Returns:
        Tensor like `t`, in `t`'s dtype: `t * cos + rotate_half(t) * sin` on the rotated
        channels (cos and sin times `mscale`), with `rotate_half(x) = cat(-x2, x1)` over the
        halves x1, x2 of `x`, or with `rotary_interleaved` `(-x1, x0, -x3, x2, ...)`.
    """
    rot_dim = freqs.shape[-1]
    partial = rot_dim < t.shape[-1]
    t_rot = t[..., :rot_dim] if partial else t
    cos, sin = _rotation_tables(freqs, t.dtype, rotary_interleaved, mscale)
    t_rot = t_rot * cos + _swap_pairs(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t[..., rot_dim:]), dim=-1) if partial else t_rot


def rotate_query_and_key(
    query: torch.Tensor,
    key: torch.Tensor,
    freqs: torch.Tensor,
    *,
    rotary_interleaved: bool = False,
    fused: bool = False,
    mscale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_pos_emb` of the queries and of the keys.

    Args:
        query: [s, b, nq, d].
        key: [s, b, nk, d].
        freqs: Angles from `RotaryEmbedding`, [s, 1, 1, rot_dim].
        rotary_interleaved: As in `apply_rotary_pos_emb`.
        fused: Rotate both in one Triton kernel (in fp32, rounded once) where
            `fused_rope_supported` says it can; the PyTorch ops otherwise.
        mscale: As in `apply_rotary_pos_emb`.

    Returns:
        The rotated queries and keys.
    """
    if fused and fused_rope_supported(query, key, freqs):
        cos, sin = _rotation_tables(freqs, torch.float32, rotary_interleaved, mscale)
        return fused_rotary_pos_emb(query, key, cos, sin, rotary_interleaved)
    return tuple(
        apply_rotary_pos_emb(t, freqs, rotary_interleaved=rotary_interleaved, mscale=mscale)
        for t in (query, key)
    )
