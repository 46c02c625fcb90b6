"""Datasets for GPT pretraining and the samplers that split them over data-parallel ranks."""

from megatron.core.datasets.blended_dataset import BlendedDataset, build_blending_indices
from megatron.core.datasets.data_samplers import (
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from megatron.core.datasets.dataset_builder import build_gpt_datasets, parse_data_path
from megatron.core.datasets.gpt_dataset import (
    PAD_TOKEN_ID,
    GPTDataset,
    GPTDatasetConfig,
    get_split_indices,
    pad_token_of,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)
from megatron.core.datasets.mock_dataset import MockGPTDataset

__all__ = [
    "PAD_TOKEN_ID",
    "BlendedDataset",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "MockGPTDataset",
    "build_blending_indices",
    "build_gpt_datasets",
    "build_pretraining_data_loader",
    "get_bin_path",
    "get_idx_path",
    "get_split_indices",
    "optimal_dtype",
    "pad_token_of",
    "parse_and_normalize_split",
    "parse_data_path",
]
