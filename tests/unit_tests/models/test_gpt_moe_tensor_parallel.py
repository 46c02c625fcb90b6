"""MoE layers under tensor + sequence parallelism with expert tensor parallelism 1 (set explicitly:
the default is the tp size) compute what the TP 1 model computes: on 4 gloo ranks (tp groups
[0, 1] [2, 3], ep groups in Megatron-core's expert order), a tiny MoE GPT at TP 2 + SP with EP 2
or EP 1 gives the per-token losses, the auxiliary and z-loss metrics, the full gradients (tp
parts gathered by their layouts, experts over ep) and the aux-loss-free expert-bias update of a
TP 1, EP 1 model built from the same seed on the same tokens. Also the config's refusals: MoE
with TP but without SP, 1 < ETP x EP < TP, and an MLP width not divisible by ETP.
(`test_gpt_moe_expert_tensor_parallel.py` covers ETP 2.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    model_parallel_cuda_manual_seed,
    named_tensor_parallel_layouts,
    shard_tensor,
)
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.moe.moe_utils import update_expert_bias
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import tiny_gpt_config
from tests.unit_tests.models.test_gpt_moe import MOE as GPT_MOE
from tests.unit_tests.models.test_gpt_tensor_parallel import _gather_full, _tp_group

WORLD = 4
TP = 2
VOCAB = 64
SEQ = 8
BATCH = 2

# 4 experts, top-2, SwiGLU, aux loss and z-loss; plus a gated shared expert.
MOE = dict(**GPT_MOE, moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)

VARIANTS = {
    # Softmax routing with the micro-batch load-balancing loss.
    "softmax_aux_loss": {},
    # Sigmoid routing with aux-loss-free balancing (the expert bias), the per-sequence
    # load-balancing loss and per-token loss scaling.
    "sigmoid_bias_seq_aux_loss": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss",
        calculate_per_token_loss=True,
    ),
}

FP8 = dict(
    fp8="hybrid",
    fp8_recipe="delayed",
    fp8_amax_history_len=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
)
"""FP8 (delayed scaling: every rank casts with the same scales; its first pass casts unscaled)
in every linear layer, experts and shared experts included; widths in multiples of 16 per
rank."""


def equal_part_amaxes(
    reference: torch.nn.Module,
    model: torch.nn.Module,
    local_of: Callable[[str, torch.Tensor], torch.Tensor],
) -> None:
    """Gives each FP8 weight (each expert's, for stacked ones) of `reference` its largest
    magnitude along its first row and column, and `model` its part of it (`local_of(name,
    full)`): every tensor-parallel part then holds the whole weight's maximum, so the parts,
    which FP8 scales each by its own amax (as upstream), are cast with the whole weight's scale,
    and the models compute alike."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in reference.named_parameters():
            if "linear_" not in name or not name.endswith(".weight"):
                continue
            peak = full.abs().amax(dim=(-2, -1), keepdim=True)
            full[..., 0, :] = peak[..., 0, :]
            full[..., :, 0] = peak[..., :, 0]
            params[name].copy_(local_of(name, full))


def _config(
    tp: int, ep: int, dispatcher: str, variant: str, fp8: bool = False
) -> TransformerConfig:
    fields = dict(
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_tensor_parallel_size=1,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
        seq_length=SEQ,
    )
    return tiny_gpt_config(**{**fields, **MOE, **VARIANTS[variant], **(FP8 if fp8 else {})})


def _build(config: TransformerConfig, pg_collection: ProcessGroupCollection | None) -> GPTModel:
    torch.manual_seed(1234)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, pg_collection=pg_collection
    )


def _ep_group(ep: int) -> dist.ProcessGroup | None:
    """This rank's group of `ep` consecutive ranks (Megatron-core's etp-ep-dp order with expert
    tensor parallelism 1); None for EP 1."""
    mine = None
    for start in range(0, WORLD, ep):
        group = dist.new_group(list(range(start, start + ep)))
        if start <= dist.get_rank() < start + ep:
            mine = group
    return mine if ep > 1 else None


