"""Pipeline-parallel flags: the number of stages and how the decoder layers split over them
(`megatron.core.pipeline_parallel`), and what pipeline stages do not compose with yet."""

from __future__ import annotations

import argparse

from megatron.training.flag_groups.cuda_graphs import full_iteration_cuda_graph


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


_NOT_COMPOSED = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size", 1),
    ("context_parallel_size", "--context-parallel-size", 1),
    ("expert_model_parallel_size", "--expert-model-parallel-size", 1),
    ("num_experts", "--num-experts", None),
    ("mtp_num_layers", "--mtp-num-layers", None),
    ("fp8", "--fp8-format", None),
)
"""(dest, flag, the value that composes): what pipeline stages do not compose with yet."""


def validate_pipeline(args: argparse.Namespace) -> None:
    """Refuses, with several stages, the features pipeline stages do not compose with yet, and
    the layer-split flags with one stage.

    Raises:
        ValueError: naming the flags and the fix.
    """
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
        if split_flags:
            raise ValueError(
                f"{', '.join(split_flags)} split the layers over pipeline stages: add "
                "--pipeline-model-parallel-size > 1 or drop them."
            )
        return
    given = [
        flag
        for dest, flag, composes in _NOT_COMPOSED
        if getattr(args, dest, composes) not in (composes, 0 if composes is None else composes)
    ]
    if args.use_distributed_optimizer and not args.use_megatron_fsdp:
        if not args.untie_embeddings_and_output_weights:
            given.append(
                "--use-distributed-optimizer (the DDP engine's, with tied embeddings; pass "
                "--untie-embeddings-and-output-weights or use --use-megatron-fsdp)"
            )
    if args.cuda_graph_impl != "none" or full_iteration_cuda_graph(args):
        given.append(f"--cuda-graph-impl {args.cuda_graph_impl}")
    if given:
        raise ValueError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} does not "
            f"compose with {', '.join(given)} yet (docs/pipeline_parallel.md); drop them or use "
            "--pipeline-model-parallel-size 1."
        )
