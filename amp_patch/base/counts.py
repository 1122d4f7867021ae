"""Device values that reach the host without making it wait.

Sync-free steps (``amp_patch.scaling``) know whether a step was skipped only
on the device. ``DeviceCount`` counts there and is read when someone asks;
``HostCopies`` copies small records to host memory without blocking and
hands them over, in order, once each has arrived.
"""
from __future__ import annotations

import collections
import ctypes
from typing import Any, Deque, Iterator, List, Optional, Tuple, Union

import torch


class DeviceCount:
    """An integer count: ``add(1)`` on the host, ``add(flag)`` with a 0-d device
    tensor; ``value`` reads the device part (a host sync, only when asked)."""

    __slots__ = ("_host", "_device")

    def __init__(self, value: int = 0):
        self._host = value
        self._device: Optional[torch.Tensor] = None

    def add(self, n: Union[int, torch.Tensor]) -> None:
        if isinstance(n, torch.Tensor):
            if self._device is None:
                self._device = n.detach().to(torch.float32, copy=True)
            else:
                self._device.add_(n)
        else:
            self._host += n

    @property
    def value(self) -> int:
        if self._device is not None:
            self._host += int(self._device.item())
            self._device = None
        return self._host

    def __repr__(self) -> str:
        return f"DeviceCount({self._host}{' + on device' if self._device is not None else ''})"


class HostCopies:
    """Small 1-d FP32 records posted on the device, copied to pinned host memory
    without blocking (a CUDA event says when each has arrived), and read in order."""

    def __init__(self) -> None:
        self.queue: Deque[Tuple[Optional[Any], torch.Tensor]] = collections.deque()

    def __len__(self) -> int:
        return len(self.queue)

    def post(self, record: torch.Tensor) -> None:
        record = record.detach().to(torch.float32).reshape(-1)
        if record.device.type == "cuda":
            host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
            host.copy_(record, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # host memory already: each device op ran before the next Python line
            host, event = record.contiguous(), None
        self.queue.append((event, host))

    def drain(self, wait: bool) -> Iterator[List[float]]:
        """The records that have arrived, oldest first (all of them, waiting, when ``wait``)."""
        while self.queue:
            event, host = self.queue[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self.queue.popleft()
            # a read of host memory that has arrived: no Tensor method, no device work
            yield list((ctypes.c_float * host.numel()).from_address(host.data_ptr()))
