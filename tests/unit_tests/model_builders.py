"""Tiny models and data shared by the engine tests (CPU-sized: hidden 32, 2 layers)."""

from __future__ import annotations

import torch

from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import current_device

VOCAB_SIZE = 64
SEQ_LENGTH = 8

MOE_STATE_VARIANTS = {
    # Every MoE part that holds parameters or buffers: the router's weight and expert bias
    # (a buffer), the experts, the shared experts and their gate.
    "shared_experts_gate_expert_bias": dict(
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True,
        add_bias_linear=False,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    ),
    # The router's and the experts' biases.
    "biases": dict(add_bias_linear=True),
}
"""MoE config fields (over a config with experts) that give each part with state its own."""


def tiny_gpt_config(**overrides) -> TransformerConfig:
    """A 2-layer, hidden-32 config without dropout, so runs are deterministic."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_tiny_gpt(config: TransformerConfig | None = None, seed: int = 1234, **kwargs) -> GPTModel:
    """Builds a tiny GPT with deterministic weights (the same on every rank), on this rank's
    device: the local layer spec, or with experts the decoder block spec of MoE layers."""
    config = config or tiny_gpt_config()
    torch.manual_seed(seed)
    kwargs.setdefault("vocab_size", VOCAB_SIZE)
    kwargs.setdefault("max_sequence_length", SEQ_LENGTH)
    spec = get_gpt_layer_local_spec()
    if config.num_moe_experts is not None:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    # Initialise on CPU so that CPU and GPU ranks start from bit-identical weights.
    return GPTModel(config, spec, **kwargs).to(current_device())


def make_token_batches(
    num_batches: int, batch_size: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) pairs of shape [batch_size, SEQ_LENGTH], labels shifted by one."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        data = torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LENGTH + 1), generator=generator)
        batches.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return batches


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (dim 0), on this rank's device."""
    return batch.chunk(world_size)[rank].to(current_device())


def device_batch(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One (tokens, labels) batch on this rank's device."""
    tokens, labels = make_token_batches(1, batch_size, seed)[0]
    return tokens.to(current_device()), labels.to(current_device())


def wrap_for_engine(model: GPTModel, engine: str, **fields) -> torch.nn.Module:
    """`model` under the DDP engine (`engine` "ddp") or Megatron-FSDP with that sharding
    strategy, with `fields` of `DistributedDataParallelConfig` (e.g. hybrid sharding, the
    distributed optimizer), default configs otherwise."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import FullyShardedDataParallel

    if engine == "ddp":
        ddp_config = DistributedDataParallelConfig(**fields)
        return DistributedDataParallel(model.config, ddp_config, model)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=engine, **fields
    )
    return FullyShardedDataParallel(model.config, ddp_config, model)


def assert_same_training_signal(
    configs: list[TransformerConfig], device: torch.device | str | None = None, **build_kwargs
) -> None:
    """Builds `build_tiny_gpt(config, **build_kwargs)` for each config (same seed, so the same
    weights) on `device` (None: `current_device()`) and asserts that one batch gives each the
    same per-token losses and gradients."""
    device = device or current_device()
    tokens, labels = (t.to(device) for t in make_token_batches(1, 3)[0])
    results = []
    for config in configs:
        model = build_tiny_gpt(config, **build_kwargs).to(device)
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (expected_loss, expected_grads), *others = results
    for loss, grads in others:
        torch.testing.assert_close(loss, expected_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], msg=name)
