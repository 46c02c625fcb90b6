"""Point-to-point transfers between pipeline stages: one batched exchange at a time.

A stage's activations ([s, b, h], known in advance from the sequence length, the micro-batch
size and the hidden size, so no shape is ever exchanged) go to the next stage, and their
gradients come back. `P2PCommunicator.exchange` issues every send and receive of one exchange
together with `torch.distributed.batch_isend_irecv` over the pipeline group (one NCCL group
call on GPU) and waits for them, as Megatron-LM's `P2PCommunicator` does with `batch_p2p_comm`.
`P2PCommunicator.post` issues them the same way but leaves the waiting to the caller
(`PendingExchange`), so the transfers run while the caller computes (`overlap_p2p_comm`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.schedule_order import Transfer


class PendingExchange:
    """The operations of one issued exchange, and the tensors it receives into.

    Attributes:
        received: the receive buffers, in the order of the receives; read one only after
            `wait_for(its index)` or `wait()`.
    """

    def __init__(
        self,
        requests: list,
        received: list[torch.Tensor],
        sent: list[torch.Tensor],
        receive_positions: list[int],
    ):
        self._requests = requests
        self.received = received
        # The tensors being sent stay referenced until their sends complete.
        self._sent = sent
        # A backend that coalesces the batch (NCCL) returns one request for all operations;
        # one that does not (gloo) one per operation, each receive's own.
        self._own_request = len(requests) == len(sent) + len(received)
        self._receive_positions = receive_positions

    def wait_for(self, index: int) -> None:
        """Waits until receive `index` completed (where the backend tells the operations
        apart; else until the whole exchange did)."""
        if self._own_request:
            self._wait(self._receive_positions[index])
        else:
            self.wait()

    def take(self, index: int) -> torch.Tensor:
        """Receive `index`'s tensor once it arrived (`wait_for`); the exchange lets go of it,
        so that it lives no longer than its reader keeps it."""
        self.wait_for(index)
        tensor, self.received[index] = self.received[index], None
        return tensor

    def poll(self) -> bool:
        """Whether every operation completed, asked without blocking; then the sent tensors
        are let go."""
        for position, request in enumerate(self._requests):
            if request is not None and request.is_completed():
                self._requests[position] = None
        done = all(request is None for request in self._requests)
        if done:
            self._sent = []
        return done

    def wait(self) -> None:
        """Waits until every operation of the exchange completed (on GPU: until the current
        stream waits for them)."""
        for position in range(len(self._requests)):
            self._wait(position)
        self._sent = []

    def _wait(self, position: int) -> None:
        # Each request once: a second wait on gloo's would wait for another message.
        request = self._requests[position]
        if request is not None:
            request.wait()
            self._requests[position] = None


class P2PCommunicator:
    """Sends and receives stage boundary tensors over the pipeline group.

    Args:
        pp_group: the pipeline-parallel group (ranks in stage order).
        tensor_shape: the shape of every boundary tensor, [s, b, h] (s divided by the
            context- and, under sequence parallelism, the tensor-parallel size).
        dtype: their dtype (the model's compute dtype, Megatron-LM's `pipeline_dtype`).
        device: where received tensors are allocated.
    """

    def __init__(
        self,
        pp_group: dist.ProcessGroup,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.pp_group = pp_group
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device
        self._global_ranks = dist.get_process_group_ranks(pp_group)

    @property
    def rank(self) -> int:
        """This rank's stage."""
        return self.pp_group.rank()

    @property
    def size(self) -> int:
        """The number of stages."""
        return self.pp_group.size()

    def exchange(
        self, transfers: Iterable[tuple[Transfer, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        """Runs one exchange and returns the received tensors, in the order of the receives.

        Args:
            transfers: each transfer with the tensor to send (None for a receive).

        Raises:
            ValueError: a tensor to send does not have the boundary shape or dtype (the model
                chunk returned something other than its [s, b, h] hidden states).
        """
        exchange = self.post(transfers)
        exchange.wait()
        return exchange.received

    def post(self, transfers: Iterable[tuple[Transfer, torch.Tensor | None]]) -> PendingExchange:
        """Issues one exchange, as `exchange` does, without waiting for it.

        Args:
            transfers: each transfer with the tensor to send (None for a receive).

        Raises:
            ValueError: as `exchange`.
        """
        operations, received, sent, positions = [], [], [], []
        for transfer, tensor in transfers:
            peer = self._global_ranks[transfer.peer]
            if transfer.send:
                self._check(tensor, transfer)
                sent.append(tensor.contiguous())
                operations.append(dist.P2POp(dist.isend, sent[-1], peer, self.pp_group))
            else:
                buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
                positions.append(len(operations))
                operations.append(dist.P2POp(dist.irecv, buffer, peer, self.pp_group))
                received.append(buffer)
        requests = dist.batch_isend_irecv(operations) if operations else []
        return PendingExchange(requests, received, sent, positions)

    def _check(self, tensor: torch.Tensor | None, transfer: Transfer) -> None:
        if tensor is None or tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            raise ValueError(
                f"pipeline stage {self.rank} sends a {transfer.payload.value} of microbatch "
                f"{transfer.microbatch} shaped {got}, but the stages exchange "
                f"{self.tensor_shape} tensors of {self.dtype} ([seq_length / cp (/ tp under "
                "sequence parallelism), micro_batch_size, hidden_size]); pass the seq_length "
                "and micro_batch_size the data has, and return the hidden states from every "
                "stage but the last."
            )
