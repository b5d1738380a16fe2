"""Reading snapshot files (the format is described in `snapshot.py`).

Reading streams, hashes the compressed bytes while it decompresses, validates the header before
allocating anything, and never unpickles; tensors are returned only when the sha256 matches.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch
import zstandard

from swarmnode.snapshot.format import (
    CHUNK_BYTES,
    DEFAULT_MAX_BYTES,
    FLOAT_DTYPES,
    FORMAT,
    FORMAT_VERSION,
    ITEMSIZE,
    LAYOUTS,
    MAX_EXPANSION,
    MAX_HEADER_BYTES,
    MAX_NAME_CHARS,
    MAX_TENSORS,
    SnapshotError,
    SnapshotHeader,
    SnapshotMismatch,
    TensorEntry,
    open_snapshot_file,
)
from swarmnode.snapshot.tensors import DTYPES, TORCH_DTYPES, LoadedSnapshot, TensorTemplate, tensor_bytes


class _HashingSource:
    """A file wrapper that hashes every byte read through it; `drain()` hashes the unread rest."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.sha256, self.size = raw, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.sha256.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK_BYTES):
            pass


class _Decompressed:
    """Exact-size reads from the decompressed stream; a short read is a truncated file."""

    def __init__(self, source: _HashingSource) -> None:
        self._reader = zstandard.ZstdDecompressor().stream_reader(
            cast(BinaryIO, source), read_across_frames=True, read_size=1 << 20
        )

    def read_exact(self, size: int) -> bytes:
        buffer = bytearray(size)
        self.readinto_exact(memoryview(buffer))
        return bytes(buffer)

    def readinto_exact(self, view: memoryview) -> None:
        filled = 0
        try:
            while filled < len(view):
                count = self._reader.readinto(view[filled:])
                if count == 0:
                    raise SnapshotError(f"truncated: stream ended {len(view) - filled} bytes early")
                filled += count
        except zstandard.ZstdError as exc:
            raise SnapshotError(f"corrupt zstd stream: {exc}") from None

    def at_end(self) -> bool:
        try:
            return self._reader.read(1) == b""
        except zstandard.ZstdError as exc:
            raise SnapshotError(f"corrupt zstd stream after the data: {exc}") from None


def _parse_header(raw: bytes) -> SnapshotHeader:
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SnapshotError(f"header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(document, dict) or not isinstance(document.get("__metadata__"), dict):
        raise SnapshotError("header lacks __metadata__")
    info = document.pop("__metadata__")
    if info.get("format") != FORMAT or info.get("format_version") != str(FORMAT_VERSION):
        raise SnapshotError(
            f"not a {FORMAT} v{FORMAT_VERSION} file: {info.get('format')!r} v{info.get('format_version')!r}"
        )
    layout = info.get("layout")
    if layout not in LAYOUTS:
        raise SnapshotError(f"unknown layout {layout!r}")
    planes = _json_field(info, "planes")
    metadata = _json_field(info, "swarmnode")
    if len(document) > MAX_TENSORS:
        raise SnapshotError(f"too many tensors: {len(document)}")
    entries = sorted(
        (_parse_entry(name, spec, planes) for name, spec in document.items()), key=lambda e: e.begin
    )
    _check_contiguous(entries)
    return SnapshotHeader(metadata, layout, tuple(entries))


def _json_field(info: dict[str, Any], key: str) -> dict[str, Any]:
    try:
        value = json.loads(info.get(key, "{}"))
    except (TypeError, json.JSONDecodeError):
        value = None
    if not isinstance(value, dict):
        raise SnapshotError(f"__metadata__[{key!r}] is not a JSON object")
    return value


def _parse_entry(name: str, spec: Any, planes: dict[str, Any]) -> TensorEntry:
    if len(name) > MAX_NAME_CHARS or not isinstance(spec, dict):
        raise SnapshotError(f"bad tensor entry {name[:64]!r}")
    dtype, shape, offsets = spec.get("dtype"), _shape(spec.get("shape")), _shape(spec.get("data_offsets"))
    if dtype not in ITEMSIZE or shape is None or offsets is None or len(offsets) != 2:
        raise SnapshotError(f"tensor {name!r}: bad dtype, shape or data_offsets")
    begin, end = offsets
    if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
        raise SnapshotError(
            f"tensor {name!r}: data_offsets span {end - begin} bytes, shape says "
            f"{math.prod(shape) * ITEMSIZE[dtype]}"
        )
    if name not in planes:
        return TensorEntry(name, dtype, tuple(shape), begin, end, planes=False)
    logical = planes[name] if isinstance(planes[name], dict) else {}
    ldtype, lshape = logical.get("dtype"), _shape(logical.get("shape"))
    if (
        ldtype not in FLOAT_DTYPES
        or lshape is None
        or dtype != "U8"
        or shape != [ITEMSIZE[ldtype], math.prod(lshape)]
    ):
        raise SnapshotError(f"tensor {name!r}: planes entry disagrees with its stored shape")
    return TensorEntry(name, ldtype, tuple(lshape), begin, end, planes=True)


def _shape(value: Any) -> list[int] | None:
    """`value` if it is a list of at most 8 non-negative ints below 2**48, else None."""
    ok = (
        isinstance(value, list)
        and len(value) <= 8
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in value)
    )
    return value if ok else None


def _check_contiguous(entries: list[TensorEntry]) -> None:
    position = 0
    for entry in entries:
        if entry.begin != position:
            raise SnapshotError(
                f"tensor {entry.name!r} starts at {entry.begin}, expected {position} (gap or overlap)"
            )
        position = entry.end


