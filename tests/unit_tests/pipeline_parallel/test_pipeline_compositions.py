"""Pipeline stages composed with the other parallelisms give the losses and full gradients of
one process running the whole model by plain autograd (fp32): PP 2 x TP 2 (with and without
sequence parallelism, under the DDP engine and Megatron-FSDP), PP 2 x EP 2 (a Mixture-of-Experts
GPT with its auxiliary losses, whose per-layer metrics every stage reports), PP 2 x CP 2,
multi-token prediction on the last stage (tied and learned-position embeddings copied from the
first stage; and with MoE layers), and FP8 (delayed scaling) at PP 2 x DP 2. 4 gloo ranks, every
case in one pool call; 4 microbatches through 1F1B.

The reference runs each microbatch's data-parallel parts one after the other (each part's mean
loss, and its auxiliary losses, over the parts), which is what the data-parallel ranks compute
together; under FP8 it runs the whole microbatch at once, as the ranks' reduced amaxes see it,
with the parts' gradient scale (dp times the whole mean's, divided out at the end: FP8 casts
the same values, its first backward unscaled). Each stage loads the
reference's weights by global name (the engines keep each rank's part of the global tensors).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.pipeline_parallel.tied_embeddings import (
    allreduce_tied_embedding_grads,
    broadcast_tied_embeddings,
)
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel.layout import full_tensor
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import tracked_metrics
from megatron.core.transformer.multi_token_prediction import get_mtp_loss_logging_helper
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    make_token_batches,
    tiny_gpt_config,
    wrap_for_engine,
)
from tests.unit_tests.models.test_gpt_moe import MOE

WORLD, PP, NUM_MICROBATCHES, MICRO_BATCH_SIZE = 4, 2, 4, 2
ZERO3 = "optim_grads_params"


@dataclasses.dataclass(frozen=True)
class Case:
    """One composition: the parallel sizes, the engine and the model.

    Attributes:
        name: what the case is, for failure messages.
        engine: "ddp" or a Megatron-FSDP sharding strategy.
        tp, cp, ep: the parallel sizes (the data-parallel size is what is left of a stage).
        sequence_parallel: with tp > 1.
        tied: share the embeddings with the output layer.
        position_embedding_type: "learned_absolute" or "rope".
        fields: further `TransformerConfig` fields (experts, depths, FP8).
    """

    name: str
    engine: str
    tp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    tied: bool = True
    position_embedding_type: str = "learned_absolute"
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dp(self) -> int:
        return WORLD // (PP * self.tp * self.cp)

    @property
    def moe(self) -> bool:
        return "num_moe_experts" in self.fields

    @property
    def fp8(self) -> bool:
        return "fp8" in self.fields

    @property
    def num_layers(self) -> int:
        return 4 if self.moe else 2

    def config(self, parallel: bool) -> TransformerConfig:
        """The model's config, with the parallel sizes (`parallel`) or without."""
        sizes = {}
        if parallel:
            sizes = dict(
                tensor_model_parallel_size=self.tp,
                sequence_parallel=self.sequence_parallel,
                context_parallel_size=self.cp,
                expert_model_parallel_size=self.ep,
                pipeline_model_parallel_size=PP,
            )
        return tiny_gpt_config(
            num_layers=self.num_layers, seq_length=SEQ_LENGTH, **sizes, **self.fields
        )


MTP = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.5)
MOE_Z_AND_AUX = dict(MOE, moe_router_load_balancing_type="aux_loss", moe_layer_freq=[0, 1, 1, 0])
FP8 = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2, ffn_hidden_size=64)

CASES = [
    Case("PP 2 x TP 2, sequence parallel, DDP", "ddp", tp=2, sequence_parallel=True),
    Case("PP 2 x TP 2, sequence parallel, ZeRO-3", ZERO3, tp=2, sequence_parallel=True),
    Case(
        "PP 2 x TP 2, ZeRO-3, untied, rope", ZERO3, tp=2, tied=False, position_embedding_type="rope"
    ),
    Case("PP 2 x TP 2, DDP, rope", "ddp", tp=2, position_embedding_type="rope"),
    Case("PP 2 x EP 2 x DP 2, MoE, ZeRO-3", ZERO3, ep=2, fields=MOE_Z_AND_AUX),
    Case("PP 2 x EP 2 x DP 2, MoE, DDP", "ddp", ep=2, tied=False, fields=MOE_Z_AND_AUX),
    Case("PP 2 x CP 2, ZeRO-3, rope", ZERO3, cp=2, position_embedding_type="rope"),
    Case("PP 2 x CP 2, DDP", "ddp", cp=2),
    Case("PP 2 x DP 2, MTP, tied, learned positions, DDP", "ddp", fields=MTP),
    Case(
        "PP 2 x EP 2 x DP 2, MTP of an MoE layer, untied, ZeRO-3",
        ZERO3,
        ep=2,
        tied=False,
        position_embedding_type="rope",
        fields=dict(MOE_Z_AND_AUX, **MTP),
    ),
    Case("PP 2 x DP 2, FP8, ZeRO-3", ZERO3, fields=FP8),
]


