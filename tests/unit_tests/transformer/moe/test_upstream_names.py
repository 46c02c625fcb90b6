"""Megatron-core 0.19.2's MoE state dicts (a stored fixture, made by
fixtures/make_moe_layer_fixture.py) load into `MoELayer`, whose experts are stacked, and give
upstream's outputs on upstream's inputs: in its SequentialMLP names and in TEGroupedMLP's, into
the loop and the grouped-GEMM experts, at expert-parallel size 1 and 2, and through
Megatron-FSDP's `load_state_dict`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.upstream_names import stack_upstream_experts
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed.moe_training import Engine, global_state, init_groups, wrap
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.upstream_parity import case_config

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "moe_layer_fixture.pt")


def _config(case: str, **overrides) -> TransformerConfig:
    return case_config(FIXTURE[case]["config"], **overrides)


def _layer(config: TransformerConfig) -> MoELayer:
    spec = get_moe_module_spec(moe_grouped_gemm=config.moe_grouped_gemm)
    return MoELayer(config, spec.submodules, layer_number=1)


def _te_grouped_names(state_dict: dict) -> dict:
    """`state_dict` as upstream's TEGroupedMLP names its experts: Transformer Engine's
    GroupedLinear holds expert i's `[out, in]` weight as `weight<i>` (and `bias<i>`); its
    `_extra_state` is left out (FP8 metadata this project does not read)."""
    renamed = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        if parts[:2] == ["experts", "local_experts"]:
            if parts[-1] != "_extra_state":
                renamed[f"experts.{parts[3]}.{parts[4]}{parts[2]}"] = value
        else:
            renamed[key] = value
    return renamed


def _output(layer: MoELayer, case: str) -> torch.Tensor:
    """The layer's output on the fixture's input, on the layer's device; returned on the CPU."""
    layer.eval()
    device = next(layer.parameters()).device
    with torch.no_grad():
        output, bias = layer(FIXTURE[case]["input"].to(device))
    assert bias is None
    return output.cpu()


@pytest.mark.parametrize("grouped_gemm", [False, True], ids=["loop", "grouped_gemm"])
@pytest.mark.parametrize("names", ["SequentialMLP", "TEGroupedMLP"])
@pytest.mark.parametrize("case", FIXTURE)
def test_upstream_state_dict_loads_and_gives_upstreams_output(case, names, grouped_gemm):
    upstream = FIXTURE[case]["state_dict"]
    torch.manual_seed(5)
    layer = _layer(_config(case, moe_grouped_gemm=grouped_gemm))
    before = _output(layer, case)
    given = upstream if names == "SequentialMLP" else _te_grouped_names(upstream)
    assert layer.load_state_dict(given) is not None  # strict: every key matched
    torch.testing.assert_close(_output(layer, case), FIXTURE[case]["output"])
    assert not torch.allclose(before, FIXTURE[case]["output"])
    # Stacked in expert order, the per-expert tensors as they were.
    saved = layer.state_dict()
    experts = FIXTURE[case]["config"]["num_moe_experts"]
    for name in ("linear_fc1.weight", "linear_fc2.weight"):
        expected = [upstream[f"experts.local_experts.{i}.{name}"] for i in range(experts)]
        assert torch.equal(saved[f"experts.{name}"], torch.stack(expected))
    assert not any("local_experts" in key for key in saved)
    # The user's dict is left as it was.
    assert "experts.local_experts.0.linear_fc1.weight" in upstream


def test_own_state_dict_still_loads():
    torch.manual_seed(1)
    source = _layer(_config("deepseek_v3"))
    torch.manual_seed(2)
    layer = _layer(_config("deepseek_v3"))
    layer.load_state_dict(source.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(layer.state_dict()[name], tensor), name


def _without(state_dict: dict, *keys: str) -> dict:
    return {key: value for key, value in state_dict.items() if key not in keys}


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda sd: _without(sd, "experts.local_experts.2.linear_fc1.weight"),
            r"experts \[2\] are missing",
        ),
        (
            lambda sd: {**sd, "experts.linear_fc1.weight": torch.zeros(8, 16, 16)},
            "holds 'experts.linear_fc1.weight' and the same experts",
        ),
        (
            lambda sd: {**sd, "experts.linear_fc2.weight0": torch.zeros(16, 8)},
            "both Megatron-core forms",
        ),
        (
            lambda sd: {
                key: value
                for key, value in sd.items()
                if not any(f"local_experts.{i}." in key for i in range(6, 8))
            },
            r"names 6 experts .* this layer holds 8 of its 8",
        ),
        (
            lambda sd: {**sd, "experts.local_experts.3.linear_fc2.weight": torch.zeros(16, 4)},
            "differ in shape",
        ),
    ],
    ids=["missing_expert", "both_names", "mixed_forms", "wrong_count", "shapes"],
)
def test_bad_upstream_state_dicts_are_refused_by_name(change, match):
    layer = _layer(_config("deepseek_v3"))
    with pytest.raises(ValueError, match=match):
        layer.load_state_dict(change(dict(FIXTURE["deepseek_v3"]["state_dict"])))


