"""Megatron-LM's command-line flags, one module per argument group (`megatron.training.arguments`
adds them all to one parser)."""