def _step(model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
    """Per-token loss, MoE metrics and expert biases after one forward, backward and bias
    update."""
    destroy_moe_metrics_tracker()
    loss = model(tokens, labels=labels)
    loss.sum().backward()
    metrics = {name: values.clone() for name, values in get_moe_metrics_tracker().metrics.items()}
    update_expert_bias([model], group=None)
    biases = [
        layer.mlp.router.expert_bias
        for layer in model.decoder.layers
        if layer.mlp.router.expert_bias is not None
    ]
    return loss.detach(), metrics, biases


def check_step(
    reference: GPTModel, model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor
) -> None:
    """One `_step` of each model on the same tokens gives the same per-token losses, MoE
    metrics and expert biases."""
    expected_loss, expected_metrics, expected_biases = _step(reference, tokens, labels)
    loss, metrics, biases = _step(model, tokens, labels)
    torch.testing.assert_close(loss, expected_loss)
    assert metrics.keys() == expected_metrics.keys() and len(metrics) == 2
    for name, values in metrics.items():
        torch.testing.assert_close(values, expected_metrics[name], msg=name)
    assert len(biases) == len(expected_biases)
    for bias, expected in zip(biases, expected_biases):
        torch.testing.assert_close(bias, expected)
        assert expected.abs().sum() > 0  # the update moved the biases


def _global(name: str, tensor: torch.Tensor, layouts: dict, tp_group, ep_group) -> torch.Tensor:
    if name in layouts:
        return _gather_full(tensor, layouts[name], tp_group)
    if ".experts." in name and ep_group is not None:
        parts = [torch.empty_like(tensor) for _ in range(ep_group.size())]
        dist.all_gather(parts, tensor.contiguous(), group=ep_group)
        return torch.cat(parts)
    return tensor


def _local(name: str, full: torch.Tensor, layouts: dict, tp_group, ep_group) -> torch.Tensor:
    """This rank's part of the global tensor `full` (inverse of `_global`)."""
    if name in layouts:
        return shard_tensor(full, layouts[name], tp_group.rank(), tp_group.size())
    if ".experts." in name and ep_group is not None:
        return full.chunk(ep_group.size())[ep_group.rank()]
    return full


def _check_against_reference(ep: int, dispatcher: str, variant: str, fp8: bool = False) -> None:
    tp_group, ep_group = _tp_group(TP), _ep_group(ep)
    model_parallel_cuda_manual_seed(1234, tp_rank=tp_group.rank())
    # One batch per tp group (a data-parallel replica), the same on its two ranks.
    generator = torch.Generator().manual_seed(dist.get_rank() // TP)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)

    reference = _build(_config(1, 1, dispatcher, variant, fp8), None)
    model = _build(
        _config(TP, ep, dispatcher, variant, fp8), ProcessGroupCollection(tp=tp_group, ep=ep_group)
    )
    layouts = named_tensor_parallel_layouts(model)
    if fp8:
        equal_part_amaxes(
            reference, model, lambda name, full: _local(name, full, layouts, tp_group, ep_group)
        )
    check_step(reference, model, tokens, labels)

    assert any(".shared_experts.linear_fc1." in name for name in layouts)
    reference_params = dict(reference.named_parameters())
    assert reference_params.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        weight = _global(name, param.detach(), layouts, tp_group, ep_group)
        grad = _global(name, param.grad, layouts, tp_group, ep_group)
        torch.testing.assert_close(weight, reference_params[name].detach(), msg=name)
        torch.testing.assert_close(grad, reference_params[name].grad, msg=name)


@pytest.mark.parametrize(
    "ep, dispatcher, variant, fp8",
    [
        (2, "alltoall", "softmax_aux_loss", False),
        (2, "allgather", "sigmoid_bias_seq_aux_loss", False),
        (1, "alltoall", "softmax_aux_loss", False),
        (1, "allgather", "sigmoid_bias_seq_aux_loss", False),
        (1, "alltoall", "softmax_aux_loss", True),
    ],
)
def test_moe_gpt_under_tensor_and_sequence_parallelism_matches_tp1(ep, dispatcher, variant, fp8):
    """Also in FP8 at EP 1, where every tp rank holds the experts whole and their FP8 weight
    gradients are summed over tp."""
    run_distributed(_check_against_reference, WORLD, ep, dispatcher, variant, fp8)


TP4_SP = dict(tensor_model_parallel_size=4, sequence_parallel=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tensor_model_parallel_size=2), "need sequence_parallel=True"),
        (
            dict(**TP4_SP, expert_tensor_parallel_size=1, expert_model_parallel_size=2),
            "expert_tensor_parallel_size=1 x expert_model_parallel_size=2 with "
            "tensor_model_parallel_size=4 is not built",
        ),
        (
            dict(**TP4_SP, expert_tensor_parallel_size=2, expert_model_parallel_size=1),
            "expert_tensor_parallel_size=2 x expert_model_parallel_size=1 with "
            "tensor_model_parallel_size=4 is not built",
        ),
        (
            dict(expert_tensor_parallel_size=3),
            r"moe_ffn_hidden_size \(16\) must be divisible by expert_tensor_parallel_size \(3\)",
        ),
    ],
    ids=["no_sequence_parallel", "etp1_ep2_below_tp4", "etp2_ep1_below_tp4", "ffn_not_divisible"],
)
def test_unsupported_moe_tensor_parallel_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt_config(**MOE, **overrides)
