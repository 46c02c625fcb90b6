"""Pipeline stages give the losses and full gradients of the whole model (PP 1), fp32.

4 microbatches through 1F1B and the interleaved schedule (2 virtual stages per rank), under the
DDP engine and Megatron-FSDP (ZeRO-3), with tied embeddings (the two copies' gradients summed
over the embedding group): PP 2 on 2 gloo ranks; PP 2 x DP 2 and PP 4 on 4. The reference is the
unsplit model run by plain autograd on the same global microbatches; each stage's weights are
copied from it by global layer number.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.pipeline_parallel.tied_embeddings import (
    allreduce_tied_embedding_grads,
    broadcast_tied_embeddings,
)
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    build_tiny_gpt,
    make_token_batches,
    tiny_gpt_config,
    wrap_for_engine,
)

NUM_MICROBATCHES = 4
MICRO_BATCH_SIZE = 2


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    output = model(tokens, labels=labels)

    def loss_func(losses):
        loss = losses.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _reference(num_layers: int, batches):
    """Loss per microbatch and the gradients of their mean, by plain autograd."""
    model = build_tiny_gpt(
        tiny_gpt_config(num_layers=num_layers), share_embeddings_and_output_weights=True
    )
    losses = []
    for tokens, labels in batches:
        loss = model(tokens, labels=labels).float().mean()
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return model, torch.stack(losses), grads


def _global_name(name: str, layer_range: range) -> str:
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match is None:
        return name
    return f"decoder.layers.{layer_range[int(match.group(1))]}.{match.group(2)}"


def _reference_name(name: str, model: GPTModel) -> str:
    name = _global_name(name, model.decoder.layer_range)
    # The last stage's copy of the tied embeddings.
    return "embedding.word_embeddings.weight" if name == "output_layer.weight" else name


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _run_pipeline(
    engine: str,
    num_layers: int,
    vp_size: int | None,
    pp_size: int = 2,
    overlap_p2p_comm: bool = False,
    outputs: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Checks one split against the whole model; returns the names of the parameters checked,
    and puts the losses and gradients into `outputs` when given."""
    device = current_device()
    world = torch.distributed.get_world_size()
    global_batches = [
        (tokens.to(device), labels.to(device))
        for tokens, labels in make_token_batches(
            NUM_MICROBATCHES, MICRO_BATCH_SIZE * world // pp_size
        )
    ]
    reference, _, expected_grads = _reference(num_layers, global_batches)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp_size)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    # This data-parallel rank's part of each microbatch, and the whole model's loss on it.
    batches = [
        (tokens.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank])
        for tokens, labels in global_batches
    ]
    with torch.no_grad():
        expected_losses = torch.stack(
            [reference(tokens, labels=labels).float().mean() for tokens, labels in batches]
        )
    config = tiny_gpt_config(
        num_layers=num_layers,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vp_size,
        overlap_p2p_comm=overlap_p2p_comm,
    )
    num_chunks = vp_size or 1
    chunks = []
    reference_state = reference.state_dict()
    for stage in range(num_chunks):
        torch.manual_seed(100 + rank)  # other weights than the reference's, overwritten below
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB_SIZE,
            max_sequence_length=SEQ_LENGTH,
            pre_process=rank == 0 and stage == 0,
            post_process=rank == pp_size - 1 and stage == num_chunks - 1,
            share_embeddings_and_output_weights=True,
            vp_stage=stage if vp_size else None,
        ).to(device)
        state = {}
        for name in model.state_dict():
            if name == "output_layer.weight":
                continue  # the tied copy comes from the first stage
            state[name] = reference_state[_reference_name(name, model)]
        model.load_state_dict(state, strict=False)
        chunks.append(model)
    broadcast_tied_embeddings(chunks, parallel_state.get_embedding_group())
    wrapped = [wrap_for_engine(model, engine) for model in chunks]
    for chunk in wrapped:
        chunk.zero_grad_buffer()
    forward_backward = get_forward_backward_func(pp_size, vp_size)
    loss_dicts, _ = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=wrapped if vp_size else wrapped[0],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
    )
    for chunk in wrapped:
        chunk.finish_grad_sync()
    allreduce_tied_embedding_grads(wrapped, parallel_state.get_embedding_group())
    if rank == pp_size - 1:
        losses = torch.stack([d["lm loss"] for d in loss_dicts])
        torch.testing.assert_close(losses, expected_losses)
        if outputs is not None:
            outputs["losses"] = losses
    else:
        assert loss_dicts == []
    checked = set()
    for model in chunks:
        for name, param in model.named_parameters():
            grad = param.main_grad if engine == "ddp" else _full(param.grad)
            reference_name = _reference_name(name, model)
            torch.testing.assert_close(grad, expected_grads[reference_name], msg=reference_name)
            checked.add(reference_name)
            if outputs is not None:
                outputs[reference_name] = grad.detach().clone()
    return sorted(checked)


