"""Ring attention (`cp_comm_type="p2p"`): causal attention over a sequence split across the
context-parallel (cp) ranks, keys and values passed around the ring of ranks.

Each of the N ranks holds its two chunks of the sequence (`sequence_split`): queries, keys and
values of chunks i and 2N-1-i. At step t rank i attends with its queries to the keys and values
of rank (i - t) mod N, received from rank i - 1 while the previous step ran, and sends them on
to rank i + 1; the partial results are merged with their log-sum-exp (`partial_attention`).
With the load-balanced chunks every step does the same work and the causal mask never cuts a
block of the exchanged chunks (rank i, source rank j):

- step 0 (j = i): the rank's own two chunks, causally (the kernel's `is_causal`);
- j < i: every query sees the first chunk of j (chunk j < i) and none of its second one
  (chunk 2N-1-j > 2N-1-i): all queries over half the keys;
- j > i: the first query chunk (chunk i < j) sees nothing of j, the second one sees both of
  j's chunks: half the queries over all the keys.

Backward runs the ring again: the keys and values travel as in forward, and with them the
gradient of the keys and values of their owner, to which each rank adds its blocks' part; after
N steps the gradient is sent once more, home. Gradients accumulate in fp32.

On CUDA the exchanges are NCCL point-to-point operations, which run on the communicator's own
stream: the transfer of the next step's keys and values overlaps the current step's attention
on the compute stream, and the compute stream waits for a transfer (`Work.wait`, no host
synchronisation) only where it reads what it received.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from megatron.core.context_parallel.partial_attention import BlockAttention

_KV_TAG, _GRAD_TAG = 0, 1
"""Tags of the two exchanges of a backward step (gloo matches messages by tag)."""


class _PendingExchange:
    """A ring step's send and receive in flight; `wait()` returns what was received."""

    def __init__(self, works: list[dist.Work], sent: torch.Tensor, received: torch.Tensor):
        self._works = works
        # Held until the send completes: the communicator reads it after this step returns.
        self._sent = sent
        self._received = received

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None
        return self._received


class Ring:
    """The cp group seen as a ring: each rank sends to the next and receives from the
    previous one.

    Args:
        group: The cp group.

    Raises:
        ValueError: a group of one rank (no ring: attention needs no exchange).
    """

    def __init__(self, group: dist.ProcessGroup):
        if group.size() < 2:
            raise ValueError("Ring needs a cp group of at least 2 ranks.")
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, tensor: torch.Tensor, tag: int = _KV_TAG) -> _PendingExchange:
        """Starts sending `tensor` (contiguous) to the next rank and receiving the previous
        rank's tensor of the same shape into a new buffer."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self._next, self.group, tag),
            dist.P2POp(dist.irecv, received, self._prev, self.group, tag),
        ]
        return _PendingExchange(dist.batch_isend_irecv(ops), tensor, received)


def _pack(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Keys and values in one contiguous buffer (one message per step)."""
    return torch.cat([key.reshape(-1), value.reshape(-1)])


def _unpack(
    buffer: torch.Tensor, key_shape: torch.Size, value_shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    split = key_shape.numel()
    return buffer[:split].view(key_shape), buffer[split:].view(value_shape)


class RingBlock(enum.Enum):
    """The block a rank computes at a ring step (see the module's description)."""

    DIAGONAL = "its own chunks, causally"
    FIRST_KEYS = "all its queries over the first key chunk"
    LAST_QUERIES = "its second query chunk over all the keys"

    @classmethod
    def at(cls, step: int, rank: int) -> RingBlock:
        """The block of ring step `step` on cp rank `rank`."""
        if step == 0:
            return cls.DIAGONAL
        return cls.FIRST_KEYS if step <= rank else cls.LAST_QUERIES

    def rows(self, half: int) -> slice:
        """The query positions (of a rank's 2 x `half`) the block computes."""
        return slice(half, None) if self is RingBlock.LAST_QUERIES else slice(None)

    def keys(self, half: int) -> slice:
        """The key positions (of the 2 x `half` received) the block reads."""
        return slice(None, half) if self is RingBlock.FIRST_KEYS else slice(None)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        block: BlockAttention,
        ring: Ring,
    ) -> torch.Tensor:
        half = query.shape[2] // 2
        kv = _pack(key, value)
        out = query.new_empty((*query.shape[:3], value.shape[-1]), dtype=torch.float32)
        lse = query.new_empty(query.shape[:3], dtype=torch.float32)
        saved = []
        for step in range(ring.size):
            pending = ring.exchange(kv) if step + 1 < ring.size else None
            step_key, step_value = _unpack(kv, key.shape, value.shape)
            kind = RingBlock.at(step, ring.rank)
            rows, keys = kind.rows(half), kind.keys(half)
            # Step 0's diagonal block covers every row: it starts the running result.
            saved.append(
                block.forward_rows(
                    out,
                    lse,
                    rows,
                    query,
                    step_key[:, :, keys],
                    step_value[:, :, keys],
                    causal=kind is RingBlock.DIAGONAL,
                    first=step == 0,
                )
            )
            if pending is not None:
                kv = pending.wait()
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.block, ctx.ring, ctx.saved = block, ring, saved
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        block, ring = ctx.block, ctx.ring
        half = query.shape[2] // 2
        grad_query = torch.zeros_like(query, dtype=torch.float32)
        kv = _pack(key, value)
        grad_kv = pending_grad = None
        for step in range(ring.size):
            pending = ring.exchange(kv) if step + 1 < ring.size else None
            step_key, step_value = _unpack(kv, key.shape, value.shape)
            kind = RingBlock.at(step, ring.rank)
            rows, keys = kind.rows(half), kind.keys(half)
            dq, dk, dv = block.backward_rows(
                rows,
                grad_out,
                query,
                step_key[:, :, keys],
                step_value[:, :, keys],
                out,
                lse,
                kind is RingBlock.DIAGONAL,
                ctx.saved[step],
            )
            grad_query[:, :, rows] += dq
            # The gradient of the keys and values held this step: started by their owner at
            # step 0, received from the previous rank after.
            if step == 0:
                grad_kv = torch.zeros_like(kv, dtype=torch.float32)
            else:
                grad_kv = pending_grad.wait()
            grad_key, grad_value = _unpack(grad_kv, key.shape, value.shape)
            grad_key[:, :, keys] += dk
            grad_value[:, :, keys] += dv
            pending_grad = ring.exchange(grad_kv, _GRAD_TAG)
            if pending is not None:
                kv = pending.wait()
        # After N steps the gradient of this rank's own keys and values has come home.
        grad_key, grad_value = _unpack(pending_grad.wait(), key.shape, value.shape)
        return (
            grad_query.to(query.dtype),
            grad_key.to(key.dtype),
            grad_value.to(value.dtype),
            None,
            None,
        )


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: BlockAttention,
    ring: Ring,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    Args:
        query: [b, n, s, d] this rank's two chunks (`sequence_split`).
        key: [b, g, s, d], g dividing n.
        value: [b, g, s, dv].
        block: The block kernel and scale.
        ring: The cp group's ring.

    Returns:
        [b, n, s, dv] in the query's dtype.
    """
    return _RingAttention.apply(query, key, value, block, ring)
