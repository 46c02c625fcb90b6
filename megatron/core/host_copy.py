"""`HostCopy`: a few device values on their way to the host, read without waiting for the GPU
work queued after them.

Reading a device tensor at once (`.tolist()`, `.item()`) makes the host wait for every kernel
queued before the read, so a loop that reads each iteration's results at its end cannot queue
the next iteration meanwhile. A `HostCopy` queues the copy into pinned memory as soon as the
values are computed, in the order of the stream that computed them, and records an event after
it: a later read waits for that copy alone, and finds it done when the GPU got that far.
"""

from __future__ import annotations

import torch


class HostCopy:
    """The values of `tensor`, copied to the host in stream order (on CPU: `tensor` itself).

    Args:
        tensor: the values, flat, computed (or queued) on the current stream.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._host = tensor
        self._copied: torch.cuda.Event | None = None
        if tensor.is_cuda:
            stream = torch.cuda.current_stream(tensor.device)
            # Into pinned memory: the copy is queued, and the host goes on.
            self._host = tensor.to("cpu", non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(stream)

    def tolist(self) -> list:
        """The values (waits for the copy to end where it has not)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()
