"""GPT: embedding, a causal transformer decoder, and the output projection to the vocabulary.

Inputs and outputs are batch-first ([b, s]); inside, hidden states use Megatron's [s, b, h]
layout. With labels the model returns the per-token cross-entropy in float32, which the training
loop masks and reduces; without labels it returns the logits.

Under tensor parallelism over T ranks the vocabulary is split: the embedding table and the output
layer hold V/T rows each, the logits are the rank's [.., V/T] part and the loss is the
vocabulary-parallel cross-entropy (identical on every tp rank). Under sequence parallelism the
decoder's hidden states are [s/T, b, h] and are all-gathered before the output layer.

Under context parallelism over C ranks each rank holds two chunks of every sequence
(`megatron.core.context_parallel.sequence_split`: the data path splits the batch with
`get_batch_on_this_cp_rank`): the model's inputs and outputs are [b, s/C], the rotary angles and
the default learned positions are those of this rank's chunks, and attention runs across the
context-parallel group.

With `config.mtp_num_layers` and an `mtp_block_spec`, multi-token prediction depths
(`megatron.core.transformer.multi_token_prediction`) follow the decoder; with labels their
losses join the training gradient, while the returned loss stays the next-token one. Under
pipeline parallelism they live on the last stage, with the output layer (as Megatron-core's
default placement), which then holds the embedding too (the depths embed the shifted tokens):
a copy of the first stage's, kept equal by `megatron.core.pipeline_parallel.tied_embeddings`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.context_parallel import local_position_ids, resolve_cp_group, split_sequence
from megatron.core.fusions.fused_cross_entropy import fused_cross_entropy
from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.overlapped_linear import column_parallel_linear
from megatron.core.tensor_parallel.utils import group_rank, group_size
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    process_mtp_loss,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig, yarn_fields_set


class GPTModel(MegatronModule):
    """A decoder-only transformer language model, with Megatron-core's arguments in its order.

    Arguments of features not built here (`fp16_lm_cross_entropy`, unscattered sequence-parallel
    embeddings) are accepted at their defaults and refused otherwise, naming them.

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
        fp16_lm_cross_entropy, scatter_embedding_sequence_parallel: not built: their defaults
            (False, True) only.
        vp_stage: This model chunk's virtual pipeline stage (None: the only one); with
            `pre_process` / `post_process` it decides which layers the decoder builds.
        share_embeddings_and_output_weights: Compute the logits with the word-embedding matrix
            (one Parameter, used twice); there is then no `output_layer`. On a last pipeline
            stage without the embedding, `output_layer` holds a copy of it, which
            `megatron.core.pipeline_parallel.tied_embeddings` keeps equal to the first
            stage's.
        position_embedding_type: "learned_absolute", "rope", "yarn" or "none". "yarn" is RoPE
            with YaRN's frequencies and concentration factor, from the config's `yarn_*` fields
            (as upstream: every channel of the head rotated, in halves; `rotary_base` is read,
            the other rotary arguments must stay at their defaults). Multi-latent attention
            (`config.multi_latent_attention`) rotates by its own embedding whatever this says,
            so "rope" then builds none here (as upstream; "yarn" is refused), and the rotary
            arguments below are not read (the config's `rope_type`, `rotary_base`, ... are).
        rotary_percent: Fraction of each head's channels rotated by RoPE.
        rotary_base: RoPE frequency base.
        rope_scaling: Llama 3.x's rescaling of the RoPE frequencies.
        rope_scaling_factor: Its factor (Megatron-LM's default 8).
        seq_len_interpolation_factor: Divide the RoPE positions by it (linear interpolation);
            None leaves them. `config.rotary_interleaved` picks the RoPE channel pairing.
        mtp_block_spec: The multi-token prediction depths (`get_gpt_mtp_block_spec(config,
            transformer_layer_spec, use_transformer_engine)`), built as `mtp`; given exactly
            when `config.mtp_num_layers` is set and this is the last pipeline stage
            (`post_process`). That stage then builds the embedding as well.
        parallel_output: Without labels, return this tensor-parallel rank's part of the logits
            ([b, s, V/T]) rather than all-gathering the whole vocabulary; the same at T = 1.
        pg_collection: Process groups: `tp` splits the layers and the vocabulary, `ep` the
            experts of the MoE layers, `cp` the sequences; None means parallel_state's, or
            size 1 without it.

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
        mtp_block_spec: MultiTokenPredictionBlockSubmodules | ModuleSpec | None = None,
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
        )
        self.tp_group = resolve_tp_group(pg_collection)
        self.cp_group = resolve_cp_group(None if pg_collection is None else pg_collection.cp)
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
        _check_mtp_arguments(config, mtp_block_spec, post_process)
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
        # Megatron-core's name: this chunk runs the multi-token prediction depths.
        self.mtp_process = mtp_block_spec is not None

        if pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(
                config,
                vocab_size,
                max_sequence_length,
                position_embedding_type,
                tp_group=self.tp_group,
            )
        _check_yarn_arguments(
            config,
            position_embedding_type,
            rotary_percent=(rotary_percent, 1.0),
            rope_scaling=(rope_scaling, False),
            seq_len_interpolation_factor=(seq_len_interpolation_factor, None),
        )
        self.rotary_pos_emb: RotaryEmbedding | None = None
        if position_embedding_type == "rope" and not config.multi_latent_attention:
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
            )
        elif position_embedding_type == "yarn":  # standard attention only (checked above)
            self.rotary_pos_emb = YarnRotaryEmbedding(
                config.kv_channels,
                rotary_base=rotary_base,
                scaling_factor=config.yarn_rotary_scaling_factor,
                original_max_position_embeddings=config.yarn_original_max_position_embeddings,
                beta_fast=config.yarn_beta_fast,
                beta_slow=config.yarn_beta_slow,
                mscale=config.yarn_mscale,
                mscale_all_dim=config.yarn_mscale_all_dim,
                correction_range_round_to_int=config.yarn_correction_range_round_to_int,
            )
        self.decoder = TransformerBlock(
            config,
            transformer_layer_spec,
            post_layer_norm=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        self.mtp = (
            None
            if mtp_block_spec is None
            else MultiTokenPredictionBlock(config, mtp_block_spec, pg_collection=pg_collection)
        )
        # The last pipeline stage of a tied model holds its own copy of the word embeddings as
        # the output layer (as the embedding's when it runs the multi-token prediction depths),
        # kept equal to the first stage's (`pipeline_parallel.tied_embeddings`).
        has_embedding = pre_process or self.mtp_process
        if post_process and not (share_embeddings_and_output_weights and has_embedding):
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
            The word-embedding weight with `pre_process` or the multi-token prediction depths,
            else the output-layer weight with `post_process`, else None. With tied embeddings
            it is the logits' projection too.
        """
        if self.pre_process or self.mtp_process:
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
            input_ids: [b, s] token ids (unused without `pre_process`, or with `decoder_input`);
                under context parallelism this rank's chunks of the sequences.
            position_ids: [b, s] positions for learned position embeddings; None means 0..s-1
                (this rank's chunks' positions under context parallelism). Rotary embeddings
                always use 0..s-1 of the whole sequence (as in Megatron-LM).
            attention_mask: None for causal attention, or a boolean mask broadcastable to
                [b, heads, s, s] with True = masked out; it replaces the causal mask.
            decoder_input: [s, b, h] decoder input to use instead of the embedding's output.
            labels: [b, s] target ids, or None.
            inference_context, packed_seq_params, extra_block_kwargs, inference_params,
                padding_mask: not built: None only.
            runtime_gather_output: Without labels, all-gather the vocabulary (True) or not
                (False) this call; None follows `parallel_output`.
            loss_mask: [b, s] 1 where a token's loss counts, for the multi-token prediction
                losses (shifted along with the labels); None: every token. The returned
                next-token loss is not masked: the training loop applies the mask to it.

        Returns:
            With `labels`: per-token cross-entropy loss, float32, [b, s] (positions whose label is
            -100 get 0), the same on every tensor-parallel rank; with multi-token prediction,
            its backward also backpropagates the depths' losses. Without: logits in the
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
        learned = self.position_embedding_type == "learned_absolute"
        cp_split = group_size(self.cp_group) > 1
        if learned and position_ids is None and input_ids is not None and cp_split:
            # This rank's chunks' positions (the embedding's default is 0..s-1).
            position_ids = local_position_ids(input_ids.shape[1], self.cp_group, input_ids.device)
        if decoder_input is None:
            decoder_input = self._decoder_input(input_ids, position_ids)
        elif self.mtp is not None and labels is not None:
            raise ValueError(
                "GPTModel with multi-token prediction needs input_ids, not decoder_input: its "
                "depths embed the input tokens shifted by their depth."
            )

        rotary_pos_emb = None
        if self.rotary_pos_emb is not None:
            # Attention sees the whole sequence, also when the layers hold a part of it; under
            # context parallelism its positions are those of this rank's chunks.
            cp_size = group_size(self.cp_group)
            seq_len = decoder_input.shape[0] * cp_size
            if self.config.sequence_parallel:
                seq_len *= group_size(self.tp_group)
            rotary_pos_emb = self.rotary_pos_emb(seq_len, device=decoder_input.device)
            rotary_pos_emb = split_sequence(rotary_pos_emb, 0, group_rank(self.cp_group), cp_size)
        hidden_states = self.decoder(
            decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        if not self.post_process:
            return hidden_states
        if self.mtp is not None and labels is not None:
            hidden_states = self._attach_mtp_losses(
                hidden_states,
                input_ids,
                position_ids,
                attention_mask,
                rotary_pos_emb,
                labels,
                loss_mask,
            )

        logits = self._logits(hidden_states)
        if labels is None:
            gather = (
                not self.parallel_output if runtime_gather_output is None else runtime_gather_output
            )
            if gather:
                logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def compute_language_model_loss(
        self, labels: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """The per-token cross-entropy (Megatron-core's method of this name).

        Args:
            labels: [b, s] target ids (-100: no loss).
            logits: [s, b, V/T] this rank's logits (`_logits`).

        Returns:
            [b, s] float32 losses, the same on every tensor-parallel rank.
        """
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

    def _attach_mtp_losses(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb: torch.Tensor | None,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Runs the multi-token prediction depths on the decoder's output and attaches their
        losses to it (`process_mtp_loss`)."""
        if position_ids is None and self.position_embedding_type == "learned_absolute":
            # The depths shift the positions with the tokens (Megatron-core's): spelled out (the
            # forward has already given them under context parallelism).
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        mtp_hidden_states = self.mtp(
            input_ids, position_ids, hidden_states, attention_mask, rotary_pos_emb, self.embedding
        )

        def language_model_loss(depth_hidden_states, depth_labels):
            return self.compute_language_model_loss(depth_labels, self._logits(depth_hidden_states))

        return process_mtp_loss(
            hidden_states,
            mtp_hidden_states,
            labels,
            loss_mask,
            language_model_loss,
            self.config,
            record=self.training and torch.is_grad_enabled(),
            cp_group=self.cp_group,
        )

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


def _check_mtp_arguments(
    config: TransformerConfig,
    mtp_block_spec: MultiTokenPredictionBlockSubmodules | ModuleSpec | None,
    post_process: bool,
) -> None:
    """Multi-token prediction needs its spec and the config to agree; the depths share the
    output layer, so they live on the last pipeline stage (`post_process`) only."""
    given = mtp_block_spec is not None
    wanted = config.mtp_num_layers is not None and post_process
    if given == wanted:
        return
    if given and config.mtp_num_layers is not None:
        raise ValueError(
            "GPTModel: mtp_block_spec is given with post_process=False, but the multi-token "
            "prediction depths share the output layer, so they live on the last pipeline stage: "
            "pass mtp_block_spec=None on the other stages (get_gpt_mtp_block_spec(config, spec, "
            "use_transformer_engine, vp_stage=..., pp_rank=...) returns None there)."
        )
    raise ValueError(
        f"GPTModel: multi-token prediction with config.mtp_num_layers="
        f"{config.mtp_num_layers} but mtp_block_spec is "
        f"{'None' if mtp_block_spec is None else 'given'}: pass mtp_block_spec="
        "get_gpt_mtp_block_spec(config, transformer_layer_spec, use_transformer_engine) "
        "exactly when config.mtp_num_layers is set (on the last pipeline stage)."
    )


def _check_yarn_arguments(
    config: TransformerConfig,
    position_embedding_type: str,
    **rotary_arguments: tuple[Any, Any],
) -> None:
    """YaRN for standard attention reads the config's `yarn_*` fields and rotates every channel
    of each head in halves, as upstream, whose YaRN ignores the other rotary arguments
    (`rotary_arguments`: name -> (value, default)) and asserts `rotary_interleaved` off; the
    `yarn_*` fields describe nothing without it (upstream's attention would still scale RoPE by
    their concentration factor)."""
    if position_embedding_type != "yarn":
        given = yarn_fields_set(config)
        if given and not config.multi_latent_attention:  # MLATransformerConfig refuses them
            raise ValueError(
                f"GPTModel: config {', '.join(given)} describes YaRN, but "
                f"position_embedding_type={position_embedding_type!r}; pass "
                "position_embedding_type='yarn', or leave the yarn_* fields at their defaults."
            )
        return
    if config.multi_latent_attention:
        raise ValueError(
            "GPTModel: position_embedding_type='yarn' with multi-latent attention, which rotates "
            "by its own embedding (the config's rope_type, YaRN by default, and its "
            "rotary_scaling_factor, beta_fast, ...); pass position_embedding_type='rope'."
        )
    given = [
        f"{name}={value!r}"
        for name, (value, default) in rotary_arguments.items()
        if value != default
    ]
    if config.rotary_interleaved:
        given.append("config.rotary_interleaved=True")
    if given:
        raise ValueError(
            f"GPTModel: position_embedding_type='yarn' with {', '.join(given)}: YaRN rotates "
            "every channel of each head, paired in halves, at its own frequencies (as "
            "upstream); leave these at their defaults, or use position_embedding_type='rope'."
        )


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
