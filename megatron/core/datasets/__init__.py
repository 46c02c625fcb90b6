"""Datasets for GPT pretraining and the samplers that split them over data-parallel ranks."""

from megatron.core.datasets.data_samplers import (
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from megatron.core.datasets.mock_dataset import MockGPTDataset

__all__ = ["MegatronPretrainingSampler", "MockGPTDataset", "build_pretraining_data_loader"]
