"""Megatron Core: parallel state, transformer models and data-parallel engines."""
