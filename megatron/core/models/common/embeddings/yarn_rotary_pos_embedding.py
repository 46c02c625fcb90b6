"""YaRN rotary embeddings (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models"), as DeepSeek-V2/V3 and Megatron-core's multi-latent attention use them.

YaRN stretches a RoPE trained on `original_max_position_embeddings` positions by a factor s: the
channel pairs that turn fewer than `beta_slow` times over the original context are interpolated
(their frequency divided by s), those that turn more than `beta_fast` times keep theirs, and the
pairs in between blend the two linearly in the pair index. The rotated channels are also scaled
by a concentration factor, which `apply_rotary_pos_emb(..., mscale=)` applies; multi-latent
attention multiplies its softmax scale by a second factor (`MLASelfAttention`).

`GPTModel(position_embedding_type="yarn")` builds one from the config's `yarn_*` fields for
standard attention (as upstream; gpt-oss's positions), whose `SelfAttention` applies the same
concentration factor, computed from those fields.
"""

from __future__ import annotations

import math

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_config import yarn_concentration_factor


class YarnRotaryEmbedding(RotaryEmbedding):
    """Rotation angles with YaRN's frequencies (upstream's `YarnRotaryEmbedding`).

    Like `RotaryEmbedding` it holds no parameters or buffers: the angles are computed in
    `forward`.

    Args:
        kv_channels: Rotated channels of a head (every one is rotated).
        rotary_interleaved: Angles laid out for pairs of adjacent channels (as multi-latent
            attention pairs them) instead of the two halves.
        rotary_base: Base of the RoPE frequencies.
        scaling_factor: The context extension factor s.
        original_max_position_embeddings: The context length the RoPE was trained with.
        beta_fast: Pairs turning more often than this over the original context keep their
            frequency.
        beta_slow: Pairs turning less often than this are interpolated fully.
        mscale: Numerator coefficient of the concentration factor.
        mscale_all_dim: Denominator coefficient of the concentration factor.
        correction_range_round_to_int: Round the blended band's ends outwards to whole pair
            indices (upstream's default).

    Raises:
        ValueError: a factor, length or beta is not positive.
    """

    def __init__(
        self,
        kv_channels: int,
        *,
        rotary_interleaved: bool = False,
        rotary_base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        correction_range_round_to_int: bool = True,
    ):
        super().__init__(
            kv_channels, rotary_interleaved=rotary_interleaved, rotary_base=rotary_base
        )
        for name, value in (
            ("scaling_factor", scaling_factor),
            ("original_max_position_embeddings", original_max_position_embeddings),
            ("beta_fast", beta_fast),
            ("beta_slow", beta_slow),
        ):
            if not value > 0:
                raise ValueError(f"YarnRotaryEmbedding: {name} must be > 0, got {value}.")
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.correction_range_round_to_int = correction_range_round_to_int
        self.concentration_factor = yarn_concentration_factor(
            scaling_factor, mscale, mscale_all_dim
        )
        """Multiplies the rotated channels (upstream's `mscale`, the second value its
        `YarnRotaryEmbedding.forward` returns): pass it to `apply_rotary_pos_emb`."""

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The float32 frequencies of the channel pairs: RoPE's where they turn fast, divided by
        `scaling_factor` where they turn slowly, blended linearly in between."""
        extrapolated = super().inv_freq(device)
        interpolated = extrapolated / self.scaling_factor
        low, high = self.correction_range()
        if low == high:
            high += 0.001  # a band of one pair: a step instead of a division by zero
        pairs = torch.arange(self.dim // 2, dtype=torch.float32, device=device)
        # 0 below the band (fast pairs, kept), 1 above it (slow pairs, interpolated).
        ramp = ((pairs - low) / (high - low)).clamp(0, 1)
        return interpolated * ramp + extrapolated * (1 - ramp)

    def correction_range(self) -> tuple[float, float]:
        """The pair indices between which the frequencies blend: where the pairs turn
        `beta_fast` and `beta_slow` times over the original context, clamped to the pairs."""
        low = self._pair_turning(self.beta_fast)
        high = self._pair_turning(self.beta_slow)
        if self.correction_range_round_to_int:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, self.dim - 1)

    def _pair_turning(self, rotations: float) -> float:
        """The (fractional) pair index whose frequency turns `rotations` times over the
        original context: rotations * 2 pi = L * base ** (-2i / dim), solved for i."""
        length = self.original_max_position_embeddings
        return (
            self.dim
            * math.log(length / (rotations * 2 * math.pi))
            / (2 * math.log(self.rotary_base))
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, scaling_factor={self.scaling_factor}, "
            f"original_max_position_embeddings={self.original_max_position_embeddings}, "
            f"beta_fast={self.beta_fast}, beta_slow={self.beta_slow}, "
            f"concentration_factor={self.concentration_factor:g}"
        )
