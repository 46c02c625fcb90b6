"""Context parallelism: each sequence split over the context-parallel (cp) ranks, and attention
across them.

- `sequence_split`: the load-balanced split (2N chunks, rank i holding chunks i and 2N-1-i) and
  `get_batch_on_this_cp_rank`, Megatron-LM's data-path function.
- `partial_attention`: attention of one block with its log-sum-exp, on PyTorch's SDPA kernels,
  and the exact merge of partial results.
- `ring_attention`: `cp_comm_type="p2p"`, keys and values passed around the ring.
- `all_to_all_attention`: `cp_comm_type="a2a"` (Ulysses), sequence split traded for head split.
- `all_gather_attention`: `cp_comm_type="allgather"`, keys and values gathered.

`DotProductAttention` runs the one its layer's config selects (`CPCommType`).
"""

from megatron.core.context_parallel.all_gather_attention import all_gather_attention
from megatron.core.context_parallel.all_to_all_attention import all_to_all_attention
from megatron.core.context_parallel.comm_type import CPCommType
from megatron.core.context_parallel.partial_attention import (
    BlockAttention,
    BlockKernel,
    select_block_kernel,
)
from megatron.core.context_parallel.ring_attention import Ring, ring_attention
from megatron.core.context_parallel.sequence_split import (
    gather_sequence,
    get_batch_on_this_cp_rank,
    local_position_ids,
    resolve_cp_group,
    split_sequence,
)

__all__ = [
    "BlockAttention",
    "BlockKernel",
    "CPCommType",
    "Ring",
    "all_gather_attention",
    "all_to_all_attention",
    "gather_sequence",
    "get_batch_on_this_cp_rank",
    "local_position_ids",
    "resolve_cp_group",
    "ring_attention",
    "select_block_kernel",
    "split_sequence",
]
