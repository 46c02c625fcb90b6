"""Plain data parallelism with bucketed gradient all-reduce: the reference engine.

Every rank holds the whole model. Backward accumulates each parameter's gradient into
`param.main_grad`, a view of a contiguous per-dtype buffer (Megatron-LM's convention, read by its
optimizers); buckets of that buffer are all-reduced, either as soon as backward has finished every
gradient in them (`overlap_grad_reduce`) or all at once in `finish_grad_sync()`.

A training step::

    model.zero_grad_buffer()
    for i, batch in enumerate(microbatches):
        with model.no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext():
            loss_fn(model(batch)).backward()
    model.finish_grad_sync()
    optimizer.step()  # Megatron's optimizers read param.main_grad; any other reads param.grad

After `finish_grad_sync()` each parameter's `.grad` is its reduced gradient (a view of
`main_grad` where the dtypes match; where they do not, a copy in the parameter's dtype, made
only when an optimizer holding the parameter steps, through torch's global step hook), so a
stock torch optimizer over `module.parameters()` trains the model as Megatron's does. Torch's
semantics hold for it: a `.grad` dropped by `zero_grad()` starts afresh at the next backward,
one left in place accumulates.

With `use_distributed_optimizer` each bucket is reduce-scattered instead (`BucketShards`): only
this rank's rows of each parameter get their reduced gradient (`grad_shard()`), no `.grad` is
handed out, and `get_megatron_optimizer` builds a `DistributedOptimizer`, which steps those rows
(`param_shard()`) and calls `start_param_sync(force_sync=True)` to all-gather the parameters.
With `fp8_param_gather` too, the weights of linear layers that compute in FP8 are all-gathered as
FP8 bytes with one scale each, which those layers compute with (`fp8_param_gather.py`); only the
rank that steps a row of them holds its exact value, so `state_dict()` shows them as `Shard(0)`
DTensors of each rank's rows.

Expert parameters with groups of their own (split by expert or expert tensor parallelism,
`expert_parallel.py`) get buffers of their own, reduced (and sharded) over the expert
data-parallel group and divided by the dp x cp size; `state_dict()` shows them as global
DTensors `[num_experts, ...]` split over the ep and expt_tp groups (`global_view.py`).

Under tensor parallelism (`tensor_parallel_params.py`) the data-parallel group excludes the TP
peers, and every dense parameter is shown (`state_dict()`, `global_view()`, the distributed
optimizer's shards) as the global DTensor over a mesh whose first dimension is `tp`, placed as
the parameter's layout says (`Replicate` for the parameters not split).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from megatron.core.distributed.bucket_shards import BucketShards
from megatron.core.distributed.data_parallel_base import (
    _BaseDataParallel,
    resolve_data_parallel_group,
)
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.expert_parallel import (
    expert_groups,
    experts_are_dense,
    is_expert_param,
)
from megatron.core.distributed.fp8_param_gather import fp8_gathered_weights
from megatron.core.distributed.fsdp.collectives import Collectives
from megatron.core.distributed.fsdp.fp8_gather import Fp8Refresh
from megatron.core.distributed.global_view import GlobalView
from megatron.core.distributed.grad_buffer import GradBucket, GradBuffer
from megatron.core.distributed.tensor_parallel_params import (
    check_data_parallel_chunks,
    check_excludes_tp_peers,
    tensor_parallel_group,
)
from megatron.core.fp8.weights import forget_fp8_weights
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.grad_accumulation import FusionTarget, register_main_grad
from megatron.core.tensor_parallel.layout import (
    TensorParallelLayout,
    full_tensor,
    named_tensor_parallel_layouts,
)
from megatron.core.transformer.transformer_config import TransformerConfig

_wrapping_engine = WeakIdKeyDictionary()
"""Parameter -> weakref of the engine that owns its `main_grad` (to refuse double wrapping)."""

_step_hook: Any = None


def _before_any_step(optimizer: torch.optim.Optimizer, *unused: Any) -> None:
    """Gives the parameters an optimizer is about to step their reduced gradient as `.grad`
    where `finish_grad_sync()` could not hand out a view (another dtype)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None and (ref := _wrapping_engine.get(param)) is not None:
                if (engine := ref()) is not None:
                    engine._hand_out(param)


