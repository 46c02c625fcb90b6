"""Token / position embeddings and rotary position embeddings."""

from megatron.core.models.common.embeddings.language_model_embedding import (
    Embedding,
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    RotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_query_and_key,
)
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

__all__ = [
    "Embedding",
    "LanguageModelEmbedding",
    "RotaryEmbedding",
    "YarnRotaryEmbedding",
    "apply_rotary_pos_emb",
    "rotate_query_and_key",
]
