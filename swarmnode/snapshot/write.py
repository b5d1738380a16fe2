"""Writing snapshot files (the format is described in `snapshot.py`).

Files are written streaming to a temporary name, hashed as written, optionally fsynced, then renamed to a
name that carries their sha256. In the `planes` layout each large byte plane gets a zstd frame of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch
import zstandard

from swarmnode.snapshot.format import (
    CHUNK_BYTES,
    FLOAT_DTYPES,
    FORMAT,
    FORMAT_VERSION,
    FRAME_MIN_BYTES,
    ITEMSIZE,
    SUFFIX,
    SnapshotInfo,
    snapshot_file_name,
)
from swarmnode.snapshot.tensors import DTYPES, tensor_bytes
from swarmnode.util import clock
from swarmnode.util.background import BackgroundPriority

MAX_PENDING_FRAMES = 4
"""Planes compressed ahead of the one being written (bounds the memory a write takes)."""


class _HashingSink:
    """A file wrapper that hashes and counts every byte written through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.sha256, self.size = raw, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return self.raw.write(view)

    def flush(self) -> None:
        self.raw.flush()


class _FrameWriter:
    """zstd output made of frames. Small data goes into a running (streamed) frame; a large byte plane
    becomes a frame of its own, compressed on a pool of `workers` threads while this thread hashes and
    writes finished frames in order — so compression, hashing and writing overlap. The pool's threads
    run at `priority` (None: the caller's)."""

    def __init__(
        self, sink: _HashingSink, level: int, workers: int, priority: BackgroundPriority | None
    ) -> None:
        self._level, self._sink, self._priority = level, sink, priority
        self._compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
        self._local = threading.local()  # a ZstdCompressor is not safe to share between threads
        self._pool_threads: list[int] = []
        self._pool = ThreadPoolExecutor(
            max(workers, 1), thread_name_prefix="zstd", initializer=self._join_priority
        )
        self._pending: deque[Future[bytes]] = deque()
        self._frame: Any = None
        self.raw_bytes = 0

    def write(self, data: Any) -> None:
        self._drain(0)
        if self._frame is None:
            self._frame = self._compressor.stream_writer(cast(BinaryIO, self._sink), closefd=False)
        self._frame.write(data)
        self.raw_bytes += memoryview(data).nbytes

    def whole_frame(self, data: np.ndarray) -> None:
        """`data` (possibly strided; nobody writes to it meanwhile) as one frame of its own."""
        self.end_frame()
        self._pending.append(self._pool.submit(self._compress, data))
        self.raw_bytes += data.nbytes
        self._drain(MAX_PENDING_FRAMES)

    def _join_priority(self) -> None:
        if self._priority is not None:
            self._pool_threads.append(self._priority.enter())

    def _compress(self, data: np.ndarray) -> bytes:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(
                level=self._level, write_checksum=True
            )
        return bytes(compressor.compress(np.ascontiguousarray(data).data))

    def _drain(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._sink.write(self._pending.popleft().result())

    def end_frame(self) -> None:
        if self._frame is not None:
            self._frame.close()
            self._frame = None

    def close(self) -> None:
        self.end_frame()
        try:
            self._drain(0)
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._priority is not None:
                for tid in self._pool_threads:
                    self._priority.leave(tid)


def build_header(tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any], layout: str) -> bytes:
    """The safetensors header (length prefix included, padded to 8 bytes) for these tensors."""
    header: dict[str, Any] = {}
    planes: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, tensor in tensors.items():
        dtype = DTYPES[tensor.dtype]
        nbytes = tensor.numel() * tensor.element_size()
        as_planes = layout == "planes" and dtype in FLOAT_DTYPES
        if as_planes:
            planes[name] = {"dtype": dtype, "shape": list(tensor.shape)}
            header[name] = {
                "dtype": "U8",
                "shape": [ITEMSIZE[dtype], tensor.numel()],
                "data_offsets": [offset, offset + nbytes],
            }
        else:
            header[name] = {
                "dtype": dtype,
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + nbytes],
            }
        offset += nbytes
    header["__metadata__"] = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "layout": layout,
        "planes": json.dumps(planes, separators=(",", ":")),
        "swarmnode": json.dumps(metadata, separators=(",", ":"), sort_keys=True),
    }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def _write_plain(out: _FrameWriter, data: np.ndarray) -> None:
    for start in range(0, len(data), CHUNK_BYTES):
        out.write(data[start : start + CHUNK_BYTES])