CASES = [(engine, vp_size) for engine in ("ddp", "optim_grads_params") for vp_size in (None, 2)]
"""(engine, virtual stages per rank): 1F1B and interleaved under DDP and ZeRO-3, one spawn."""

CASES_4_RANKS = [
    # (engine, virtual stages per rank, pipeline size): PP 2 x DP 2 (every sharding strategy),
    # then PP 4.
    ("ddp", None, 2),
    ("no_shard", 2, 2),
    ("optim", None, 2),
    ("optim_grads", 2, 2),
    ("optim_grads_params", 2, 2),
    ("ddp", 2, 4),
    ("optim_grads_params", None, 4),
]


def _run_cases(cases) -> list[list[str]]:
    checked = []
    for engine, vp_size, *pp_size in cases:
        pp = pp_size[0] if pp_size else 2
        num_layers = pp * (vp_size or 1)
        try:
            checked.append(_run_pipeline(engine, num_layers, vp_size, pp))
        except AssertionError as error:
            raise AssertionError(f"{engine}, PP {pp}, virtual stages {vp_size}: {error}") from error
        finally:
            parallel_state.destroy_model_parallel()
    return checked


def _assert_every_parameter_checked(cases, per_rank) -> None:
    for index, (engine, vp_size, *pp_size) in enumerate(cases):
        pp = pp_size[0] if pp_size else 2
        # Between them the stages hold every parameter of the whole model.
        reference = build_tiny_gpt(
            tiny_gpt_config(num_layers=pp * (vp_size or 1)),
            share_embeddings_and_output_weights=True,
        )
        checked = set().union(*(set(rank_result[index]) for rank_result in per_rank))
        assert checked == {n for n, _ in reference.named_parameters()}, engine


def test_two_stages_match_the_whole_model():
    _assert_every_parameter_checked(CASES, run_distributed(_run_cases, 2, CASES))


def test_two_stages_of_two_data_parallel_ranks_and_four_stages_match_the_whole_model():
    per_rank = run_distributed(_run_cases, 4, CASES_4_RANKS)
    _assert_every_parameter_checked(CASES_4_RANKS, per_rank)


def _with_and_without_overlap(engines: list[str]) -> None:
    """The interleaved schedule (PP 2, 2 virtual stages) with `overlap_p2p_comm` gives the
    losses and gradients it gives without, bit for bit."""
    for engine in engines:
        results = []
        for overlap in (False, True):
            outputs: dict[str, torch.Tensor] = {}
            try:
                _run_pipeline(engine, 4, 2, overlap_p2p_comm=overlap, outputs=outputs)
            finally:
                parallel_state.destroy_model_parallel()
            results.append(outputs)
        without, overlapped = results
        assert without.keys() == overlapped.keys() and len(without) > 1, engine
        for name, value in without.items():
            assert torch.equal(overlapped[name], value), f"{engine}: {name}"


def test_overlapped_transfers_give_the_same_results():
    run_distributed(_with_and_without_overlap, 2, ["ddp", "optim_grads_params"])