class DistributedDataParallel(_BaseDataParallel):
    """Wraps `module` for data-parallel training with a contiguous, bucketed gradient buffer.

    Args:
        config: the model's transformer config (its `gradient_accumulation_fusion` is read);
            None for a model without one.
        ddp_config: data-parallel switches (`use_megatron_fsdp` must be False).
        module: the model; every rank must hold identical weights (same seed, or call
            `broadcast_params()`).
        disable_bucketing: one bucket per gradient dtype whatever `bucket_size` says.
        pg_collection: process groups; gradients are averaged (summed under `sums_grads`) over
            `pg_collection.dp_cp`
            (default: parallel_state's data-parallel-with-context group, else the world);
            with `ep` or `expt_tp` of two or more ranks (other than the tp group), expert
            gradients are reduced over `expt_dp`; with `tp` (`expt_tp` for experts) of two or
            more ranks, parameters are split over it as the model's
            `named_tensor_parallel_layouts` say.

    Attributes:
        dense_view: the global DTensors of dense parameters under tensor parallelism (None: no
            tensor parallelism).
        expert_view: the expert data-parallel group and the global DTensors of expert
            parameters with groups of their own (None: experts are dense parameters).

    Raises:
        ValueError: the model has expert parameters with groups of their own and there is no
            `expt_dp` group; the data-parallel group holds tensor-parallel peers; with the
            distributed optimizer, a strided parameter's dim-0 chunk spans two of its blocks;
            `fp8_param_gather` without FP8 linear layers (`config.fp8`), or with fp32 ones.
    """

    def __init__(
        self,
        config: TransformerConfig | None,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config, module)
        if ddp_config.use_megatron_fsdp:
            raise ValueError(
                "DistributedDataParallel got ddp_config.use_megatron_fsdp=True: wrap the model "
                "with megatron.core.distributed.fsdp.FullyShardedDataParallel instead."
            )
        self.ddp_config = ddp_config
        self.data_parallel_group = resolve_data_parallel_group(pg_collection)
        dp_size = dist.get_world_size(self.data_parallel_group)
        divisor = 1 if self.sums_grads else dp_size
        if self.sums_grads and ddp_config.average_in_collective:
            raise ValueError(
                "average_in_collective=True averages the gradients, but calculate_per_token_loss "
                "sums them (the loop divides by the global token count): set "
                "average_in_collective=False (drop --ddp-average-in-collective)."
            )

        bucket_size = ddp_config.bucket_size
        if bucket_size is None and ddp_config.overlap_grad_reduce:
            # Larger groups need larger messages to stay bandwidth-bound (Megatron's default).
            bucket_size = max(40_000_000, 1_000_000 * dp_size)
        if disable_bucketing or not ddp_config.overlap_grad_reduce:
            bucket_size = None

        names = {param: name for name, param in module.named_parameters()}
        # Reverse registration order approximates the order backward produces gradients in.
        params = [p for p in reversed(names) if p.requires_grad]
        for param in params:
            owner = _wrapping_engine.get(param)
            if owner is not None and owner() is not None:
                raise ValueError(
                    f"Parameter {names[param]!r} is already wrapped by another "
                    "DistributedDataParallel; wrap the model once and reuse that wrapper."
                )
        experts = {p for p, name in names.items() if is_expert_param(name, p)}
        self.dense_view, self.expert_view = self._global_views(pg_collection, module, experts)
        self._experts = experts if self.expert_view is not None else set()
        by_kind: dict[tuple[torch.dtype, bool], list[torch.nn.Parameter]] = {}
        for param in params:
            by_kind.setdefault((self._grad_dtype(param), self.is_expert(param)), []).append(param)
        fp8_names = _fp8_gathered(config, module) if ddp_config.fp8_param_gather else {}
        self._fp8_gathered = frozenset(fp8_names)
        self.buffers = [
            GradBuffer(
                group_params,
                dtype,
                bucket_size,
                self.expert_view.dp if expert else self.data_parallel_group,
                ddp_config.average_in_collective,
                ddp_config.check_for_nan_in_grad,
                shard_buckets=ddp_config.use_distributed_optimizer,
                divisor=divisor,
                fp8_names=fp8_names,
            )
            for (dtype, expert), group_params in by_kind.items()
        ]
        self._collectives = Collectives()
        self._fp8_refresh = Fp8Refresh()
        self._dp_mesh: DeviceMesh | None = None
        if ddp_config.use_distributed_optimizer:
            group = self.data_parallel_group
            # The group's name in the dimension name: DTensor caches sharding decisions by
            # mesh, and meshes over destroyed groups with the same ranks compare equal otherwise.
            device_type = next(iter(names)).device.type
            self._dp_mesh = DeviceMesh.from_group(
                group, device_type, mesh_dim_names=(f"dp:{group.group_name}",)
            )
        self.buckets: list[GradBucket] = [b for buf in self.buffers for b in buf.buckets]
        self._bucket_of: dict[torch.nn.Parameter, GradBucket] = {
            param: bucket for bucket in self.buckets for param in bucket.params
        }
        self._param_names = names
        self._grad_sync_enabled = True
        # Parameters whose `.grad` was set to their reduced gradient, and whether the
        # gradients are reduced (from `finish_grad_sync()` to the next backward or zeroing).
        self._handed: set[torch.nn.Parameter] = set()
        self._synced = False
        global _step_hook
        if _step_hook is None:
            _step_hook = register_optimizer_step_pre_hook(_before_any_step)

        engine = weakref.ref(self)

        def accumulate_grad_hook(param: torch.nn.Parameter) -> None:
            # A weak back-edge: the parameters must not keep a deleted engine (and its
            # buffers) alive.
            ddp = engine()
            if ddp is not None:
                ddp._accumulate_grad(param)

        # A model without a TransformerConfig (config None) has no fusion switch: unfused.
        fuse = config is not None and config.gradient_accumulation_fusion
        for buffer in self.buffers:
            for param, main_grad in buffer.main_grads.items():
                # Megatron's optimizers and grad-norm code read `param.main_grad`.
                param.main_grad = main_grad
                param.register_post_accumulate_grad_hook(accumulate_grad_hook)
                _wrapping_engine[param] = engine
                if fuse:
                    register_main_grad(param, self._main_grad_to_fuse_into)

    def _global_views(
        self,
        pg_collection: ProcessGroupCollection | None,
        module: torch.nn.Module,
        experts: set[torch.nn.Parameter],
    ) -> tuple[GlobalView | None, GlobalView | None]:
        """(dense view, expert view): each None where its parameters are not split."""
        tp = tensor_parallel_group(pg_collection)
        groups = expert_groups(pg_collection)
        own_groups = bool(experts) and not experts_are_dense(groups.ep, groups.etp, tp)
        if own_groups and groups.expt_dp is None:
            raise ValueError(
                "The model's experts are split over an ep or expt_tp group of two or more "
                "ranks, but pg_collection has no expt_dp group to reduce their gradients over: "
                "pass ProcessGroupCollection.use_mpu_process_groups() or set expt_dp."
            )
        params = dict(module.named_parameters())
        layouts: dict[bool, dict[torch.nn.Parameter, TensorParallelLayout]] = {False: {}, True: {}}
        for name, layout in named_tensor_parallel_layouts(module).items():
            expert = own_groups and params[name] in experts
            if self.ddp_config.use_distributed_optimizer:
                dp = groups.expt_dp if expert else self.data_parallel_group
                check_data_parallel_chunks(name, params[name].shape, layout, [dp.size()])
            layouts[expert][params[name]] = layout
        device_type = next(iter(params.values())).device.type
        dense_view = expert_view = None
        if tp is not None:
            check_excludes_tp_peers(tp, self.data_parallel_group)
            dense_view = GlobalView(
                self.data_parallel_group, device_type, tp=tp, layouts=layouts[False]
            )
        if own_groups:
            check_excludes_tp_peers(groups.etp, groups.expt_dp)
            expert_view = GlobalView(
                groups.expt_dp, device_type, tp=groups.etp, layouts=layouts[True], ep=groups.ep
            )
        return dense_view, expert_view

    def view_of(self, param: torch.nn.Parameter) -> GlobalView | None:
        """The global view `param` is shown in, None where it is not split."""
        return self.expert_view if self.is_expert(param) else self.dense_view

    def global_view(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (shaped like `param`: its gradient, master or itself) as the global DTensor
        where `param` is split by expert or tensor parallelism; else as it is."""
        view = self.view_of(param)
        return tensor if view is None else view.replicated(tensor, param)

    def is_expert(self, param: torch.nn.Parameter) -> bool:
        """Whether `param` is an expert parameter with groups of its own."""
        return param in self._experts

    def _grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param.dtype

    def _accumulate_grad(self, param: torch.nn.Parameter) -> None:
        """Moves the fresh gradient into `main_grad`; launches the bucket once it is complete.

        Where `.grad` still is the view `finish_grad_sync()` handed out, autograd accumulated
        into `main_grad` itself; where it is None, gradient-accumulation fusion did. Where it
        was handed out and then replaced (dropped by `zero_grad()`, or a copy autograd
        accumulated into), it holds the whole gradient.
        """
        self._synced = False
        bucket = self._bucket_of[param]
        if bucket.started and not self.ddp_config.overlap_grad_reduce:
            self._reopen(bucket)
        grad = param.grad
        # None: a linear layer added the whole gradient to `main_grad` itself (fusion).
        if grad is not None and grad is not param.main_grad:
            if param in self._handed:
                self._handed.discard(param)
                param.main_grad.copy_(grad)
            else:
                param.main_grad.add_(grad)
            param.grad = None
        if self._grad_sync_enabled and self.ddp_config.overlap_grad_reduce:
            if bucket.mark_ready(param):
                bucket.start_reduce(async_op=True)

    def _reopen(self, bucket: GradBucket) -> None:
        """A gradient arrived at a bucket reduced since the last `zero_grad_buffer()` (a loop
        of torch's shape: backward, step, backward...): the next `finish_grad_sync()` reduces
        it again, the reduced gradients (equal on every rank, so unchanged by the average) plus
        the new ones, as torch's accumulation into `.grad` would.

        Raises:
            RuntimeError: with the distributed optimizer, whose reduce-scatter leaves the
                buffer holding no reduced gradients to add to; or when the reductions sum
                (`sums_grads`), which would count the reduced gradients once per rank.
        """
        if self.ddp_config.use_distributed_optimizer or self.sums_grads:
            why = (
                "calculate_per_token_loss (summed gradients)"
                if self.sums_grads
                else "use_distributed_optimizer=True"
            )
            raise RuntimeError(
                f"A gradient arrived after finish_grad_sync() reduced its bucket, with {why}: "
                "call zero_grad_buffer() before each step."
            )
        bucket.reset()

    def _main_grad_to_fuse_into(self, param: torch.nn.Parameter) -> FusionTarget:
        """`param`'s `main_grad`, for a linear layer about to add or write its weight gradient.

        Gradient-accumulation fusion asks while `param.grad` is None; where that is a `.grad`
        handed out and dropped since, `main_grad` starts afresh (overwritten), as in
        `_accumulate_grad`.
        """
        fresh = param in self._handed
        self._handed.discard(param)
        return FusionTarget(param.main_grad, overwrite=fresh)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into `main_grad` (gradient accumulation)."""
        previous = self._grad_sync_enabled
        self._grad_sync_enabled = False
        try:
            yield
        finally:
            self._grad_sync_enabled = previous

    def zero_grad_buffer(self) -> None:
        """Zeroes every `main_grad` before the first microbatch of a step (once the reductions
        still in flight, from a step abandoned midway, have ended)."""
        for bucket in self.buckets:
            bucket.reset()
        for buffer in self.buffers:
            buffer.data.zero_()
        for param in self._bucket_of:
            param.grad = None
        self._handed.clear()
        self._synced = False

    def start_grad_sync(self, *unused: Any) -> None:
        """Launches the all-reduce of every bucket not launched yet (asynchronously when
        `overlap_grad_reduce`)."""
        for bucket in self.buckets:
            bucket.start_reduce(async_op=self.ddp_config.overlap_grad_reduce)

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Waits until every gradient is reduced over the data-parallel group (averaged, or
        summed under `sums_grads`).

        Raises:
            RuntimeError: with `overlap_grad_reduce`, some parameters got no gradient in the
                synchronised backward. Their buckets never launched, and launching them here
                could pair different buckets across ranks.
        """
        if self.ddp_config.overlap_grad_reduce:
            unlaunched = [b for b in self.buckets if not b.started]
            missing = [self._param_names[p] for b in unlaunched for p in b.pending]
            if missing:
                raise RuntimeError(
                    f"overlap_grad_reduce=True, but {len(missing)} parameter(s) got no gradient "
                    f"in the backward outside no_sync(): {missing[:8]}. Every trainable "
                    "parameter must take part in the loss on every rank: set requires_grad=False "
                    "on unused ones, or use overlap_grad_reduce=False."
                )
        for bucket in self.buckets:
            bucket.finish_reduce()
        # Sharded, the whole reduced gradients exist nowhere: there is no `.grad` to hand out.
        if not self.ddp_config.use_distributed_optimizer:
            self._hand_out_grads()

    @torch.no_grad()
    def _hand_out_grads(self) -> None:
        """Sets each parameter's `.grad` to a view of its reduced gradient where the dtypes
        match (other parameters get a copy when an optimizer steps them). A `.grad` dropped
        since it was handed out, with no gradient since, stays None (as in torch), and its
        stale `main_grad` is cleared."""
        self._synced = True
        for param in self._bucket_of:
            if param in self._handed and param.grad is None:
                self._handed.discard(param)
                param.main_grad.zero_()
            elif param.main_grad.dtype == param.dtype:
                param.grad = param.main_grad
                self._handed.add(param)

    @torch.no_grad()
    def _hand_out(self, param: torch.nn.Parameter) -> None:
        """`param`'s reduced gradient as its `.grad`, in its dtype, once reduced and unless a
        `zero_grad()` dropped it since it was handed out."""
        if self._synced and param not in self._handed:
            param.grad = param.main_grad.to(param.dtype)
            self._handed.add(param)

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiplies every gradient by `scaling_factor`, before or after `finish_grad_sync()`
        (each bucket's reduced gradients once its reduction was launched: with the distributed
        optimizer its gradient shards, all the optimizer reads; else its local ones)."""
        for bucket in self.buckets:
            bucket.scale(scaling_factor)

    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """With the distributed optimizer and `force_sync`, all-gathers every parameter from
        the rows each rank updated (`param_shard()`); the optimizer calls it after its step.
        Otherwise nothing to do: every rank holds whole parameters between steps.
        `force_sync` also drops the parameters' FP8 copies (`megatron.core.fp8.weights`): the
        parameters may have been written where no version counter saw it (a replayed CUDA
        graph's optimizer step). With `fp8_param_gather` the FP8 weights are gathered as FP8
        bytes, scaled by the amaxes of all of them, reduced in one MAX all-reduce per
        data-parallel group; their parameters get the dequantised FP8 values on the rows other
        ranks own (`fp8_param_gather.py`)."""
        if not force_sync:
            return
        forget_fp8_weights(self.module.parameters())
        if self.ddp_config.use_distributed_optimizer:
            fp8 = [weights for b in self.buckets for weights in b.shards.start_fp8_refresh()]
            if fp8:
                self._fp8_refresh(fp8, self._collectives)
            for bucket in self.buckets:
                bucket.shards.all_gather_params(self._collectives)

    def _shards_of(self, param: torch.nn.Parameter) -> BucketShards:
        bucket = self._bucket_of[param]
        if bucket.shards is None:
            raise RuntimeError(
                "Parameter shards exist with use_distributed_optimizer=True only "
                "(--use-distributed-optimizer)."
            )
        return bucket.shards

    def param_shard(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's rows of `param` (a view; dim-0 chunk `rank` of N, possibly empty): what
        the distributed optimizer updates, and `start_param_sync` gathers from."""
        return self._shards_of(param).param_shards[param]

    def sharded_view(self, param: torch.nn.Parameter, rows: torch.Tensor) -> DTensor:
        """`rows`, this rank's dim-0 chunk over the data-parallel group of a tensor shaped like
        `param` (`param_shard(param)`, or the distributed optimizer's main shard, gradient or
        state of it), as the global `Shard(0)` DTensor (over (tp, dp) under tensor
        parallelism, (ep, expt_dp) for experts split by expert parallelism)."""
        view = self.view_of(param)
        if view is not None:
            return view.sharded(rows, param)
        if self._dp_mesh is None:
            raise RuntimeError(
                "Parameter shards exist with use_distributed_optimizer=True only "
                "(--use-distributed-optimizer)."
            )
        return DTensor.from_local(
            rows,
            self._dp_mesh,
            (Shard(0),),
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def grad_shard(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The reduced gradient of `param_shard(param)`, after `finish_grad_sync()`."""
        return self._shards_of(param).grads[param]

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copies every parameter from the first rank of the data-parallel group (expert
        parameters: of the expert data-parallel group, the ranks holding the same experts)."""
        for param in self.module.parameters():
            group = self.data_parallel_group
            if self.is_expert(param):
                group = self.expert_view.dp
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
        # Written through `.data`, which bumps no version counter: FP8 copies cannot tell.
        forget_fp8_weights(self.module.parameters())
        for bucket in self.buckets:
            for gather in bucket.shards.fp8_gathers if bucket.shards is not None else ():
                gather.forget()

    def state_dict(
        self, prefix: str = "", keep_vars: bool = False, destination: dict | None = None
    ) -> dict[str, Any]:
        """The wrapped module's state dict; parameters split by expert or tensor parallelism
        as global DTensors (`global_view()`: views of this rank's part), so that a checkpoint
        holds every element once and loads at other ep and tp sizes. With `fp8_param_gather`,
        the weights gathered in FP8 as `Shard(0)` DTensors of this rank's rows
        (`sharded_view(param, param_shard(param))`): only the rank that steps a row holds its
        exact value, the others its FP8 one, so the state dict and a checkpoint hold the
        weights of a run without the option."""
        state = super().state_dict(prefix, keep_vars, destination)
        for name, param in self.module.named_parameters():
            key = prefix + name
            if key not in state:
                continue
            if param in self._fp8_gathered:
                state[key] = self.sharded_view(param, self.param_shard(param))
            elif self.view_of(param) is not None:
                state[key] = self.global_view(param, state[key])
        return state

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Loads a state dict of `state_dict()`'s form; the value of a parameter split by
        expert or tensor parallelism may also be the whole global tensor (this rank keeps its
        part). DTensors other than the replicated views are gathered whole first (a collective:
        every rank loads), so a weight of `fp8_param_gather` gets its exact value on every
        row."""
        local = dict(state_dict)
        for name, param in self.module.named_parameters():
            value = local.get(name)
            if value is None:
                continue
            view = self.view_of(param)
            if view is not None:
                local[name] = view.local_value(value, param)
            elif isinstance(value, DTensor):
                local[name] = full_tensor(value)
        return self.module.load_state_dict(local, strict=strict)


def _fp8_gathered(
    config: TransformerConfig | None, module: torch.nn.Module
) -> dict[torch.nn.Parameter, str]:
    """The parameters `fp8_param_gather` gathers in FP8, with their names.

    Raises:
        ValueError: the model has no FP8 linear layers, or their weights are fp32.
    """
    if config is None or not config.fp8:
        raise ValueError(
            "ddp_config.fp8_param_gather (--fp8-param-gather) gathers the weights of FP8 "
            "linear layers, and this model has none: set config.fp8 (--fp8-format), or drop "
            "fp8_param_gather."
        )
    names = fp8_gathered_weights(module)
    fp32 = [name for param, name in names.items() if param.dtype == torch.float32]
    if fp32:
        raise ValueError(
            f"ddp_config.fp8_param_gather (--fp8-param-gather) with the distributed optimizer "
            f"needs bf16 or fp16 weights, and {fp32[0]} is fp32: fp32 parameters are the "
            "optimizer's main weights themselves, whose rows of the other ranks the FP8 "
            "all-gather would replace by their FP8 values. Train with --bf16 (params_dtype="
            "torch.bfloat16), or drop fp8_param_gather."
        )
    return names
