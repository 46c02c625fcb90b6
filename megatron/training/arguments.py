"""Megatron-LM's command-line flags for GPT training: parse, validate, turn into configs.

`parse_args()` reads the flags (Megatron-LM's names and meanings; `docs/flags.md` lists them);
this module defines them. `validate_args()` fills the derived values (data-parallel size, FFN
width, params dtype, ...) and rejects bad combinations with a `ValueError` that names the flag
and the fix, and the `*_from_args` / `get_*` functions build what the library takes:
`TransformerConfig`, `DistributedDataParallelConfig` and the keyword arguments of
`parallel_state.initialize_model_parallel()`. Those live in `arguments_validation.py` and
`configs_from_args.py` and are re-exported here. A training script does:

    args = validate_args(parse_args())
    parallel_state.initialize_model_parallel(**get_parallel_state_kwargs(args))
    config = core_transformer_config_from_args(args)
    ddp_config = get_megatron_ddp_config(args)

The data-parallel size is the world size over the tensor- and context-parallel sizes (pipeline
parallelism is 1); expert parallelism (`--expert-model-parallel-size`) splits the experts of MoE
layers over ranks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron.training.arguments_validation import CKPT_FORMATS, validate_args
from megatron.training.configs_from_args import (
    FSDP_DTYPES,
    core_transformer_config_from_args,
    get_megatron_ddp_config,
    get_megatron_optimizer_config,
    get_parallel_state_kwargs,
)
from megatron.training.flag_errors import FlagParser
from megatron.training.flag_groups import (
    checkpointing,
    cuda_graphs,
    data,
    distributed,
    logs,
    mla,
    moe,
    multi_token_prediction,
    network,
    optimization,
    pipeline,
    precision,
    profiling,
    training,
    transformer,
    unbuilt,
    yarn,
)
from megatron.training.flag_groups.data import add_tokenizer_args

__all__ = [
    "CKPT_FORMATS",
    "FSDP_DTYPES",
    "add_megatron_arguments",
    "add_tokenizer_args",
    "core_transformer_config_from_args",
    "get_megatron_ddp_config",
    "get_megatron_optimizer_config",
    "get_parallel_state_kwargs",
    "parse_args",
    "validate_args",
]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it says something: not for switches (off by default) nor
    for flags without one (None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:  # 0 is a default to show
            return action.help
        return super()._get_help_string(action)


def parse_args(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    ignore_unknown_args: bool = False,
    args: list[str] | None = None,
) -> argparse.Namespace:
    """Parses Megatron-LM's flags (no validation: see `validate_args`).

    Args:
        extra_args_provider: Adds a script's own flags: takes the parser and returns it.
        ignore_unknown_args: Ignore flags nobody defined instead of exiting with an error.
        args: The flags to parse; None reads `sys.argv[1:]`.

    Returns:
        The namespace; derived values are filled in by `validate_args`.
    """
    parser = FlagParser(
        # The generated usage lists every flag: hundreds of lines before each error message.
        usage="%(prog)s [-h] [--flag [VALUE ...] ...]",
        description="Megatron-LM arguments; docs/flags.md explains each flag.",
        allow_abbrev=False,  # a typo must not silently select another flag
        formatter_class=_HelpFormatter,
    )
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args(args)[0]
    return parser.parse_args(args)


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every Megatron-LM flag to `parser`, in Megatron-LM's argument groups."""
    for add_group in (
        transformer.add_transformer_config_args,
        network.add_network_size_args,
        optimization.add_regularization_args,
        training.add_training_args,
        network.add_initialization_args,
        optimization.add_learning_rate_args,
        checkpointing.add_checkpointing_args,
        precision.add_mixed_precision_args,
        distributed.add_distributed_args,
        pipeline.add_pipeline_args,
        training.add_validation_args,
        data.add_data_args,
        add_tokenizer_args,
        logs.add_logging_args,
        profiling.add_profiling_args,
        moe.add_moe_args,
        mla.add_mla_args,
        yarn.add_yarn_args,
        multi_token_prediction.add_multi_token_prediction_args,
        cuda_graphs.add_cuda_graph_args,
        unbuilt.add_unbuilt_args,
    ):
        add_group(parser)
    return parser
