"""GPT: embedding, a causal transformer decoder, and the output projection to the vocabulary.

Inputs and outputs are batch-first ([b, s]); inside, hidden states use Megatron's [s, b, h]
layout. With labels the model returns the per-token cross-entropy in float32, which the training
loop masks and reduces; without labels it returns the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_cross_entropy import fused_cross_entropy
from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.linear import Linear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig


class GPTModel(MegatronModule):
    """A decoder-only transformer language model.

    The arguments after `post_process` are keyword-only: Megatron-LM's seventh positional
    argument is `fp16_lm_cross_entropy`, so a positional call ported from there must fail rather
    than set `share_embeddings_and_output_weights`.

    Args:
        config: The transformer configuration.
        transformer_layer_spec: Spec of one layer (e.g. `get_gpt_layer_local_spec()`), or a
            `TransformerBlockSubmodules` with one spec per layer.
        vocab_size: Number of token ids (rows of the embedding, columns of the logits).
        max_sequence_length: Number of learned positions (for "learned_absolute").
        pre_process: Build the embedding (first pipeline stage). Without it, the decoder input
            comes from `set_input_tensor`.
        post_process: Build the final norm and output layer (last pipeline stage). Without it,
            `forward` returns the decoder's [s, b, h] hidden states.
        share_embeddings_and_output_weights: Compute the logits with the word-embedding matrix
            (one Parameter, used twice); there is then no `output_layer`.
        position_embedding_type: "learned_absolute", "rope" or "none".
        rotary_percent: Fraction of each head's channels rotated by RoPE.
        rotary_base: RoPE frequency base.
        rope_scaling: Llama 3.x's rescaling of the RoPE frequencies.
        rope_scaling_factor: Its factor (Megatron-LM's default 8).
        seq_len_interpolation_factor: Divide the RoPE positions by it (linear interpolation);
            None leaves them. `config.rotary_interleaved` picks the RoPE channel pairing.
        pg_collection: Process groups of the MoE layers (their expert-parallel group `ep`);
            None means parallel_state's, or expert-parallel size 1 without it.

    Raises:
        ValueError: Inconsistent arguments (see messages).
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec | TransformerBlockSubmodules,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        seq_len_interpolation_factor: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, got "
                f"{position_embedding_type!r}."
            )
        if vocab_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"vocab_size ({vocab_size}) and max_sequence_length ({max_sequence_length}) "
                "must be >= 1."
            )
        if share_embeddings_and_output_weights and not (pre_process and post_process):
            raise ValueError(
                "share_embeddings_and_output_weights=True needs the embedding and the output "
                "layer in the same model (pre_process and post_process both True); pipeline "
                "parallelism is not supported."
            )
        learned = position_embedding_type == "learned_absolute"
        if learned and config.seq_length is not None and config.seq_length > max_sequence_length:
            raise ValueError(
                f"config.seq_length ({config.seq_length}) exceeds max_sequence_length "
                f"({max_sequence_length}) of the learned position embeddings; raise "
                "max_sequence_length or use position_embedding_type='rope'."
            )
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.input_tensor: torch.Tensor | None = None

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type
            )
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
            )
        self.decoder = TransformerBlock(
            config,
            transformer_layer_spec,
            post_layer_norm=post_process,
            pg_collection=pg_collection,
        )
        if post_process and not share_embeddings_and_output_weights:
            self.output_layer = Linear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
            )
        else:
            self.output_layer = None

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Sets the decoder input of a model built with `pre_process=False` ([s, b, h])."""
        if isinstance(input_tensor, (list, tuple)):
            (input_tensor,) = input_tensor
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The weight this stage shares when input and output embeddings are tied (Megatron-LM).

        Returns:
            The word-embedding weight with `pre_process`, else the output-layer weight with
            `post_process`, else None. With tied embeddings it is the logits' projection too.
        """
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the model.

        Args:
            input_ids: [b, s] token ids (unused without `pre_process`).
            position_ids: [b, s] positions for learned position embeddings; None means 0..s-1.
                Rotary embeddings always use 0..s-1 (as in Megatron-LM).
            attention_mask: None for causal attention, or a boolean mask broadcastable to
                [b, heads, s, s] with True = masked out; it replaces the causal mask.
            labels: [b, s] target ids, or None.

        Returns:
            With `labels`: per-token cross-entropy loss, float32, [b, s] (positions whose label is
            -100 get 0). Without: logits [b, s, vocab_size] in the parameter dtype. Without
            `post_process`: decoder hidden states [s, b, h].
        """
        if self.pre_process:
            decoder_input = self.embedding(input_ids, position_ids)
        elif self.input_tensor is not None:
            decoder_input = self.input_tensor
        else:
            raise ValueError(
                "GPTModel was built with pre_process=False; call set_input_tensor() with the "
                "[s, b, h] decoder input before forward."
            )

        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_pos_emb = self.rotary_pos_emb(
                decoder_input.shape[0], device=decoder_input.device
            )
        hidden_states = self.decoder(
            decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        if not self.post_process:
            return hidden_states

        if self.share_embeddings_and_output_weights:
            logits = F.linear(hidden_states, self.shared_embedding_or_output_weight())
        else:
            logits, _ = self.output_layer(hidden_states)
        if labels is None:
            return logits.transpose(0, 1).contiguous()

        seq_len, batch = logits.shape[:2]
        logits = logits.view(seq_len * batch, -1)
        labels = labels.t().reshape(seq_len * batch)
        # Cross-entropy in float32 whatever the parameter dtype: bf16 log-softmax over a large
        # vocabulary loses most of the loss's precision.
        if self.config.cross_entropy_loss_fusion:
            loss = fused_cross_entropy(logits, labels)
        else:
            loss = F.cross_entropy(logits.float(), labels, reduction="none")
        return loss.view(seq_len, batch).t().contiguous()
