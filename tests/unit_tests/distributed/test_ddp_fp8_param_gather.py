"""`fp8_param_gather` with the DDP engine's distributed optimizer: the weights of FP8 linear
layers are all-gathered as FP8 bytes after the step. It must change only what travels: a tiny
FP8 GPT trains bit for bit as without it (losses, main weights; the FP8 bytes and scales the
layers compute with are the cast of the whole weight the run without it holds), at 2 and 4
ranks, with tensor parallelism, several buckets and gradient accumulation, across in-place
writes, `broadcast_params()` and repeated gathers; each such weight's all-gather sends half of
bf16's bytes, and the amaxes of all of them are reduced once per step; through
`pretrain_gpt.py` too. Without the distributed optimizer there is no parameter all-gather: the
option is refused by name, as upstream does."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    bucket_shards,
)
from megatron.core.distributed.fsdp import collectives
from megatron.core.fp8.weights import (
    Fp8ExpertWeights,
    Fp8Weight,
    fp8_weight_of,
    quantized_weight,
)
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.unit_tests.distributed.fsdp.test_fp8_param_gather import MOE
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    build_tiny_gpt,
    make_token_batches,
    shard_batch,
    tiny_gpt_config,
)
from tests.unit_tests.training.checkpoint_checks import RUN, assert_same, main, whole_value

FP8 = dict(
    params_dtype=torch.bfloat16,
    bf16=True,
    fp8="hybrid",
    fp8_amax_history_len=4,
    fp8_amax_compute_algo="max",
)
FP8_FLAGS = (
    "--bf16 --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max".split()
)
STEPS, MICROBATCHES = 3, 2
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclasses.dataclass
class _Gathers:
    """The bytes each all-gather sends from this rank, by dtype, and the amax reductions."""

    sent: dict[torch.dtype, int] = dataclasses.field(default_factory=dict)
    amax_reduces: int = 0

    def add(self, inputs: list[torch.Tensor]) -> None:
        dtype = inputs[0].dtype
        sent = sum(t.numel() * t.element_size() for t in inputs)
        self.sent[dtype] = self.sent.get(dtype, 0) + sent


@contextlib.contextmanager
def _spy() -> Iterator[_Gathers]:
    """Counts the engine's parameter all-gathers (model dtype: one flat buffer per bucket and
    dtype; FP8: one grouped collective per bucket) and amax all-reduces."""
    calls = _Gathers()
    single, grouped = bucket_shards.all_gather_single, collectives._all_gather_coalesced
    reduce_max = collectives.Collectives.all_reduce_max

    def spied_single(output, input, **kwargs):
        calls.add([input])
        return single(output, input, **kwargs)

    def spied_grouped(outputs, inputs, **kwargs):
        calls.add(inputs)
        return grouped(outputs, inputs, **kwargs)

    def spied_reduce_max(comm, *args, **kwargs):
        calls.amax_reduces += 1
        return reduce_max(comm, *args, **kwargs)

    with (
        mock.patch.object(bucket_shards, "all_gather_single", spied_single),
        mock.patch.object(collectives, "_all_gather_coalesced", spied_grouped),
        mock.patch.object(collectives.Collectives, "all_reduce_max", spied_reduce_max),
    ):
        yield calls


def _fp8_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {
        name: param
        for name, param in model.named_parameters()
        if name.endswith(".weight") and any(f".{linear}." in name for linear in LINEARS)
    }


def _fp8_values(made: Fp8Weight | Fp8ExpertWeights) -> tuple[torch.Tensor, ...]:
    """An FP8 weight's bytes, its scales' inverses (one per expert of stacked expert weights)
    and its dequantised values."""
    if isinstance(made, Fp8ExpertWeights):
        dequantised = torch.stack([expert.tensor.dequantize() for expert in made.experts])
        return made.data.view(torch.uint8), made.scale_invs(), dequantised
    tensor = made.tensor
    return tensor.data.view(torch.uint8), tensor.scale_inv.view(-1), tensor.dequantize()


def _moe_gpt(tp: int, ep: int) -> torch.nn.Module:
    """A tiny GPT whose second layer is MoE (4 experts, a shared expert) at expert parallelism
    `ep`, in FP8."""
    config = tiny_gpt_config(
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        **FP8,
        **MOE,
        num_moe_experts=4,
        expert_model_parallel_size=ep,
    )
    torch.manual_seed(1234)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config, spec, vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH)


def _train(
    fp8_param_gather: bool,
    *,
    tp: int = 1,
    bucket_size: int | None = None,
    written: str | None = None,
    ep: int | None = None,
) -> dict:
    """STEPS steps of MICROBATCHES microbatches (Megatron's AdamW with clipping) under the DDP
    engine's distributed optimizer; `written`: after the first step the weights are replaced
    through a load ("load", then `reload_model_params()`) or by `broadcast_params()` of rank
    0's ("broadcast"), or gathered again (`start_param_sync(force_sync=True)`, "resync").
    With `ep`, the GPT's second layer is an MoE layer at expert parallelism `ep`.

    Returns:
        The losses, each global main weight, the parameters, the engine's state dict (whole
        values), each FP8 weight's bytes and scale and this rank's rows of it, and what the
        gathers sent.
    """
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep or 1
    )
    model_parallel_cuda_manual_seed(1234, device_type="cpu")
    if ep is None:
        config = tiny_gpt_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, **FP8)
        model = build_tiny_gpt(config)
    else:
        model = _moe_gpt(tp, ep)
        config = model.config
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        fp8_param_gather=fp8_param_gather,
        bucket_size=bucket_size,
        overlap_grad_reduce=bucket_size is not None,
    )
    ddp = DistributedDataParallel(
        config, ddp_config, model, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.5), ddp)
    dp = parallel_state.get_data_parallel_group()
    batches = make_token_batches(STEPS * MICROBATCHES, 4 * dp.size(), seed=5)
    losses = []
    with _spy() as gathers:
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            for micro in range(MICROBATCHES):
                tokens, labels = batches[step * MICROBATCHES + micro]
                tokens, labels = (shard_batch(t, dp.rank(), dp.size()) for t in (tokens, labels))
                last = micro == MICROBATCHES - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = ddp(tokens, labels=labels).float().mean() / MICROBATCHES
                    loss.backward()
                losses.append(loss.detach().clone())
            ddp.finish_grad_sync()
            assert optimizer.step()[0]
            if step == 0 and written is not None:
                _write(ddp, optimizer, written)
    fp8 = {
        name: _fp8_values(fp8_weight_of(param))[:2]
        for name, param in _fp8_weights(ddp.module).items()
    }
    return dict(
        losses=torch.stack(losses),
        mains=[main.full_tensor() for main in optimizer.get_main_params()],
        params={name: p.detach().clone() for name, p in ddp.module.named_parameters()},
        state={name: whole_value(value) for name, value in ddp.state_dict().items()},
        fp8={name: (data.clone(), scale_invs.clone()) for name, (data, scale_invs) in fp8.items()},
        own_rows={name: _own_rows(ddp, p) for name, p in _fp8_weights(ddp.module).items()},
        sent=gathers.sent,
        amax_reduces=gathers.amax_reduces,
    )


def _write(ddp: DistributedDataParallel, optimizer, how: str) -> None:
    if how == "resync":  # what a CUDA graph's runner does before the model runs eagerly
        ddp.start_param_sync(force_sync=True)
        return
    other = build_tiny_gpt(ddp.module.config, seed=4321)
    if how == "load":
        ddp.module.load_state_dict(other.state_dict())
        optimizer.reload_model_params()
        return
    assert how == "broadcast"
    if torch.distributed.get_rank() == 0:
        for param, value in zip(ddp.module.parameters(), other.parameters()):
            param.data.copy_(value)  # through `.data`: no version counter sees it
    ddp.broadcast_params()
    optimizer.reload_model_params()


def _own_rows(ddp: DistributedDataParallel, param: torch.nn.Parameter) -> tuple[int, int]:
    rows = ddp.param_shard(param)
    start = (rows.data_ptr() - param.data_ptr()) // (param.stride(0) * param.element_size())
    return start, start + rows.shape[0]


def _assert_changes_only_what_travels(with_fp8: dict, without: dict, weights: int = 8) -> None:
    """`weights`: the FP8 weights (8: 4 linear layers in each of 2 layers)."""
    assert torch.equal(with_fp8["losses"], without["losses"])
    assert len(with_fp8["mains"]) == len(without["mains"])
    for main_weight, expected in zip(with_fp8["mains"], without["mains"]):
        assert torch.equal(main_weight, expected)
    assert len(with_fp8["fp8"]) == weights
    for name, (data, scale_inv) in with_fp8["fp8"].items():
        # The reference: the cast of the whole weight the run without the option holds.
        weight = without["params"][name]
        reference_data, reference_scale_inv, dequantised = _fp8_values(quantized_weight(weight))
        assert torch.equal(data, reference_data), name
        assert torch.equal(scale_inv, reference_scale_inv), name
        assert torch.equal(data, without["fp8"][name][0]), name
        # The parameter: this rank's rows as written, the others' the dequantised FP8 weight.
        param = with_fp8["params"][name]
        start, stop = with_fp8["own_rows"][name]
        assert stop > start
        assert torch.equal(param[start:stop], weight[start:stop]), name
        dequantised = dequantised.to(param.dtype)
        for part in (slice(0, start), slice(stop, None)):
            assert torch.equal(param[part], dequantised[part]), name
        if stop - start < len(param):  # FP8 values differ from bf16 ones
            assert not torch.equal(param, weight), name
    for name, param in with_fp8["params"].items():
        if name not in with_fp8["fp8"]:
            assert torch.equal(param, without["params"][name]), name
    # The state dict (what a checkpoint saves) holds the exact rows of each weight's owner.
    assert_same(with_fp8["state"], without["state"], "state dict")


TOPOLOGIES = {
    "1-rank": (1, {}),  # nothing gathered: the cast in place
    "2-ranks": (2, {}),
    "2-ranks-buckets": (2, dict(bucket_size=3000)),
    "4-ranks": (4, {}),
    "4-ranks-tp2": (4, dict(tp=2)),
}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_fp8_param_gather_changes_only_what_travels(topology):
    world_size, build = TOPOLOGIES[topology]
    with_fp8 = run_distributed(_train, world_size, True, **build)
    without = run_distributed(_train, world_size, False, **build)
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_changes_only_what_travels(rank_with, rank_without)


@pytest.mark.parametrize("world_size, ep", [(2, 1), (4, 2)], ids=["2-ranks-ep1", "4-ranks-ep2"])
def test_fp8_expert_weights_gather_as_fp8_with_one_scale_per_expert(world_size, ep):
    """The stacked expert weights' rows are experts: each rank casts its experts with their own
    scales and the others' rows hold their dequantised FP8 values."""
    with_fp8 = run_distributed(_train, world_size, True, ep=ep)
    without = run_distributed(_train, world_size, False, ep=ep)
    for rank_with, rank_without in zip(with_fp8, without):
        # 4 linear layers, then 2 attention ones, 2 of the routed and 2 of the shared experts.
        _assert_changes_only_what_travels(rank_with, rank_without, weights=10)


