"""Staging: the training thread's copy of the state into reused host buffers — the only part of a
snapshot on the training path (compressing, hashing and writing are the writer's, `checkpointer.py`).

Host tensors (on a GPU node: θ_g, the outer momentum, RNG states; on a CPU node: everything) each have
a buffer of their own and are copied by one thread (`copy_bytes`). Tensors on a CUDA device are copied
into one pinned arena (`util/pinned.py`), laid out once and reused, by a side stream of their device:
the training thread only enqueues those copies, the device's training stream is made to wait for them
(no later kernel may overwrite a parameter before its copy has read it; the GPU waits, not the Python
thread, and only as long as the copy takes), and `Staged.wait` — the writer calls it before reading a
byte — synchronises on their end. The host copies run while the device copies are in flight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swarmnode.snapshot.tensors import tensor_bytes
from swarmnode.util.pinned import PinnedBuffer, aligned_offsets

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def copy_bytes(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A single-threaded memcpy. torch's `copy_` forks and joins its intra-op threads for every tensor,
    and on a loaded 2-core volunteer one descheduled thread then stalls every copy (docs/benchmarks.md
    "Component measurements": the staging copy)."""
    np.copyto(tensor_bytes(target), tensor_bytes(source))
    return target


@dataclass(frozen=True)
class Staged:
    """A staged state: host tensors by name, readable once `wait()` has returned."""

    tensors: dict[str, torch.Tensor]
    copied: tuple[Any, ...] = ()
    """CUDA events marking the end of the device copies (none on a CPU node)."""

    def wait(self) -> None:
        for event in self.copied:
            event.synchronize()


class StagingBuffers:
    """Preallocated host copies of the training state, reused snapshot after snapshot (training thread
    while it stages, the writer while it writes: `SpeculativeCheckpointer` hands them over)."""

    def __init__(self) -> None:
        self._host: dict[str, torch.Tensor] = {}
        self._arena: DeviceArena | None = None

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> Staged:
        """Copy `tensors` into the buffers (device copies enqueued first, so they overlap the host ones)."""
        on_device = {name: t for name, t in tensors.items() if t.is_cuda}
        copied = self._arena_for(on_device).copy_from(on_device) if on_device else ()
        staged = {
            name: self._device_view(name) if t.is_cuda else copy_bytes(self._host_buffer(name, t), t)
            for name, t in tensors.items()
        }
        return Staged(staged, copied)

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _device_view(self, name: str) -> torch.Tensor:
        assert self._arena is not None
        return self._arena.views[name]

    def _arena_for(self, tensors: Mapping[str, torch.Tensor]) -> DeviceArena:
        layout = layout_of(tensors)
        if self._arena is None or self._arena.layout != layout:
            self.close()
            self._arena = DeviceArena(layout)
        return self._arena

    def _host_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._host.get(name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu")
            self._host[name] = buffer
        return buffer


def layout_of(tensors: Mapping[str, torch.Tensor]) -> Layout:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


class DeviceArena:
    """One pinned host block that holds a copy of every device tensor of the state (aligned views into
    it, by name), and the side stream of each device that copies into it."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in layout.values()]
        offsets, total = aligned_offsets(sizes)
        self.buffer = PinnedBuffer(total)
        block = self.buffer.tensor
        self.views = {
            name: block[offset : offset + size].view(dtype).view(shape)
            for (name, (dtype, shape)), offset, size in zip(layout.items(), offsets, sizes, strict=True)
        }
        self._streams: dict[torch.device, Any] = {}

    def copy_from(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
        """Enqueue the device-to-host copies, one side stream per device; their end events."""
        by_device: dict[torch.device, list[str]] = {}
        for name, t in tensors.items():
            by_device.setdefault(t.device, []).append(name)
        return tuple(
            self._copy_on(device, [(n, tensors[n]) for n in names]) for device, names in by_device.items()
        )

    def _copy_on(self, device: torch.device, tensors: list[tuple[str, torch.Tensor]]) -> Any:
        producer = torch.cuda.current_stream(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(producer)  # the copies read what training has written so far
        with torch.cuda.stream(side):
            for name, t in tensors:
                self.views[name].copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        producer.wait_event(done)  # ... and training writes nothing before they have read it
        return done

    def close(self) -> None:
        self.buffer.close()
