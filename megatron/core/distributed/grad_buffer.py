"""Contiguous gradient storage for the DDP engine, cut into buckets that are all-reduced whole.

Each parameter's `main_grad` is a view into one flat buffer per gradient dtype, so a bucket's
gradients are reduced by a single collective on a contiguous slice, and zeroing or scaling all
gradients is one kernel. With the distributed optimizer a bucket is reduce-scattered instead,
into its `BucketShards` (this rank's rows of each parameter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.bucket_shards import BucketShards


class GradBucket:
    """Parameters whose gradients are reduced together, backed by one contiguous slice.

    Args:
        params: the bucket's parameters, in the order their views lie in `data`.
        data: the flat gradient slice holding their `main_grad` views.
        group: the data-parallel process group to reduce over.
        average_in_collective: average with ReduceOp.AVG where the backend has it.
        check_for_nan_in_grad: raise before communicating a gradient with NaN/Inf.
        shards: reduce-scatter into these shards instead of all-reducing (the distributed
            optimizer); None to all-reduce.
        divisor: what the sum is divided by (None: the group's size; expert gradients, reduced
            over the expert data-parallel group: the dp x cp size).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        data: torch.Tensor,
        group: dist.ProcessGroup,
        average_in_collective: bool,
        check_for_nan_in_grad: bool,
        shards: BucketShards | None = None,
        divisor: int | None = None,
    ):
        self.params = tuple(params)
        self.data = data
        self.shards = shards
        self.group = group
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self._group_size = dist.get_world_size(group)
        self._divisor = divisor or self._group_size
        self._use_avg_op = average_in_collective and dist.get_backend(group) == "nccl"
        self._pending = set(self.params)
        self._work: dist.Work | None = None
        self._started = False

    @property
    def started(self) -> bool:
        """Whether the reduction has been launched since the last `reset()`."""
        return self._started

    @property
    def pending(self) -> tuple[torch.nn.Parameter, ...]:
        """Parameters whose gradient has not been marked ready since the last `reset()`."""
        return tuple(p for p in self.params if p in self._pending)

    def mark_ready(self, param: torch.nn.Parameter) -> bool:
        """Records that `param`'s gradient is final; returns True once all of them are."""
        if param not in self._pending:
            raise RuntimeError(
                "A parameter's gradient was synchronised twice since the last zero_grad_buffer(): "
                "run all but the last microbatch's backward under no_sync(), and call "
                "zero_grad_buffer() before each step."
            )
        self._pending.discard(param)
        return not self._pending

    def start_reduce(self, async_op: bool) -> None:
        """Launches the all-reduce, or the reduce-scatter into `shards` (returning immediately
        when `async_op`)."""
        if self._started:
            return
        if self.check_for_nan_in_grad and not torch.isfinite(self.data).all():
            raise RuntimeError(
                f"Rank {dist.get_rank()}: NaN or Inf found in a local gradient bucket before "
                "reduction (check_for_nan_in_grad=True). Check the loss, learning rate and data."
            )
        if self._use_avg_op:
            op = dist.ReduceOp.AVG
            if self._divisor != self._group_size:  # AVG divides by the group's size only
                self.data.mul_(self._group_size / self._divisor)
        else:
            # Dividing first keeps bf16/fp16 sums in range at large data-parallel sizes.
            if self._divisor != 1:  # 1: the gradients are summed (calculate_per_token_loss)
                self.data.mul_(1.0 / self._divisor)
            op = dist.ReduceOp.SUM
        if self.shards is not None:
            self._work = self.shards.start_reduce_scatter(op, async_op)
        else:
            self._work = dist.all_reduce(self.data, op=op, group=self.group, async_op=async_op)
        self._started = True

    def finish_reduce(self) -> None:
        """Starts the reduction if needed and waits for it."""
        self.start_reduce(async_op=False)
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self.shards is not None:
            self.shards.finish()

    def scale(self, factor: float | torch.Tensor) -> None:
        """Multiplies the bucket's gradients by `factor`: the reduced ones once its reduction
        was launched (waiting for it to end), else the local ones it will reduce."""
        if self._started:
            self.finish_reduce()
            if self.shards is not None:
                self.shards.scale(factor)
                return
        self.data.mul_(factor)

    def reset(self) -> None:
        """Prepares for the next step, first waiting for a reduction still in flight (it would
        otherwise keep writing into the buffer being zeroed)."""
        if self._work is not None:
            self._work.wait()
        if self.shards is not None:
            self.shards.finish()
        self._pending = set(self.params)
        self._work = None
        self._started = False


class GradBuffer:
    """One flat gradient buffer for parameters sharing a gradient dtype, split into buckets.

    Args:
        params: parameters in backward order (the order buckets should become ready).
        dtype: gradient accumulation and communication dtype.
        bucket_size: maximum elements per bucket (a parameter is never split); None for one
            bucket.
        group, average_in_collective, check_for_nan_in_grad, divisor: see `GradBucket`.
        shard_buckets: give each bucket `BucketShards` over `group` (the distributed optimizer).
        fp8_names: with `shard_buckets`, the parameters the shards gather in FP8
            (`fp8_param_gather`), with their names.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        dtype: torch.dtype,
        bucket_size: int | None,
        group: dist.ProcessGroup,
        average_in_collective: bool,
        check_for_nan_in_grad: bool,
        shard_buckets: bool = False,
        divisor: int | None = None,
        fp8_names: Mapping[torch.nn.Parameter, str] | None = None,
    ):
        numel = sum(p.numel() for p in params)
        self.dtype = dtype
        self.data = torch.zeros(numel, dtype=dtype, device=params[0].device)
        self.main_grads: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.buckets: list[GradBucket] = []

        def make_bucket(params: list[torch.nn.Parameter], data: torch.Tensor) -> GradBucket:
            shards = None
            if shard_buckets:
                fp8 = {p: fp8_names[p] for p in params if p in (fp8_names or {})}
                shards = BucketShards(params, [self.main_grads[p] for p in params], group, fp8)
            return GradBucket(
                params, data, group, average_in_collective, check_for_nan_in_grad, shards, divisor
            )

        bucket_params: list[torch.nn.Parameter] = []
        bucket_start = offset = 0
        for param in params:
            self.main_grads[param] = self.data[offset : offset + param.numel()].view(param.shape)
            bucket_params.append(param)
            offset += param.numel()
            if bucket_size is not None and offset - bucket_start >= bucket_size:
                self.buckets.append(make_bucket(bucket_params, self.data[bucket_start:offset]))
                bucket_params, bucket_start = [], offset
        if bucket_params:
            self.buckets.append(make_bucket(bucket_params, self.data[bucket_start:offset]))