def _write_planes(out: _FrameWriter, data: np.ndarray, itemsize: int, buffer: np.ndarray) -> None:
    columns = data.reshape(-1, itemsize)
    numel = len(columns)
    for plane in range(itemsize):
        if numel >= FRAME_MIN_BYTES:  # a frame of its own, compressed in parallel with the others
            out.whole_frame(columns[:, plane])  # gathered on the compressing thread
            continue
        for start in range(0, numel, len(buffer)):
            count = min(len(buffer), numel - start)
            np.copyto(buffer[:count], columns[start : start + count, plane])
            out.write(buffer[:count])


def write_snapshot(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, Any],
    *,
    kind: str,
    layout: str = "planes",
    level: int = 1,
    threads: int = 1,
    fsync: bool = False,
    on_halfway: Callable[[], None] | None = None,
    priority: BackgroundPriority | None = None,
) -> tuple[SnapshotInfo, int]:
    """Write CPU tensors + metadata as a snapshot in `directory`; returns its info and raw byte count.

    `metadata` must hold outer_step, inner_step, run_id and node_id. `threads`: large byte planes are
    compressed as independent frames on this many threads while the calling thread hashes and writes
    (one is fastest on 2 cores: docs/benchmarks.md "Component measurements"). `on_halfway` is called once
    about half-way through the tensor data (a fault-injection point for tests). `priority`: the compressing
    threads' (the checkpointer's background priority; None: the caller's).
    """
    metadata = dict(metadata, kind=kind, layout=layout, created_at=metadata.get("created_at", clock.now()))
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-{uuid.uuid4().hex}{SUFFIX}.part"
    try:
        with tmp.open("wb") as raw:
            sink = _HashingSink(raw)
            raw_bytes = _write_stream(sink, tensors, metadata, layout, level, threads, on_halfway, priority)
            raw.flush()
            if fsync:
                os.fsync(raw.fileno())
        snapshot_id = sink.sha256.hexdigest()
        final = directory / snapshot_file_name(
            kind, metadata["outer_step"], metadata["inner_step"], snapshot_id
        )
        os.replace(tmp, final)
        if fsync:
            _fsync_directory(directory)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    info = SnapshotInfo(
        snapshot_id,
        final,
        sink.size,
        metadata["outer_step"],
        metadata["inner_step"],
        kind,
        metadata["created_at"],
        layout,
        metadata["run_id"],
        metadata["node_id"],
        metadata.get("committed_cursor", metadata.get("cursor")),
    )
    return info, raw_bytes


def _write_stream(
    sink: _HashingSink,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, Any],
    layout: str,
    level: int,
    threads: int,
    on_halfway: Callable[[], None] | None,
    priority: BackgroundPriority | None,
) -> int:
    out = _FrameWriter(sink, level, threads, priority)
    try:
        out.write(build_header(tensors, metadata, layout))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        written, halfway_called = 0, on_halfway is None
        buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
        for tensor in tensors.values():
            data = tensor_bytes(tensor)
            if layout == "planes" and DTYPES[tensor.dtype] in FLOAT_DTYPES:
                _write_planes(out, data, tensor.element_size(), buffer)
            else:
                _write_plain(out, data)
            written += data.nbytes
            if not halfway_called and written * 2 >= total:
                halfway_called = True
                on_halfway()  # type: ignore[misc]
    finally:
        out.close()
    return out.raw_bytes


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """An ordinary, uncompressed safetensors file (used by `swarmnode export`)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    tmp = path.with_name(path.name + ".part")
    try:
        with tmp.open("wb") as f:
            f.write(len(body).to_bytes(8, "little") + body)
            for tensor in tensors.values():
                f.write(tensor_bytes(tensor.contiguous()).data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # (a failed write leaves no `.part` behind)
