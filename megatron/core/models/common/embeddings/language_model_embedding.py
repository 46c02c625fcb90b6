"""Input embedding of a language model: token embedding, optional learned positions, dropout.

The output is in Megatron's [s, b, h] layout, the layout of the whole transformer stack. Under
tensor parallelism the token table is split over the vocabulary (`VocabParallelEmbedding`) and
the learned positions are replicated; under sequence parallelism each rank keeps its [s/T, b, h]
part of the sequence (the partial lookups are reduce-scattered, or, with learned positions, the
sum is scattered) and its dropout runs in the RNG tracker's tensor-parallel state, as in
Megatron-core.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")


class Embedding(torch.nn.Module):
    """A lookup table initialised with a Megatron init method (in place of torch's N(0, 1)).

    It stands in for the `torch.nn.Embedding` of learned positions, whose own
    `reset_parameters()` would re-draw the weights from N(0, 1).

    Args:
        num_embeddings: Number of rows.
        embedding_dim: Width of a row.
        init_method: In-place initialiser of the table.
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
    ):
        super().__init__()
        self.init_method = init_method
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draws the table from `init_method`."""
        self.init_method(self.weight)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return F.embedding(indices, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class LanguageModelEmbedding(MegatronModule):
    """Token embedding (+ learned absolute position embedding) followed by dropout.

    Args:
        config: The transformer configuration (`hidden_size`, `init_method`, `hidden_dropout`,
            `params_dtype`).
        vocab_size: Number of token ids.
        max_sequence_length: Number of learned positions.
        position_embedding_type: "learned_absolute" adds a learned position table; "rope",
            "yarn" and "none" add nothing here (rotary embeddings are applied inside attention).
        tp_group: The tensor-parallel group the vocabulary is split over; None resolves to
            parallel_state's when initialised, else no split.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        *,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(config)
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, got "
                f"{position_embedding_type!r}."
            )
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.position_embedding_type = position_embedding_type
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        # Without positions to add, the partial lookups go straight to the sequence-parallel
        # region (one reduce-scatter instead of an all-reduce and a split).
        self.reduce_scatter_embeddings = (
            config.sequence_parallel and not self.add_position_embedding
        )
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            init_method=config.init_method,
            config=config,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            tp_group=tp_group,
        )
        if self.add_position_embedding:
            self.position_embeddings = Embedding(
                max_sequence_length,
                config.hidden_size,
                init_method=config.init_method,
                dtype=config.params_dtype,
            )
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Embeds a batch of token ids.

        Args:
            input_ids: [b, s] token ids.
            position_ids: [b, s] (or [1, s]) positions for the learned position table; None
                means 0 .. s-1 for every sequence. Ignored without learned positions.

        Returns:
            Embeddings of shape [s, b, h] ([s/T, b, h] under sequence parallelism).
        """
        if self.reduce_scatter_embeddings:
            # The layer transposes to [s, b, h] itself before the reduce-scatter.
            embeddings = self.word_embeddings(input_ids)
            return self._dropout(embeddings)
        # Looking up the transposed ids yields [s, b, h] directly, with no transpose copy.
        embeddings = self.word_embeddings(input_ids.t())
        if self.add_position_embedding:
            if position_ids is None:
                seq_len = input_ids.shape[1]
                if seq_len > self.max_sequence_length:
                    raise ValueError(
                        f"sequence length {seq_len} exceeds max_sequence_length "
                        f"({self.max_sequence_length}) of the learned position embeddings; "
                        "build the model with a larger max_sequence_length."
                    )
                position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
            embeddings = embeddings + self.position_embeddings(position_ids.t())
        if self.config.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(
                embeddings, self.word_embeddings.tp_group
            )
        return self._dropout(embeddings)

    def _dropout(self, embeddings: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel and self.training:
            # Each rank holds a different part of the sequence: its mask must differ too.
            rng_context = get_cuda_rng_tracker().fork()
        else:
            rng_context = contextlib.nullcontext()
        with rng_context:
            return self.embedding_dropout(embeddings)
