"""Pretrains a GPT with Megatron-LM's flags: the project's training entry point.

    torchrun --nproc-per-node 2 pretrain_gpt.py --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads_params --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 4 --global-batch-size 16 \\
        --train-iters 50 --lr 3e-3 --mock-data --vocab-size 128 --distributed-backend gloo

On real data: `--data-path PREFIX --tokenizer-type ByteLevelTokenizer` (PREFIX as written by
`tools/preprocess_data.py`; `examples/quick_start.sh` does both steps).

Without `--use-megatron-fsdp` the DDP engine trains instead. `docs/flags.md` lists the flags,
`docs/running.md` shows runs on CPU and GPU. This file holds what is specific to GPT (the model,
the batch, the loss, the datasets); `megatron.training.pretrain` does the rest.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.utils.data import Dataset

from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.datasets import (
    GPTDatasetConfig,
    MockGPTDataset,
    build_gpt_datasets,
    pad_token_of,
    parse_data_path,
)
from megatron.core.enums import ModelType
from megatron.core.models.gpt import (
    GPTModel,
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.flag_errors import report_flag_errors
from megatron.training.flag_groups.data import PER_SPLIT_FLAGS
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.schedules import DataIterator, LossFunc
from megatron.training.training import TrainingHistory, pretrain
from megatron.training.utils import get_device, print_rank_0


def model_provider(
    pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None
) -> GPTModel:
    """The GPT the flags describe, on the current default device (with `--num-experts`, the
    block spec makes the MoE layers `--moe-layer-freq` selects; with `--mtp-num-layers`, the
    multi-token prediction depths follow the decoder); with pipeline stages the part of this
    rank's stage (and with virtual stages, of its chunk `vp_stage`)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    decoder_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    return GPTModel(
        config,
        decoder_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        mtp_block_spec=get_gpt_mtp_block_spec(
            config, decoder_spec, use_transformer_engine=use_te, vp_stage=vp_stage
        ),
        vp_stage=vp_stage,
    )


def get_batch(data_iterator: DataIterator) -> dict[str, torch.Tensor]:
    """The next micro-batch on this rank's device: tokens, labels, loss_mask, position_ids, and
    attention_mask with `--reset-attention-mask` (otherwise the dataset's mask is the causal
    one, which the model applies itself, faster, so it stays on the host). With
    `--context-parallel-size` this rank's two chunks of each sequence
    (`get_batch_on_this_cp_rank`)."""
    data = next(data_iterator)
    if not get_args().reset_attention_mask:
        data.pop("attention_mask", None)
    device = get_device()
    batch = {key: value.to(device, non_blocking=True) for key, value in data.items()}
    return get_batch_on_this_cp_rank(batch)


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron-LM's `(loss sum, token count, {"lm loss": [sum, count]})` over the unmasked
    tokens. The loop backpropagates each micro-batch's mean (the sum over at least one token),
    or with `--calculate-per-token-loss` the sum, dividing the gradients by the global batch's
    tokens; either way it reports the global batch's loss per token: the sum of the sums over
    the sum of the counts.
    """
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().detach()
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens])}


def forward_step(
    data_iterator: DataIterator, model: torch.nn.Module
) -> tuple[torch.Tensor, LossFunc]:
    """Forward of one micro-batch: the per-token losses and the function that reduces them
    (the loss mask goes to the model too, for its multi-token prediction losses)."""
    batch = get_batch(data_iterator)
    output_tensor = model(
        batch["tokens"],
        batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output_tensor, functools.partial(loss_func, batch["loss_mask"])


def core_gpt_dataset_config_from_args(args: argparse.Namespace) -> GPTDatasetConfig:
    """The `GPTDatasetConfig` of `--data-path` runs, or of `--train-data-path` etc. (its
    `blend_per_split`; Megatron-LM's function of that name): the tokenizer's EOD, pad id
    (upstream's rule) and vocabulary size come with the flags."""
    tokenizer = get_tokenizer()
    per_split = [getattr(args, f"{split}_data_path") for split in PER_SPLIT_FLAGS]
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend_per_split=(
            None if args.data_path else [parse_data_path(p) if p else None for p in per_split]
        ),
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        eod_token=tokenizer.eod,
        pad_token=pad_token_of(tokenizer, args.allow_ambiguous_pad_tokens),
        vocab_size=tokenizer.vocab_size,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int],
) -> tuple[Dataset | None, ...]:
    """The datasets of `--data-path` (split by `--split`, blended by its weights), of
    `--train-data-path`, `--valid-data-path` and `--test-data-path` (each split's own), or
    `--mock-data` datasets of the requested sizes (each split draws other sequences)."""
    args = get_args()
    if args.data_path:
        print_rank_0(f"> building GPT datasets from {' '.join(args.data_path)} ...")
        return build_gpt_datasets(
            core_gpt_dataset_config_from_args(args), train_val_test_num_samples, args.data_path
        )
    if args.train_data_path:
        print_rank_0("> building GPT datasets from --train-data-path etc. ...")
        return build_gpt_datasets(
            core_gpt_dataset_config_from_args(args), train_val_test_num_samples
        )
    print_rank_0("> building mock GPT datasets (train, validation, test) ...")
    vocab_size = get_tokenizer().vocab_size if args.tokenizer_type else args.vocab_size
    return tuple(
        MockGPTDataset(num_samples, args.seq_length, vocab_size, seed=args.seed + split)
        if num_samples > 0
        else None
        for split, num_samples in enumerate(train_val_test_num_samples)
    )


def main(argv: list[str] | None = None) -> TrainingHistory:
    """Trains with the flags in `argv` (None: the command line); returns the history."""
    return pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        argv=argv,
    )


if __name__ == "__main__":
    with report_flag_errors():
        main()
