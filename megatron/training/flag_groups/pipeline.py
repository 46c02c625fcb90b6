"""Pipeline-parallel flags: the number of stages, their virtual stages and how the decoder
layers split over them (`megatron.core.pipeline_parallel`), and what pipeline stages do not
compose with yet."""

from __future__ import annotations

import argparse

from megatron.core.pipeline_parallel.layer_split import PipelineSplit
from megatron.core.pipeline_parallel.schedule_order import check_interleaving
from megatron.training.flag_groups.cuda_graphs import full_iteration_cuda_graph
from megatron.training.flag_groups.training_schedule import batch_size_schedule


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    """The pipeline flags (Megatron-LM's names, in its "distributed" group)."""
    group = parser.add_argument_group(title="pipeline parallelism")
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline stages (PP): the decoder layers split over them; 1F1B schedule.",
    )
    group.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        help="Layers of the first stage (unset: the even share).",
    )
    group.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        help="Layers of the last stage (unset: the even share).",
    )
    group.add_argument(
        "--account-for-embedding-in-pipeline-split",
        action="store_true",
        help="The embedding counts as a layer of the first stage.",
    )
    group.add_argument(
        "--account-for-loss-in-pipeline-split",
        action="store_true",
        help="The output layer and loss count as a layer of the last stage.",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        help="Layers of each virtual pipeline stage (model chunk); the interleaved schedule.",
    )
    group.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        help="Virtual pipeline stages (model chunks) per pipeline rank; the interleaved schedule.",
    )
    group.add_argument(
        "--no-overlap-p2p-communication",
        action="store_false",
        dest="overlap_p2p_comm",
        help="The interleaved schedule waits for each transfer between stages before its next "
        "pass, rather than overlapping them (needs --pipeline-model-parallel-size > 2).",
    )


def validate_pipeline(args: argparse.Namespace) -> None:
    """Derives `args.virtual_pipeline_model_parallel_size` (None: one chunk per rank) from the
    virtual-stage flags, and `args.overlap_p2p_comm` (off without virtual stages), as
    Megatron-LM; refuses, with several stages, the features pipeline stages do not compose with
    yet (the DDP engine's distributed optimizer with a copy of the embeddings on the last stage,
    CUDA graphs), a split of the layers that does not divide, and the layer-split and
    virtual-stage flags with one stage.

    Raises:
        ValueError: naming the flags and the fix.
    """
    args.virtual_pipeline_model_parallel_size = _virtual_stages(args)
    if args.virtual_pipeline_model_parallel_size is None:
        # As Megatron-LM: only the interleaved schedule overlaps its transfers (the flag can
        # only turn overlapping off, so no choice is overridden).
        args.overlap_p2p_comm = False
    elif not args.overlap_p2p_comm and args.pipeline_model_parallel_size <= 2:
        raise ValueError(
            "--no-overlap-p2p-communication with virtual pipeline stages needs "
            "--pipeline-model-parallel-size > 2 (Megatron-LM's rule: with 2 stages each batched "
            "exchange would hold several sends and receives between the same 2 ranks); drop it "
            "(the default overlaps the transfers) or use more stages."
        )
    split_flags = [
        flag
        for dest, flag in (
            ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
            ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
            (
                "account_for_embedding_in_pipeline_split",
                "--account-for-embedding-in-pipeline-split",
            ),
            ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
        )
        if getattr(args, dest) not in (None, False)
    ]
    if args.pipeline_model_parallel_size == 1:
        if args.virtual_pipeline_model_parallel_size is not None:
            split_flags.append(
                f"--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-"
                f"rank ({args.virtual_pipeline_model_parallel_size} virtual stages)"
            )
        if split_flags:
            raise ValueError(
                f"{', '.join(split_flags)} split the layers over pipeline stages: add "
                "--pipeline-model-parallel-size > 1 or drop them."
            )
        return
    PipelineSplit(
        num_layers=args.num_layers,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
    ).check()
    given = []
    if args.use_distributed_optimizer and not args.use_megatron_fsdp:
        # The last stage then holds a copy of the first stage's embeddings.
        if not args.untie_embeddings_and_output_weights:
            given.append(
                "--use-distributed-optimizer (the DDP engine's, with tied embeddings; pass "
                "--untie-embeddings-and-output-weights or use --use-megatron-fsdp)"
            )
        elif args.mtp_num_layers is not None:
            given.append(
                "--use-distributed-optimizer (the DDP engine's, with --mtp-num-layers, whose "
                "depths on the last stage share the first stage's embedding; use "
                "--use-megatron-fsdp)"
            )
    if args.cuda_graph_impl != "none" or full_iteration_cuda_graph(args):
        given.append(f"--cuda-graph-impl {args.cuda_graph_impl}")
    if given:
        raise ValueError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} does not "
            f"compose with {', '.join(given)} yet (docs/pipeline_parallel.md); drop them or use "
            "--pipeline-model-parallel-size 1."
        )


