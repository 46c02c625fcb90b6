"""Hugging Face Llama-family checkpoints (and Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3,
gpt-oss) to this project's checkpoints and back (`tools/convert_hf.py`; `docs/hugging_face.md`
describes the use)."""

from megatron.training.hf_conversion.config import (
    SUPPORTED_ARCHITECTURES,
    HFConversionError,
    model_args_from_hf_config,
    model_flags,
)
from megatron.training.hf_conversion.convert import HF_CONFIG_KEY, export_hf, import_hf

__all__ = [
    "HF_CONFIG_KEY",
    "SUPPORTED_ARCHITECTURES",
    "HFConversionError",
    "export_hf",
    "import_hf",
    "model_args_from_hf_config",
    "model_flags",
]
