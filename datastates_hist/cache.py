"""The host cache: a fixed, reusable buffer that snapshots are copied into.

Regions are handed out in order around a ring and given back by the flusher
once their bytes are in storage. When the ring is full, :meth:`HostCache.alloc`
waits (backpressure) instead of growing: host memory stays bounded whatever
the state size, and training slows to the storage speed.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

ALIGN = 64


@dataclass
class Region:
    """``nbytes`` bytes at ``offset`` in the cache."""

    offset: int
    nbytes: int
    end: int  # where the next region may start (offset + nbytes, aligned)
    freed: bool = False


class HostCache:
    """A ring allocator over one uint8 tensor (pinned when ``pin`` is True)."""

    def __init__(self, nbytes: int, pin: bool = False):
        if nbytes < ALIGN:
            raise ValueError(f"host cache of {nbytes} bytes is too small")
        self.capacity = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.bytes = self.buffer.numpy()  # the same memory: numpy views cost a tenth of torch's
        self._live: deque[Region] = deque()
        self._head = 0  # next free byte
        self._cond = threading.Condition()
        self.waits = 0  # how often alloc had to wait for space
        self.allocated = 0  # bytes handed out since the start (aligned): where each snapshot ends

    def _place(self, nbytes: int) -> int | None:
        """The offset where ``nbytes`` fit now, or None."""
        size = aligned(nbytes)
        if not self._live:
            self._head = 0
            return 0 if size <= self.capacity else None
        tail = self._live[0].offset
        wrapped = self._live[-1].offset < tail
        if not wrapped:  # free space: [head, capacity) and [0, tail)
            if self._head + size <= self.capacity:
                return self._head
            return 0 if size <= tail else None
        return self._head if self._head + size <= tail else None

    def alloc(self, nbytes: int, on_wait: Callable[[], None] | None = None,
              cancelled: Callable[[], bool] | None = None) -> Region:
        """A region of ``nbytes``; waits for space, calling ``on_wait`` once first."""
        if aligned(nbytes) > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a host cache of {self.capacity}")
        with self._cond:
            offset = self._place(nbytes)
            if offset is None:
                self.waits += 1
                if on_wait is not None:
                    on_wait()
                while offset is None:
                    if cancelled is not None and cancelled():
                        raise RuntimeError("snapshot cancelled")
                    self._cond.wait(timeout=0.5)
                    offset = self._place(nbytes)
            region = Region(offset, nbytes, offset + aligned(nbytes))
            self._live.append(region)
            self._head = region.end
            self.allocated += aligned(nbytes)
            return region

    def release(self) -> None:
        """Let the buffer go (the pipeline is closed: nothing allocates from it again)."""
        with self._cond:
            self._live.clear()
            self.buffer = torch.empty(0, dtype=torch.uint8)
            self.bytes = self.buffer.numpy()

    def held_bytes(self) -> int:
        """Bytes from the oldest region not given back to the newest (gaps included)."""
        with self._cond:
            if not self._live:
                return 0
            tail = self._live[0].offset
            return self._head - tail if self._head > tail else self.capacity - tail + self._head

    def view(self, region: Region) -> torch.Tensor:
        """The region's bytes as a uint8 tensor (a destination of device copies)."""
        return self.buffer[region.offset:region.offset + region.nbytes]

    def array(self, region: Region) -> np.ndarray:
        """The region's bytes as a uint8 numpy array."""
        return self.bytes[region.offset:region.offset + region.nbytes]

    def free(self, region: Region) -> None:
        """Give a region back; space is reclaimed in allocation order."""
        with self._cond:
            region.freed = True
            while self._live and self._live[0].freed:
                self._live.popleft()
            self._cond.notify_all()


def aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)
