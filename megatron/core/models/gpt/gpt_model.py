"""GPT: embedding, a causal transformer decoder, and the output projection to the vocabulary.

Inputs and outputs are batch-first ([b, s]); inside, hidden states use Megatron's [s, b, h]
layout. With labels the model returns the per-token cross-entropy in float32, which the training
loop masks and reduces; without labels it returns the logits.

Under tensor parallelism over T ranks the vocabulary is split: the embedding table and the output
layer hold V/T rows each, the logits are the rank's [.., V/T] part and the loss is the
vocabulary-parallel cross-entropy (identical on every tp rank). Under sequence parallelism the
decoder's hidden states are [s/T, b, h] and are all-gathered before the output layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_cross_entropy import fused_cross_entropy
from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.overlapped_linear import column_parallel_linear
from megatron.core.tensor_parallel.utils import group_size
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig


class GPTModel(MegatronModule):
    """A decoder-only transformer language model, with Megatron-core's arguments in its order.

    Arguments of features not built here (`fp16_lm_cross_entropy`, unscattered sequence-parallel
    embeddings, multi-token prediction, virtual pipeline stages) are accepted at their defaults
    and refused otherwise, naming them.

    Args:
        config: The transformer configuration.
        transformer_layer_spec: Spec of one layer (e.g. `get_gpt_layer_local_spec()`), or a
            `TransformerBlockSubmodules` with one spec per layer.
        vocab_size: Number of token ids (rows of the embedding, columns of the logits); a
            multiple of the tensor-parallel size.
        max_sequence_length: Number of learned positions (for "learned_absolute").
        pre_process: Build the embedding (first pipeline stage). Without it, the decoder input
            comes from `set_input_tensor`.
        post_process: Build the final norm and output layer (last pipeline stage). Without it,
            `forward` returns the decoder's [s, b, h] hidden states.
        fp16_lm_cross_entropy, scatter_embedding_sequence_parallel, mtp_block_spec, vp_stage:
            not built: their defaults (False, True, None, None) only.
        share_embeddings_and_output_weights: Compute the logits with the word-embedding matrix
            (one Parameter, used twice); there is then no `output_layer`.
        position_embedding_type: "learned_absolute", "rope" or "none".
        rotary_percent: Fraction of each head's channels rotated by RoPE.
        rotary_base: RoPE frequency base.
        rope_scaling: Llama 3.x's rescaling of the RoPE frequencies.
        rope_scaling_factor: Its factor (Megatron-LM's default 8).
        seq_len_interpolation_factor: Divide the RoPE positions by it (linear interpolation);
            None leaves them. `config.rotary_interleaved` picks the RoPE channel pairing.
        parallel_output: Without labels, return this tensor-parallel rank's part of the logits
            ([b, s, V/T]) rather than all-gathering the whole vocabulary; the same at T = 1.
        pg_collection: Process groups: `tp` splits the layers and the vocabulary, `ep` the
            experts of the MoE layers; None means parallel_state's, or size 1 without it.

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
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        mtp_block_spec: ModuleSpec | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
    ):
        super().__init__(config)
        _refuse_unbuilt(
            fp16_lm_cross_entropy=(fp16_lm_cross_entropy, False, "the loss is computed in fp32"),
            scatter_embedding_sequence_parallel=(
                scatter_embedding_sequence_parallel,
                True,
                "under sequence parallelism the embedding output is always scattered",
            ),
            mtp_block_spec=(mtp_block_spec, None, "multi-token prediction is not built"),
            vp_stage=(vp_stage, None, "pipeline parallelism is not built"),
        )
        self.tp_group = resolve_tp_group(pg_collection)
        tp_size = group_size(self.tp_group)
        if vocab_size % tp_size:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be divisible by the tensor-parallel size "
                f"({tp_size}): each rank holds vocab_size / {tp_size} rows of the embedding and "
                "of the output layer; pad the vocabulary to a multiple of it (the training "
                "script pads to a multiple of make_vocab_size_divisible_by x "
                "tensor_model_parallel_size)."
            )
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
        self.parallel_output = parallel_output
        self.input_tensor: torch.Tensor | None = None

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config,
                vocab_size,
                max_sequence_length,
                position_embedding_type,
                tp_group=self.tp_group,
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
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=False,
                skip_bias_add=False,
                tp_comm_buffer_name="lm_head",
                tp_group=self.tp_group,
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
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params: Any = None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the model (Megatron-core's arguments, in its order).

        Args:
            input_ids: [b, s] token ids (unused without `pre_process`, or with `decoder_input`).
            position_ids: [b, s] positions for learned position embeddings; None means 0..s-1.
                Rotary embeddings always use 0..s-1 (as in Megatron-LM).
            attention_mask: None for causal attention, or a boolean mask broadcastable to
                [b, heads, s, s] with True = masked out; it replaces the causal mask.
            decoder_input: [s, b, h] decoder input to use instead of the embedding's output.
            labels: [b, s] target ids, or None.
            inference_context, packed_seq_params, extra_block_kwargs, inference_params,
                padding_mask: not built: None only.
            runtime_gather_output: Without labels, all-gather the vocabulary (True) or not
                (False) this call; None follows `parallel_output`.
            loss_mask: Accepted and unused, as upstream's GPTModel uses it for multi-token
                prediction only (the training loop applies it to the returned loss).

        Returns:
            With `labels`: per-token cross-entropy loss, float32, [b, s] (positions whose label is
            -100 get 0), the same on every tensor-parallel rank. Without: logits in the
            parameter dtype, [b, s, vocab_size / T] with `parallel_output`, else
            [b, s, vocab_size]. Without `post_process`: decoder hidden states [s, b, h]
            ([s/T, b, h] under sequence parallelism).
        """
        unbuilt = (
            inference_context,
            packed_seq_params,
            extra_block_kwargs,
            inference_params,
            padding_mask,
        )
        if any(value is not None for value in unbuilt):  # per micro-batch: checked cheaply first
            names = _UNBUILT_FORWARD_ARGUMENTS
            _refuse_unbuilt(**{n: (v, None, "not built") for n, v in zip(names, unbuilt)})
        if decoder_input is None:
            decoder_input = self._decoder_input(input_ids, position_ids)

        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            # Attention sees the whole sequence, also when the layers hold a part of it.
            seq_len = decoder_input.shape[0]
            if self.config.sequence_parallel:
                seq_len *= group_size(self.tp_group)
            rotary_pos_emb = self.rotary_pos_emb(seq_len, device=decoder_input.device)
        hidden_states = self.decoder(
            decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        if not self.post_process:
            return hidden_states

        logits = self._logits(hidden_states)
        if labels is None:
            gather = (
                not self.parallel_output if runtime_gather_output is None else runtime_gather_output
            )
            if gather:
                logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
            return logits.transpose(0, 1).contiguous()
        if group_size(self.tp_group) > 1:
            # The vocabulary-parallel loss needs only per-token sums over tp, never the whole
            # vocabulary's logits (the memory the fused loss saves at T = 1).
            loss = vocab_parallel_cross_entropy(logits, labels.t(), tp_group=self.tp_group)
            return loss.t().contiguous()

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

    def _decoder_input(
        self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if self.pre_process:
            return self.embedding(input_ids, position_ids)
        if self.input_tensor is None:
            raise ValueError(
                "GPTModel was built with pre_process=False; call set_input_tensor() with the "
                "[s, b, h] decoder input before forward."
            )
        return self.input_tensor

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's [s, b, V/T] logits of the final hidden states ([s/T, b, h] under sequence
        parallelism: the output layer gathers the sequence)."""
        if self.output_layer is not None:
            logits, _ = self.output_layer(hidden_states)
            return logits
        # Tied: the embedding's vocabulary rows, projected as the column-parallel output layer.
        return column_parallel_linear(
            hidden_states,
            self.shared_embedding_or_output_weight(),
            None,
            self.tp_group,
            self.config.sequence_parallel,
        )


_UNBUILT_FORWARD_ARGUMENTS = (
    "inference_context",
    "packed_seq_params",
    "extra_block_kwargs",
    "inference_params",
    "padding_mask",
)
"""`GPTModel.forward`'s arguments of features not built here, in the order it checks them."""


def _refuse_unbuilt(**arguments: tuple[Any, Any, str]) -> None:
    """Raises `ValueError` naming each argument given other than its default.

    Args:
        arguments: name -> (value, the default, why only the default works).
    """
    given = [
        f"{name}={value!r} ({why})"
        for name, (value, default, why) in arguments.items()
        if (value is not None if default is None else value != default)
    ]
    if given:
        raise ValueError(
            f"GPTModel: {'; '.join(given)}. Leave these at their defaults (Megatron-core's "
            "arguments of features this project does not build)."
        )
