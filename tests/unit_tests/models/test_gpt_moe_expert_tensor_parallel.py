"""Expert tensor parallelism (ETP 2: each expert's weights split over the expt_tp group) in a tiny
MoE GPT computes what the TP 1 / ETP 1 / EP 1 model computes. On 4 gloo ranks whose groups come
from parallel_state (Megatron-core's orders: tp-dp for the dense part, etp-ep-dp for the
experts), at TP 2 + SP or TP 1 with EP 2 or EP 1 and either dispatcher: each rank's per-token
losses, MoE metrics and expert-bias update equal the reference's on its own batch (one batch per
data-parallel replica), the full weights (tp parts gathered by their layouts, expert parts over
expt_tp by theirs, then over ep) equal the reference's, and the full gradients, summed over the
data-parallel group (the expert data-parallel group for experts), equal the reference's summed
over the data-parallel group: both are the gradient of the sum of all replicas' losses; in FP8
too. Also the layer's refusals of expert groups that do not match the config."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    TensorParallelLayout,
    model_parallel_cuda_manual_seed,
    named_tensor_parallel_layouts,
    shard_tensor,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import tiny_gpt_config
from tests.unit_tests.models import test_gpt_moe_tensor_parallel as moe_tp
from tests.unit_tests.models.test_gpt_tensor_parallel import _gather_full

WORLD = moe_tp.WORLD
ETP = 2

# The TP test's variants, and one with biases in every linear layer (the experts' fc1 bias is
# split like its weight; the fc2 bias is replicated over expt_tp and added once). Shared experts
# have no biases, so that one has none.
VARIANTS = {
    **moe_tp.VARIANTS,
    "linear_bias": dict(
        add_bias_linear=True, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False
    ),
    # FP8 in every linear layer, experts and shared experts included.
    "fp8": moe_tp.FP8,
}


def _config(tp: int, etp: int, ep: int, dispatcher: str, variant: str) -> TransformerConfig:
    fields = dict(
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_tensor_parallel_size=etp,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
        seq_length=moe_tp.SEQ,
    )
    return tiny_gpt_config(**{**fields, **moe_tp.MOE, **VARIANTS[variant]})


def _full(name: str, tensor: torch.Tensor, layouts: dict) -> torch.Tensor:
    """The global tensor whose part this rank holds as `tensor` (parameter `name`)."""
    if ".experts." not in name:
        if name in layouts:
            return _gather_full(tensor, layouts[name], ps.get_tensor_model_parallel_group())
        return tensor
    if name in layouts:  # expert layouts are relative to expt_tp
        tensor = _gather_full(tensor, layouts[name], ps.get_expert_tensor_parallel_group())
    ep_group = ps.get_expert_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(ep_group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=ep_group)
    return torch.cat(parts)


def _local(name: str, full: torch.Tensor, layouts: dict) -> torch.Tensor:
    """This rank's part of the global tensor `full` of parameter `name` (inverse of `_full`)."""
    if ".experts." not in name:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        return shard_tensor(full, layouts.get(name), rank, size)
    full = full.chunk(ps.get_expert_model_parallel_world_size())
    mine = full[ps.get_expert_model_parallel_rank()]
    rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return shard_tensor(mine, layouts.get(name), rank, size)


def _set_biases(reference: torch.nn.Module, model: torch.nn.Module, layouts: dict) -> None:
    """Gives both models the same nonzero biases (they start at zero, where a bias counted
    twice would not show in the forward)."""
    generator = torch.Generator().manual_seed(5)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in reference.named_parameters():
            if name.endswith(".bias"):
                full.copy_(torch.randn(full.shape, generator=generator))
                params[name].copy_(_local(name, full, layouts))


