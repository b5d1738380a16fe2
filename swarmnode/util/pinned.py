"""Page-locked (pinned) host memory of an exact size, for copies between a GPU and the host.

A device-to-host copy into pageable memory goes through a driver bounce buffer and cannot overlap
anything; into pinned memory it is one DMA transfer that a side stream can run while the GPU trains.
torch's own pinned allocator (`pin_memory=True`) rounds every block up to a power of two, so a 1.2 GB
training state would pin 2 GB; here an ordinary host allocation is registered with the driver
(`cudaHostRegister`, as torch.distributed.checkpoint's stager does), exactly its size, and unregistered
by `close()`. Buffers are made once and reused: pinning is slow (it touches every page).
"""

from __future__ import annotations

from typing import Any

import torch

PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every device's context, not only the current one's (a node on
`cuda:1` while device 0 is current), as torch's own registration does."""
ALIGN_BYTES = 64
"""Views into an arena start on this boundary (any dtype's alignment, and a cache line)."""


class PinnedBuffer:
    """`numel` elements of `dtype` in host memory, page-locked while a CUDA device is present (plain
    host memory otherwise, so CPU-only code paths and tests use the same buffers)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.uint8) -> None:
        self.tensor = torch.empty(numel, dtype=dtype)
        self.nbytes = numel * self.tensor.element_size()
        self.pinned = torch.cuda.is_available() and self.nbytes > 0
        if self.pinned:
            cudart = torch.cuda.cudart()
            _check(cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, PORTABLE), "register")

    def close(self) -> None:
        """Unpin (the memory stays valid as ordinary host memory until the tensor is dropped)."""
        if self.pinned:
            self.pinned = False
            _check(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()), "unregister")


def _check(code: Any, what: str) -> None:
    if int(code) != 0:
        raise RuntimeError(f"cannot {what} pinned host memory: CUDA error {int(code)}")


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of consecutive blocks of `sizes` bytes, each on an ALIGN_BYTES boundary, and the
    total bytes they span."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        offsets.append(start)
        end = start + size
    return offsets, end
