"""Base class of every model module: a `torch.nn.Module` that carries its config."""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """A `torch.nn.Module` holding the `TransformerConfig` it was built from.

    Keeping the config on every module lets wrappers (FSDP, DDP, checkpointing) read shape and
    precision settings from any submodule without threading them through call sites.

    Args:
        config: The transformer configuration.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