def _build(
    case: Case, parallel: bool, pre_process: bool = True, post_process: bool = True
) -> GPTModel:
    """The case's model: the whole one (`parallel` False), or this rank's stage."""
    config = case.config(parallel)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    # As pretrain_gpt.py asks for it: None but on the last stage (parallel_state's).
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=case.tied,
        position_embedding_type=case.position_embedding_type,
        mtp_block_spec=mtp_spec,
    )


def _parts(num_parts: int, tokens: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    """The micro-batch cut into `num_parts` (data-parallel) parts, with all-ones loss masks."""
    return [
        dict(tokens=part, labels=part_labels, loss_mask=torch.ones(part.shape))
        for part, part_labels in zip(tokens.chunk(num_parts), labels.chunk(num_parts))
    ]


def _metric_names(case: Case) -> list[str]:
    fields = case.config(False)
    return tracked_metrics(fields.moe_router_load_balancing_type, fields.moe_z_loss_coeff)


def _metrics(case: Case, num_forwards: int) -> tuple[dict, dict]:
    """The MoE layers' per-layer metrics and the depths' losses recorded since the last call,
    averaged over `num_forwards` forwards (and the data-parallel ranks)."""
    config = case.config(False)
    depths = config.mtp_num_layers or 0
    moe = {}
    if case.moe:
        layers = config.num_layers + depths
        num_moe = sum(config.moe_layer_freq) + depths * config.moe_layer_freq[-1]
        names = _metric_names(case)
        _, moe = get_moe_metrics_tracker().report(names, layers, num_moe, 1 / num_forwards)
    mtp = {}
    if depths:
        mtp = get_mtp_loss_logging_helper().report(depths, num_forwards)
    return moe, mtp


def _reference(case: Case, batches):
    """The whole model on one process: the losses of each microbatch's data-parallel parts
    (the whole microbatch's under FP8), the gradients of their mean, the metrics, the
    weights."""
    torch.manual_seed(1234)
    model = _build(case, parallel=False)
    parts = 1 if case.fp8 else case.dp
    share = 1.0 / (NUM_MICROBATCHES * parts)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(share))
    # FP8's first backward casts its gradients unscaled, where a part's mean has dp times the
    # whole microbatch mean's gradients: the backward carries those, divided out after.
    gradient_scale = case.dp if case.fp8 else 1
    losses = []
    for tokens, labels in batches:
        for part in _parts(parts, tokens, labels):
            output = model(part["tokens"], labels=part["labels"], loss_mask=part["loss_mask"])
            loss = output.float().mean()
            (loss * share * gradient_scale).backward()
            losses.append(loss.detach())
    grads = {name: p.grad / gradient_scale for name, p in model.named_parameters()}
    metrics = _metrics(case, NUM_MICROBATCHES * parts)
    return model, torch.stack(losses).view(NUM_MICROBATCHES, parts), grads, metrics


def _reference_name(name: str, model: GPTModel) -> str:
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match is not None:
        layer = model.decoder.layer_range[int(match.group(1))]
        return f"decoder.layers.{layer}.{match.group(2)}"
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of them
    return name


def _global_grad(chunk: torch.nn.Module, param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's reduced gradient as the global (unsplit) tensor."""
    if isinstance(chunk, DistributedDataParallel):
        grad = param.main_grad
        if chunk.view_of(param) is not None:
            grad = chunk.global_view(param, grad)
    else:
        grad = param.grad
    return full_tensor(grad) if isinstance(grad, DTensor) else grad


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])

    def loss_func(losses):
        mask = batch["loss_mask"]
        total = (losses.float() * mask).sum()
        count = mask.sum()
        return total, count, {"lm loss": torch.stack([total.detach(), count])}

    return output, loss_func


