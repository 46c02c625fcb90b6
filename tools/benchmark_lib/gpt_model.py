"""The GPT the benchmarking tools build: its command-line flags and its construction.

Defaults are the 1.34B benchmark configuration (hidden 2048, 24 layers, 16 heads, vocab 32000,
RoPE). The tensor-parallel size is the one `parallel_state` holds when the model is built. With
`--num-experts` every layer's MLP is a Mixture of Experts, split over the expert-parallel group
`parallel_state` holds then too. Imported by the benchmark scripts in `tools/` (`python
tools/<script>.py` puts `tools/` on the path).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig


def add_model_args(parser: argparse.ArgumentParser, micro_batch_size: int = 2) -> None:
    """Adds the model-shape, batch and precision flags."""
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument(
        "--num-query-groups", type=int, default=None, help="grouped-query attention (default MHA)"
    )
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=micro_batch_size)
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters and compute")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="sequence parallelism under tensor parallelism (off at TP 1, as Megatron-LM)",
    )
    parser.add_argument("--swiglu", action="store_true", help="gated SiLU MLPs (Llama, Mixtral)")
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    parser.add_argument("--num-experts", type=int, default=None, help="MoE MLPs (default dense)")
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    parser.add_argument("--moe-router-topk", type=int, default=2)
    parser.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    parser.add_argument("--moe-grouped-gemm", action="store_true", help="one grouped GEMM")
    parser.add_argument(
        "--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall"
    )
    parser.add_argument(
        "--moe-pad-dispatch-to-worst-case",
        action="store_true",
        help="with expert parallelism, pad the token exchanges to their largest size: no host "
        "read of the counts, so --cuda-graph can capture the step",
    )
    parser.add_argument(
        "--no-rope-fusion",
        action="store_false",
        dest="apply_rope_fusion",
        help="rotate queries and keys with PyTorch's ops instead of the fused Triton kernel",
    )
    parser.add_argument(
        "--no-bias-swiglu-fusion",
        action="store_false",
        dest="bias_swiglu_fusion",
        help="--swiglu: run the activation with PyTorch's ops instead of the fused Triton kernels",
    )
    parser.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        help="one-GPU and DDP engines (and Megatron-FSDP's whole sums with "
        "--megatron-fsdp-accumulate-unsharded-grads): add bf16 weight gradients to the fp32 "
        "main_grad after backward instead of accumulating them there in the GEMM",
    )
    parser.add_argument(
        "--attention-backend",
        choices=[backend.name for backend in AttnBackend],
        default=AttnBackend.auto.name,
        help="attention kernel: SDPA's choice (auto), flash, fused (cuDNN), unfused or local",
    )
    parser.add_argument(
        "--fp8-format",
        choices=("e4m3", "hybrid"),
        default=None,
        help="also time each engine with the transformer layers' linears in FP8 (bf16 first)",
    )
    parser.add_argument("--fp8-recipe", choices=("delayed", "tensorwise"), default="delayed")
    parser.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="Megatron-FSDP's FP8 runs keep and gather the FP8 layers' weights in FP8",
    )
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="torch.compile each transformer layer (TransformerConfig.compile_layers, inductor)",
    )
    parser.add_argument(
        "--no-compile-cpp-wrapper",
        action="store_false",
        dest="compile_cpp_wrapper",
        help="--compile-layers' kernels launched from generated Python, not C++ (CUDA)",
    )


def parallel_sizes(
    parser: argparse.ArgumentParser, flag: str, spec: str | None, divided: tuple[str, int]
) -> list[int]:
    """The sizes the comma-separated `flag` names (None: the world size, halved down to 1),
    each checked to divide the world size and `divided` (a flag's name and value); bad ones
    exit through `parser.error`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if spec is not None:
        sizes = [int(size) for size in spec.split(",") if size.strip()]
    else:
        sizes, size = [], world
        while size >= 1:
            sizes.append(size)
            size //= 2
    name, value = divided
    if not sizes or any(size < 1 or world % size or value % size for size in sizes):
        parser.error(
            f"{flag} {sizes}: each must divide the world size ({world}) and {name} ({value})."
        )
    return sizes


def set_parallel_state(create_all_gather_group: bool, **sizes: int) -> None:
    """(Re)initialises `parallel_state` with the given `*_model_parallel_size`s (and
    `num_distributed_optimizer_instances`)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        create_all_gather_group=create_all_gather_group, **sizes
    )


def build_gpt(
    args: argparse.Namespace,
    bf16: bool | None = None,
    pg_collection: ProcessGroupCollection | None = None,
) -> tuple[TransformerConfig, GPTModel]:
    """The config and model the flags describe, on the current default device (use
    `with torch.device(...)`, `meta` included).

    Args:
        args: the flags of `add_model_args`.
        bf16: overrides `args.bf16` (e.g. an fp32 model whose engine casts to bf16 itself).
        pg_collection: the model's process groups; None: parallel_state's.
    """
    bf16 = args.bf16 if bf16 is None else bf16
    tp = 1
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=args.swiglu and args.bias_swiglu_fusion,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        apply_rope_fusion=args.apply_rope_fusion,
        attention_backend=AttnBackend[args.attention_backend],
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        compile_layers=args.compile_layers,
        compile_cpp_wrapper=args.compile_cpp_wrapper,
        # The tools that capture their steps (`--cuda-graph`) define the flag.
        cuda_graph_impl="full_iteration" if getattr(args, "cuda_graph", False) else "none",
        fp8=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        tensor_model_parallel_size=tp,
        sequence_parallel=args.sequence_parallel and tp > 1,
        **_moe_fields(args),
    )
    if config.num_moe_experts is None:
        spec = get_gpt_layer_local_spec()
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config,
        spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
        pg_collection=pg_collection,
    )
    return config, model


def _moe_fields(args: argparse.Namespace) -> dict:
    """The MoE fields of the config (none for a dense model)."""
    if args.num_experts is None:
        return {}
    ep = 1
    if parallel_state.model_parallel_is_initialized():
        ep = parallel_state.get_expert_model_parallel_world_size()
    return dict(
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_pad_dispatch_to_worst_case=args.moe_pad_dispatch_to_worst_case,
        expert_model_parallel_size=ep,
    )