def _read_header(stream: _Decompressed) -> SnapshotHeader:
    length = int.from_bytes(stream.read_exact(8), "little")
    if not 2 <= length <= MAX_HEADER_BYTES:
        raise SnapshotError(f"header length {length} is out of bounds (max {MAX_HEADER_BYTES})")
    return _parse_header(stream.read_exact(length))


OPTIONAL_TENSOR = re.compile(r"^rng/(cuda/\d{1,2}|rank/\d{1,2}/(torch|cuda))$")
"""Tensors a snapshot may hold beyond this model's: a GPU node's RNG states (read by a CPU node), the
RNG states of a node's ranks 1..N−1 (read by a node of another rank count)."""
OPTIONAL_TENSOR_MAX_BYTES = 64 << 10


def check_template(header: SnapshotHeader, template: TensorTemplate) -> None:
    """Refuse a header whose tensors differ from what this model expects (before allocating any):
    every tensor of the template with its dtype and shape (CUDA RNG states optional), nothing else but
    small RNG states (`OPTIONAL_TENSOR`)."""
    stored = {e.name: e for e in header.entries}
    for name, (dtype, shape) in template.items():
        entry = stored.get(name)
        if entry is None:
            if OPTIONAL_TENSOR.match(name):
                continue
            raise SnapshotMismatch(f"snapshot lacks tensor {name!r}")
        if TORCH_DTYPES[entry.dtype] != dtype or entry.shape != tuple(shape):
            raise SnapshotMismatch(
                f"tensor {name!r} is {entry.dtype}{list(entry.shape)}, this model expects "
                f"{DTYPES[dtype]}{list(shape)}"
            )
    for name, entry in stored.items():
        if name not in template and not (
            OPTIONAL_TENSOR.match(name) and entry.end - entry.begin <= OPTIONAL_TENSOR_MAX_BYTES
        ):
            raise SnapshotMismatch(f"snapshot has a tensor this model lacks: {name[:64]!r}")


def _read_tensor(stream: _Decompressed, entry: TensorEntry, buffer: np.ndarray) -> torch.Tensor:
    tensor = torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype])
    data = tensor_bytes(tensor)
    if not entry.planes:
        for start in range(0, data.nbytes, CHUNK_BYTES):
            stream.readinto_exact(data[start : start + CHUNK_BYTES].data)
        return tensor
    columns = data.reshape(-1, ITEMSIZE[entry.dtype])
    for plane in range(columns.shape[1]):
        for start in range(0, len(columns), len(buffer)):
            count = min(len(buffer), len(columns) - start)
            stream.readinto_exact(buffer[:count].data)
            columns[start : start + count, plane] = buffer[:count]
    return tensor


def read_snapshot(
    path: Path,
    *,
    expected_id: str | None = None,
    template: TensorTemplate | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> LoadedSnapshot:
    """Read, validate and verify a snapshot file; the tensors are returned only if the sha256 matches.

    `template` (name -> (dtype, shape)) refuses any other tensor set before allocating; without it,
    at most `max_bytes` of declared tensor data are accepted, and no more than the file could plausibly
    decompress to (`MAX_EXPANSION` × its size), so a small lying file cannot make us allocate much.
    """
    with open_snapshot_file(path) as raw:
        plausible = MAX_EXPANSION * path.stat().st_size + MAX_HEADER_BYTES
        return read_snapshot_stream(
            raw, expected_id=expected_id, template=template, max_bytes=min(max_bytes, plausible)
        )


def read_snapshot_stream(
    raw: BinaryIO,
    *,
    expected_id: str | None = None,
    template: TensorTemplate | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> LoadedSnapshot:
    """`read_snapshot` over any readable byte stream (e.g. a download still arriving)."""
    source = _HashingSource(raw)
    stream = _Decompressed(source)
    header = _read_header(stream)
    _check_limits(header, template, max_bytes)
    buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
    tensors = {e.name: _read_tensor(stream, e, buffer) for e in header.entries}
    snapshot_id = _finish(stream, source, expected_id)
    return LoadedSnapshot(snapshot_id, header, tensors, source.size)


def verify_snapshot(
    path: Path, *, expected_id: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[str, SnapshotHeader]:
    """Stream a snapshot through the decoder and the hash without keeping its tensors."""
    with open_snapshot_file(path) as raw:
        source = _HashingSource(raw)
        stream = _Decompressed(source)
        header = _read_header(stream)
        _check_limits(header, None, max_bytes)
        buffer = memoryview(bytearray(CHUNK_BYTES))
        remaining = header.data_bytes
        while remaining:
            count = min(remaining, CHUNK_BYTES)
            stream.readinto_exact(buffer[:count])
            remaining -= count
        return _finish(stream, source, expected_id), header


def read_header(path: Path) -> SnapshotHeader:
    """Only the header (cheap: decompresses the first bytes); nothing is verified."""
    with open_snapshot_file(path) as raw:
        return _read_header(_Decompressed(_HashingSource(raw)))


def _check_limits(header: SnapshotHeader, template: TensorTemplate | None, max_bytes: int) -> None:
    if template is not None:
        check_template(header, template)
    if header.data_bytes > max_bytes:
        raise SnapshotError(f"declares {header.data_bytes} bytes of tensors, over the limit of {max_bytes}")


def _finish(stream: _Decompressed, source: _HashingSource, expected_id: str | None) -> str:
    if not stream.at_end():
        raise SnapshotError("trailing data after the tensors")
    source.drain()
    snapshot_id = source.sha256.hexdigest()
    if expected_id is not None and snapshot_id != expected_id:
        raise SnapshotError(
            f"sha256 mismatch: file hashes to {snapshot_id[:16]}…, expected {expected_id[:16]}…"
        )
    return snapshot_id
