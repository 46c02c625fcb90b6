"""Tensor (intra-layer) and sequence parallelism, with Megatron-core's public names."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.tensor_parallel.layout import (
    TensorParallelLayout,
    named_tensor_parallel_layouts,
    shard_tensor,
    tensor_parallel_placement,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    grad_sum_over_tp,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    model_parallel_cuda_manual_seed,
    rng_tracker_device_type,
    rng_tracker_replay_contexts,
)
from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    divide,
    split_tensor_along_last_dim,
)

__all__ = [
    # cross_entropy.py
    "vocab_parallel_cross_entropy",
    # layers.py
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    # layout.py
    "TensorParallelLayout",
    "named_tensor_parallel_layouts",
    "shard_tensor",
    "tensor_parallel_placement",
    # mappings.py
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "grad_sum_over_tp",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    # random.py
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "model_parallel_cuda_manual_seed",
    "rng_tracker_device_type",
    "rng_tracker_replay_contexts",
    # utils.py
    "VocabUtility",
    "divide",
    "split_tensor_along_last_dim",
]
