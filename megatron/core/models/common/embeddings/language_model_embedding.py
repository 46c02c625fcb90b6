"""Input embedding of a language model: token embedding, optional learned positions, dropout.

The output is in Megatron's [s, b, h] layout, the layout of the whole transformer stack.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class Embedding(torch.nn.Module):
    """A lookup table initialised with a Megatron init method (in place of torch's N(0, 1)).

    It stands in for Megatron-LM's `VocabParallelEmbedding` (no tensor parallelism here) and
    for the `torch.nn.Embedding` of learned positions, whose own `reset_parameters()` would
    re-draw the weights from N(0, 1).

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
        position_embedding_type: "learned_absolute" adds a learned position table; "rope" and
            "none" add nothing here (rotary embeddings are applied inside attention).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
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
        kwargs = dict(init_method=config.init_method, dtype=config.params_dtype)
        self.word_embeddings = Embedding(vocab_size, config.hidden_size, **kwargs)
        if self.add_position_embedding:
            self.position_embeddings = Embedding(max_sequence_length, config.hidden_size, **kwargs)
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
            Embeddings of shape [s, b, h].
        """
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
        return self.embedding_dropout(embeddings)