def test_extra_state_that_holds_something_is_not_dropped():
    """Only None `_extra_state` entries (Megatron-core's local linears') are dropped: one that
    holds Transformer Engine's FP8 state is reported as unexpected."""
    state_dict = dict(FIXTURE["deepseek_v3"]["state_dict"])
    state_dict["shared_experts.linear_fc1._extra_state"] = torch.ones(3)
    layer = _layer(_config("deepseek_v3"))
    with pytest.raises(RuntimeError, match="shared_experts.linear_fc1._extra_state"):
        layer.load_state_dict(state_dict)
    result = layer.load_state_dict(state_dict, strict=False)
    assert result.unexpected_keys == ["shared_experts.linear_fc1._extra_state"]


def test_stacking_a_model_state_dict_keeps_each_layers_experts_apart():
    """What Megatron-FSDP's load_state_dict and convert_checkpoint apply to a whole model."""
    upstream = FIXTURE["biases"]["state_dict"]
    model = {
        f"decoder.layers.{n}.mlp.{key}": value for n in (1, 3) for key, value in upstream.items()
    }
    model["decoder.layers.0.mlp.linear_fc1.weight"] = torch.ones(2, 2)
    stack_upstream_experts(model)
    for n in (1, 3):
        for name in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.bias"):
            stacked = model[f"decoder.layers.{n}.mlp.experts.{name}"]
            expected = [upstream[f"experts.local_experts.{i}.{name}"] for i in range(4)]
            assert torch.equal(stacked, torch.stack(expected))
    assert torch.equal(model["decoder.layers.0.mlp.linear_fc1.weight"], torch.ones(2, 2))
    assert not any("local_experts" in key for key in model)


def _loads_at_ep2(case: str) -> None:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        upstream = FIXTURE[case]["state_dict"]
        experts = FIXTURE[case]["config"]["num_moe_experts"]
        layer = _layer(_config(case, expert_model_parallel_size=2)).to(current_device())
        mine = range(layer.local_expert_indices[0], layer.local_expert_indices[-1] + 1)
        # All experts (a state dict made at EP 1): each rank takes its own.
        layer.load_state_dict(upstream)
        torch.testing.assert_close(_output(layer, case), FIXTURE[case]["output"])
        expected = torch.stack(
            [upstream[f"experts.local_experts.{i}.linear_fc1.weight"] for i in mine]
        )
        assert torch.equal(layer.state_dict()["experts.linear_fc1.weight"], expected)
        # This rank's experts under local indices (upstream's state_dict() on an EP 2 rank).
        local = {key: value for key, value in upstream.items() if "local_experts" not in key}
        for local_index, index in enumerate(mine):
            for key, value in upstream.items():
                prefix = f"experts.local_experts.{index}."
                if key.startswith(prefix):
                    local[f"experts.local_experts.{local_index}.{key[len(prefix) :]}"] = value
        torch.manual_seed(9)
        layer = _layer(_config(case, expert_model_parallel_size=2)).to(current_device())
        layer.load_state_dict(local)
        torch.testing.assert_close(_output(layer, case), FIXTURE[case]["output"])
        assert experts == 2 * len(mine)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", FIXTURE)
def test_upstream_state_dict_loads_at_expert_parallel_size_2(case):
    run_distributed(_loads_at_ep2, 2, case)


class _Holder(torch.nn.Module):
    """A model whose one unit is an MoE layer: `mlp.<the layer's names>`."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.mlp = layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden)[0]


def _loads_under_megatron_fsdp(case: str) -> None:
    init_groups(2)
    try:
        upstream = FIXTURE[case]["state_dict"]
        torch.manual_seed(4)
        layer = _layer(_config(case, expert_model_parallel_size=2)).to(current_device())
        model = wrap(_Holder(layer), Engine("fsdp", "optim_grads_params"), MoELayer)
        model.load_state_dict({f"mlp.{key}": value for key, value in upstream.items()})
        weights = {name: value.cpu() for name, value in global_state(model.state_dict()).items()}
        experts = FIXTURE[case]["config"]["num_moe_experts"]
        for name in ("linear_fc1.weight", "linear_fc2.weight"):
            expected = [upstream[f"experts.local_experts.{i}.{name}"] for i in range(experts)]
            assert torch.equal(weights[f"mlp.experts.{name}"], torch.stack(expected)), name
        assert torch.equal(weights["mlp.router.weight"], upstream["router.weight"])
        model.eval()
        with torch.no_grad():
            output = model(FIXTURE[case]["input"].to(current_device()))
        torch.testing.assert_close(output.cpu(), FIXTURE[case]["output"])
    finally:
        parallel_state.destroy_model_parallel()


def test_upstream_state_dict_loads_under_megatron_fsdp_at_expert_parallel_size_2():
    """ZeRO-3 takes whole tensors (all experts) in `load_state_dict`: the per-expert ones are
    stacked before each rank keeps its shard."""
    run_distributed(_loads_under_megatron_fsdp, 2, "deepseek_v3")