def _virtual_stages(args: argparse.Namespace) -> int | None:
    """The model chunks per pipeline rank the flags ask for, Megatron-LM's derivation: the two
    flags exclude each other; `--num-layers-per-virtual-pipeline-stage` divides each rank's
    even share of the layers (the embedding and the loss counted where the `--account-for-*`
    flags say) and does not take the uneven split; 1 is None (no virtual stages)."""
    per_stage_flag = args.num_layers_per_virtual_pipeline_stage
    per_rank_flag = args.num_virtual_stages_per_pipeline_rank
    for name, value in (
        ("--num-layers-per-virtual-pipeline-stage", per_stage_flag),
        ("--num-virtual-stages-per-pipeline-rank", per_rank_flag),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if per_stage_flag is not None and per_rank_flag is not None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "are both set; give one (as Megatron-LM)."
        )
    if per_stage_flag is None:
        virtual = per_rank_flag
    else:
        if (
            args.decoder_first_pipeline_num_layers is not None
            or args.decoder_last_pipeline_num_layers is not None
        ):
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage with --decoder-first-pipeline-num-"
                "layers / --decoder-last-pipeline-num-layers: give the virtual stages with "
                "--num-virtual-stages-per-pipeline-rank for an uneven split (as Megatron-LM)."
            )
        layers = args.num_layers + args.account_for_embedding_in_pipeline_split
        layers += args.account_for_loss_in_pipeline_split
        pp_size = args.pipeline_model_parallel_size
        if layers % pp_size:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage: the {layers} layer(s) (--num-layers "
                f"{args.num_layers}, the embedding and loss counted as the --account-for-* flags "
                f"say) do not split evenly over --pipeline-model-parallel-size {pp_size}; change "
                "--num-layers."
            )
        if (layers // pp_size) % per_stage_flag:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage_flag} does not divide the "
                f"{layers // pp_size} layer(s) of each of the --pipeline-model-parallel-size "
                f"{pp_size} ranks (--num-layers {args.num_layers}, the embedding and loss "
                "counted as the --account-for-* flags say); choose a divisor."
            )
        virtual = layers // pp_size // per_stage_flag
    return None if virtual == 1 else virtual


def validate_interleaving(args: argparse.Namespace) -> None:
    """With virtual stages, the number of microbatches of every global batch size the run uses
    (the constant one, or each size of a batch-size schedule within `--train-iters`) must suit
    the interleaved schedule (`schedule_order.check_interleaving`, Megatron-LM's rule: at least
    the pipeline size, and no last group of microbatches shorter than it). Megatron-LM finds a
    scheduled size that does not fit at the iteration that reaches it; here the run does not
    start.

    Raises:
        ValueError: naming the flags and the fix.
    """
    if args.virtual_pipeline_model_parallel_size is None:
        return
    pp_size = args.pipeline_model_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    schedule_flag = None  # the flag that schedules the batch size, if any
    if args.rampup_batch_size is not None:
        schedule_flag = "--rampup-batch-size"
    elif args.step_batch_size_schedule is not None:
        schedule_flag = "--step-batch-size-schedule"
    # At least the first iteration's size, also where --train-iters is 0 (the run stops
    # before training, and so is checked as one that trains).
    for consumed, global_batch_size in batch_size_schedule(args).sizes_within(
        max(args.train_iters or 0, 1)
    ):
        num_microbatches = global_batch_size // per_step
        try:
            check_interleaving(pp_size, num_microbatches, pp_size)
        except ValueError as error:
            source = f"--global-batch-size {global_batch_size}"
            if schedule_flag is not None:
                source = (
                    f"{schedule_flag} (a global batch of {global_batch_size} after {consumed} "
                    "consumed samples)"
                )
            raise ValueError(
                f"{source} gives {num_microbatches} microbatch(es) (of --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}), "
                f"which the interleaved schedule of {args.virtual_pipeline_model_parallel_size} "
                f"virtual stages per rank cannot run: {error}"
            ) from error