def _summed(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total


def _check_expert_layouts(layouts: dict, config: TransformerConfig) -> None:
    experts = [name for name in layouts if ".experts." in name]
    stride = 2 if config.gated_linear_unit else 1
    expected = {"linear_fc1.weight": TensorParallelLayout(1, stride)}
    expected["linear_fc2.weight"] = TensorParallelLayout(2)
    if config.add_bias_linear:
        expected["linear_fc1.bias"] = TensorParallelLayout(1, stride)
    assert len(experts) == len(expected) * config.num_layers
    for name in experts:
        assert layouts[name] == expected[name.split(".experts.")[1]], name


def _check_against_reference(tp: int, ep: int, dispatcher: str, variant: str) -> None:
    # Built before the groups exist: TP 1, ETP 1, EP 1, every expert whole.
    reference = moe_tp._build(_config(1, 1, 1, dispatcher, variant), None)
    # The harness destroys these groups after the call.
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=ETP)
    model_parallel_cuda_manual_seed(1234)
    config = _config(tp, ETP, ep, dispatcher, variant)
    model = moe_tp._build(config, None)  # parallel_state's groups
    layouts = named_tensor_parallel_layouts(model)
    _set_biases(reference, model, layouts)
    if config.fp8:
        moe_tp.equal_part_amaxes(reference, model, lambda name, full: _local(name, full, layouts))
    generator = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    tokens = torch.randint(0, moe_tp.VOCAB, (moe_tp.BATCH, moe_tp.SEQ), generator=generator)
    labels = torch.randint(0, moe_tp.VOCAB, (moe_tp.BATCH, moe_tp.SEQ), generator=generator)
    moe_tp.check_step(reference, model, tokens, labels)

    _check_expert_layouts(layouts, config)
    reference_params = dict(reference.named_parameters())
    assert reference_params.keys() == dict(model.named_parameters()).keys()
    dp, expert_dp = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    for name, param in model.named_parameters():
        expected = reference_params[name]
        weight = _full(name, param.detach(), layouts)
        torch.testing.assert_close(weight, expected.detach(), msg=name)
        grad = _full(name, param.grad, layouts)
        grad = _summed(grad, expert_dp if ".experts." in name else dp)
        torch.testing.assert_close(grad, _summed(expected.grad, dp), msg=name)


@pytest.mark.parametrize(
    "tp, ep, dispatcher, variant",
    [
        (2, 2, "alltoall", "linear_bias"),
        (2, 2, "allgather", "sigmoid_bias_seq_aux_loss"),
        (2, 1, "alltoall", "softmax_aux_loss"),
        (2, 1, "allgather", "linear_bias"),
        (1, 2, "alltoall", "sigmoid_bias_seq_aux_loss"),
        (1, 2, "allgather", "linear_bias"),
        (1, 1, "alltoall", "linear_bias"),
        (1, 1, "allgather", "softmax_aux_loss"),
        (2, 2, "alltoall", "fp8"),
        (1, 1, "allgather", "fp8"),
    ],
)
def test_moe_gpt_with_expert_tensor_parallelism_matches_tp1(tp, ep, dispatcher, variant):
    run_distributed(_check_against_reference, WORLD, tp, ep, dispatcher, variant)


def _layer(config: TransformerConfig, pg_collection: ProcessGroupCollection) -> MoELayer:
    return MoELayer(config, get_moe_module_spec().submodules, pg_collection=pg_collection)


def _refusals() -> list[str]:
    """The layer's messages for expert groups that do not match the config (on every rank)."""
    rank = dist.get_rank()
    expt_tp = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]
    ep = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])][rank % 2]
    etp1 = _config(1, 1, 1, "alltoall", "softmax_aux_loss")
    etp2 = _config(1, ETP, 2, "alltoall", "softmax_aux_loss")
    # Strided expt_tp and contiguous ep: the whole world as tp_ep is then in ep-etp order.
    strided_etp = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])][rank % 2]
    contiguous_ep = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]
    world = dist.new_group(list(range(WORLD)))
    misordered = ProcessGroupCollection(expt_tp=strided_etp, ep=contiguous_ep, tp_ep=world)
    cases = [
        (etp1, ProcessGroupCollection(expt_tp=expt_tp), r"expert_tensor_parallel_size \(1\)"),
        (etp2, ProcessGroupCollection(expt_tp=expt_tp, ep=ep), "needs the tp_ep group"),
        (etp2, ProcessGroupCollection(expt_tp=expt_tp, ep=ep, tp_ep=ep), "tp_ep group has 2"),
    ]
    if rank in (1, 2):  # ranks 0 and 3 sit at the same place in both orders
        cases.append((etp2, misordered, "in etp-ep order"))
    messages = []
    for config, groups, match in cases:
        with pytest.raises(ValueError, match=match) as refused:
            _layer(config, groups)
        messages.append(str(refused.value))
    # parallel_state's groups never fill in what a collection lacks.
    ps.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=ETP)
    try:
        with pytest.raises(ValueError, match="needs the tp_ep group"):
            _layer(etp2, ProcessGroupCollection(expt_tp=expt_tp, ep=ep))
    finally:
        ps.destroy_model_parallel()
    return messages


def test_layer_refuses_expert_groups_that_do_not_match_the_config():
    for messages in run_distributed(_refusals, WORLD):
        assert "differs from the size of the expert tensor-parallel group (2)" in messages[0]
        assert "ProcessGroupCollection(tp_ep=...)" in messages[1]
        assert "make 4" in messages[2]


def test_layer_refuses_a_missing_expert_tensor_parallel_group():
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(2\) differs"):
        _layer(_config(1, ETP, 1, "alltoall", "softmax_aux_loss"), ProcessGroupCollection())