@pytest.mark.parametrize("written", ["load", "broadcast", "resync"])
def test_weights_written_between_steps_are_what_fp8_layers_compute_with(written):
    """A load (with `reload_model_params()`) or `broadcast_params()` after a step: the FP8
    layers compute with the new weights until the next gather, as without the option; a second
    gather of the same main weights changes nothing."""
    with_fp8 = run_distributed(_train, 2, True, written=written)
    without = run_distributed(_train, 2, False, written=written)
    reference = run_distributed(_train, 2, False)[0]
    for rank_with, rank_without in zip(with_fp8, without):
        _assert_changes_only_what_travels(rank_with, rank_without)
    if written != "resync":  # the write changed training
        assert not torch.equal(without[0]["losses"][2:], reference["losses"][2:])


def test_fp8_weights_send_half_the_bytes_and_scale_in_one_reduction():
    """Each rank sends its rows of each FP8 weight as one byte per element, where bf16 sends
    two; the rows of every other parameter as before; one MAX all-reduce of the amaxes per
    step."""
    with_fp8 = run_distributed(_train, 2, True)[0]
    without = run_distributed(_train, 2, False)[0]
    rows_sent = sum(
        -(-param.shape[0] // 2) * param.shape[1]  # this rank's chunk, padded as the layout
        for name, param in with_fp8["params"].items()
        if name in with_fp8["fp8"]
    )
    assert with_fp8["sent"][torch.uint8] == STEPS * rows_sent
    bf16_saved = without["sent"][torch.bfloat16] - with_fp8["sent"][torch.bfloat16]
    assert bf16_saved == 2 * with_fp8["sent"][torch.uint8]
    assert torch.uint8 not in without["sent"]
    assert with_fp8["amax_reduces"] == STEPS and without["amax_reduces"] == 0


def test_fp8_param_gather_without_the_distributed_optimizer_is_refused_by_name():
    with pytest.raises(ValueError, match="fp8_param_gather=True needs use_distributed_optimizer"):
        DistributedDataParallelConfig(fp8_param_gather=True)
    # With it, or under Megatron-FSDP, the config takes it.
    DistributedDataParallelConfig(fp8_param_gather=True, use_distributed_optimizer=True)
    DistributedDataParallelConfig(fp8_param_gather=True, use_megatron_fsdp=True)


def _wrap(config_fields: dict) -> str:
    model = build_tiny_gpt(tiny_gpt_config(**config_fields))
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=True
    )
    with pytest.raises(ValueError) as refused:
        DistributedDataParallel(model.config, ddp_config, model)
    return str(refused.value)


