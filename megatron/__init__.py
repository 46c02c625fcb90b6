"""Megatron-style GPT training with Megatron-FSDP."""

__version__ = "0.1.0"
