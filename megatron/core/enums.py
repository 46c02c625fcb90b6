"""Enums shared by Megatron Core and the training loop (Megatron-LM's names)."""

from __future__ import annotations

import enum


class ModelType(enum.Enum):
    """The kind of model `pretrain` trains. Only decoder-only (GPT-style) models exist here, so
    `encoder_or_decoder` is the one member; Megatron-LM also has `encoder_and_decoder` (T5)."""

    encoder_or_decoder = 1
