"""Packaging for the `megatron` package (Megatron-style GPT training with Megatron-FSDP)."""

from setuptools import find_packages, setup

setup(
    name="megatron-fsdp-gpt",
    version="0.1.0",
    description="Megatron-style GPT training with Megatron-FSDP (fully sharded data parallelism)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron", "megatron.*"]),
    # The C++ extensions (the FP8 linear layers', the fusing linear layer's, the rotary
    # embedding's) are built from their sources at first use on a GPU.
    package_data={
        "megatron.core": ["csrc/*.h"],
        "megatron.core.fp8": ["csrc/*.cu", "csrc/*.cpp", "csrc/*.h"],
        "megatron.core.tensor_parallel": ["csrc/*.cpp"],
        "megatron.core.fusions": ["csrc/*.cu", "csrc/*.cpp", "csrc/*.h"],
    },
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "einops", "numpy", "regex"],
    extras_require={
        # The test suite exercises every tokenizer, so it needs the optional tokenizer packages.
        "test": [
            "pytest>=7",
            "pytest-timeout",
            "pytest-xdist",  # tools/run_tests.sh runs the tests in two processes
            "sentencepiece",
            "tokenizers",
            # transformers 5's config keys; DeepSeek-V3's multi-token prediction layers as it
            # reads them (`MtpModel`), against which the conversion is tested; GptOssForCausalLM.
            "transformers>=5.24",
            "tiktoken",
            "tensorboard",
        ],
        # SentencePieceTokenizer and HuggingFaceTokenizer.
        "data": ["sentencepiece", "tiktoken", "transformers"],
        # Optional accelerators, used when importable. NVIDIA apex has no usable PyPI package:
        # build it from its source repository if you want its fused norms.
        "te": ["transformer-engine[pytorch]"],
        "tensorboard": ["tensorboard"],
    },
)