def test_fp8_param_gather_needs_bf16_fp8_layers():
    """Without FP8 layers there is nothing to gather in FP8; fp32 weights are the optimizer's
    main weights, which the FP8 values must not replace."""
    (message,) = run_distributed(_wrap, 1, dict(params_dtype=torch.bfloat16, bf16=True))
    assert "this model has none: set config.fp8" in message
    (message,) = run_distributed(_wrap, 1, dict(fp8="hybrid"))
    assert "needs bf16 or fp16 weights, and decoder.layers.0" in message


def test_pretrain_with_the_flag_trains_as_without_it():
    """Through `pretrain_gpt.py` (dropout, clipping, evaluation forwards, a warmup-cosine
    schedule): `--fp8-param-gather --use-distributed-optimizer` gives the losses, gradient norms
    and validation losses of the same run without `--fp8-param-gather`, bit for bit."""
    flags = [*RUN, *FP8_FLAGS, "--use-distributed-optimizer"]
    with_fp8 = run_distributed(main, 2, [*flags, "--fp8-param-gather"])
    without = run_distributed(main, 2, flags)
    assert with_fp8[0].losses == without[0].losses
    assert with_fp8[0].grad_norms == without[0].grad_norms
    assert with_fp8[0].validation_losses == without[0].validation_losses
    assert with_fp8[1].losses == with_fp8[0].losses