def _run_case(case: Case) -> list[str]:
    """Runs one iteration of `case` on this rank and checks it against the reference; returns
    the reference names of the parameters checked."""
    # The trackers are process-wide: what an earlier test on this worker recorded is not ours.
    destroy_moe_metrics_tracker()
    get_mtp_loss_logging_helper().clear()
    batches = make_token_batches(NUM_MICROBATCHES, MICRO_BATCH_SIZE * case.dp)
    reference, expected_losses, expected_grads, expected_metrics = _reference(case, batches)
    parallel_state.initialize_model_parallel(
        case.tp,
        pipeline_model_parallel_size=PP,
        context_parallel_size=case.cp,
        expert_model_parallel_size=case.ep,
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    model_parallel_cuda_manual_seed(
        1234, tp_rank=parallel_state.get_tensor_model_parallel_rank(), device_type="cpu"
    )
    model = _build(case, True, pre_process=stage == 0, post_process=stage == PP - 1)
    broadcast_tied_embeddings([model], parallel_state.get_embedding_group())
    chunk = wrap_for_engine(model, case.engine)
    # Every weight the reference's (each rank keeps its part).
    reference_state = reference.state_dict()
    state = {
        name: reference_state[_reference_name(name, model)]
        for name, value in model.state_dict().items()
        if isinstance(value, torch.Tensor)
    }
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    assert not unexpected and all(name.endswith("_extra_state") for name in missing), missing
    chunk.zero_grad_buffer()
    microbatches = [
        get_batch_on_this_cp_rank(_parts(case.dp, tokens, labels)[dp_rank])
        for tokens, labels in batches
    ]
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(case.cp / NUM_MICROBATCHES))
    loss_dicts, _ = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(microbatches),
        model=chunk,
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
        cp_group=parallel_state.get_context_parallel_group(),
    )
    chunk.finish_grad_sync()
    allreduce_tied_embedding_grads([chunk], parallel_state.get_embedding_group())

    if stage == PP - 1:
        # Each part's loss over its whole sequences (the sums and counts of the cp ranks').
        sums_and_counts = torch.stack([d["lm loss"] for d in loss_dicts])
        dist.all_reduce(sums_and_counts, group=parallel_state.get_context_parallel_group())
        losses = sums_and_counts[:, 0] / sums_and_counts[:, 1]
        if case.fp8:
            dist.all_reduce(losses, group=parallel_state.get_data_parallel_group())
            torch.testing.assert_close(losses / case.dp, expected_losses[:, 0])
        else:
            torch.testing.assert_close(losses, expected_losses[:, dp_rank])
    else:
        assert loss_dicts == []
    # Every stage reports every layer's metrics (gathered over the pipeline stages).
    moe, mtp = _metrics(case, NUM_MICROBATCHES)
    expected_moe, expected_mtp = expected_metrics
    for name, values in expected_moe.items():
        torch.testing.assert_close(torch.tensor(moe[name]), torch.tensor(values), msg=name)
    assert mtp.keys() == expected_mtp.keys()
    for name, value in expected_mtp.items():
        torch.testing.assert_close(torch.tensor(mtp[name]), torch.tensor(value), msg=name)
    checked = []
    for name, param in chunk.module.named_parameters():
        reference_name = _reference_name(name, model)
        grad = _global_grad(chunk, param)
        torch.testing.assert_close(grad, expected_grads[reference_name], msg=reference_name)
        checked.append(reference_name)
    return checked


def _run_cases(cases: list[Case]) -> list[list[str]]:
    checked = []
    for case in cases:
        try:
            checked.append(_run_case(case))
        except AssertionError as error:
            raise AssertionError(f"{case.name}: {error}") from error
        finally:
            parallel_state.destroy_model_parallel()
    return checked


def test_stages_compose_with_tensor_expert_and_context_parallelism_mtp_and_fp8():
    per_rank = run_distributed(_run_cases, WORLD, CASES)
    for index, case in enumerate(CASES):
        # Between them the stages hold (and checked) every parameter of the whole model.
        torch.manual_seed(1234)
        names = {name for name, _ in _build(case, parallel=False).named_parameters()}
        checked = set().union(*(set(rank_result[index]) for rank_result in per_rank))
        assert checked == names, case.name
