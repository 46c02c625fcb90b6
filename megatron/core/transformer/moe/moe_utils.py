"""Helpers of the MoE layers: auxiliary-loss plumbing, the loss formulas and the expert-bias update.

- `MoEAuxLossAutoScaler` attaches an auxiliary loss to an activation: the loss takes part in
  backward (with the gradient the training schedule sets, the main loss's scale) without being
  added to the model output.
- `switch_load_balancing_loss_func` and `z_loss_func` are the Switch Transformer load-balancing
  loss and the ST-MoE router z-loss, as Megatron-core defines them.
- `update_expert_bias` is the step-end update of aux-loss-free balancing (DeepSeek-V3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on an activation that also backpropagates an auxiliary loss.

    Forward returns `output` unchanged; backward passes its gradient through and gives
    `aux_loss` the gradient `main_loss_backward_scale` (1 until the training schedule sets it
    with `set_loss_scale`), so the loss is optimised as if it were added to the main loss.
    """

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            return grad_output, torch.ones_like(aux_loss)
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Sets the gradient of every auxiliary loss of the next backward passes.

        Args:
            scale: the main loss's backward scale (grad-scaler scale / number of micro-batches,
                as the training schedule computes it); copied into the stored tensor when one
                exists, so the value can be set every step without reallocating.
        """
        current = MoEAuxLossAutoScaler.main_loss_backward_scale
        if current is None or current.device != scale.device:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().clone()
        else:
            current.copy_(scale)


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
) -> torch.Tensor:
    """Switch Transformer load-balancing loss, `coeff * E * sum_i f_i * P_i`.

    f_i = tokens_per_expert[i] / (T * topk) is the fraction of routed slots expert i got and
    P_i = sum_t probs[t, i] / T its mean routing probability, with T = `total_num_tokens`.

    Args:
        probs: [tokens, experts] scores over all experts (softmax, or normalised sigmoid).
        tokens_per_expert: [experts] routed-token counts.
        total_num_tokens: T.
        topk: experts per token.
        num_experts: E.
        moe_aux_loss_coeff: the loss weight.

    Returns:
        The scalar loss (weighted by the coefficient).
    """
    aggregated = probs.sum(dim=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(aggregated * tokens_per_expert) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """Router z-loss of ST-MoE: `coeff * mean_t logsumexp(logits[t])^2`.

    Args:
        logits: [tokens, experts] router logits.
        z_loss_coeff: the loss weight.
    """
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


def _routers_with_expert_bias(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        module
        for chunk in model_chunks
        for module in chunk.modules()
        if isinstance(module, TopKRouter) and module.expert_bias is not None
    ]


def update_expert_bias(
    model_chunks: list[torch.nn.Module], group: dist.ProcessGroup | None
) -> None:
    """Moves each router's expert bias toward balance and zeroes its token counts.

    The counts since the last update are summed over `group` and over the routers'
    tensor-parallel group, whose ranks route different parts of the sequence under sequence
    parallelism (every count of every router in one all-reduce per group); an expert with fewer
    tokens than the mean gets `+rate`, one with more `-rate`. Call it once per step, after the
    gradients are finalised and before the optimizer step, on every rank of both groups.

    Args:
        model_chunks: the model (chunks); routers without expert bias are skipped.
        group: the ranks whose tokens are counted together (the data-parallel x context group,
            without the tp ranks: the routers know their tp group); None means parallel_state's
            when initialised, else no reduction (one process).

    Raises:
        ValueError: the routers do not share one tp group.
    """
    routers = _routers_with_expert_bias(model_chunks)
    if not routers:
        return
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    tp_groups = {router.tp_group for router in routers}
    if len(tp_groups) > 1:
        raise ValueError(
            "update_expert_bias: the routers have different tensor-parallel groups; call it "
            "once per model, whose layers share one tp group."
        )
    with torch.no_grad():
        counts = torch.stack([router.local_tokens_per_expert for router in routers])
        for reduce_group in (group, *tp_groups):
            if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
                dist.all_reduce(counts, group=reduce_group)
        mean = counts.mean(dim=-1, keepdim=True)
        for router, offset in zip(routers, torch.sign(mean - counts)):
            router.expert_bias.add_(offset * router.config.moe_router_bias_update_rate)
            router.local_tokens_per_expert.zero_()
