"""The snapshot file format (DESIGN.md §3 "Snapshot file").

A snapshot is one `*.snap.zst` file: zstd frames whose concatenated content is a safetensors container
(8-byte little-endian header length, JSON header, raw tensor bytes). Tensors are named; everything else
is JSON in the header's `__metadata__` (safetensors allows only string values there, so the structured
metadata travels as one JSON string under "swarmnode"). Two layouts:

- `planes`: each float tensor is stored as a uint8 `[itemsize, numel]` array of its byte planes (the
  original dtype and shape are in the metadata). The sign/exponent plane of trained weights and Adam
  moments compresses 3-5x, the mantissa planes barely, so each large plane gets a zstd frame of its own:
  zstd then sees noise and structure separately instead of interleaved.
- `plain`: tensors as they are; `zstd -d` gives an ordinary safetensors file.

The snapshot id is the sha256 of the compressed file, and it is part of the file name, so `sha256sum`
checks it with standard tools. Files are written streaming to a temporary name, hashed as written,
optionally fsynced, then renamed. Reading streams too, hashes while it decompresses, validates the header
before allocating anything, and never unpickles.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch
import zstandard

from swarmnode import clock

FORMAT = "swarmnode-snapshot"
FORMAT_VERSION = 1
SUFFIX = ".snap.zst"
MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 100_000
MAX_NAME_CHARS = 512
CHUNK_BYTES = 4 << 20
FRAME_MIN_BYTES = 256 << 10  # planes smaller than this share the running frame
DEFAULT_MAX_BYTES = 64 << 30
MAX_EXPANSION = 1000  # decompressed/compressed: far above any real snapshot (fresh Adam moments ~ zeros)

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for dtype, name in DTYPES.items()}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_NAME_RE = re.compile(r"^(hot|cold)-o(\d{8})-i(\d{10})-([0-9a-f]{64})" + re.escape(SUFFIX) + "$")


class SnapshotError(Exception):
    """A snapshot file is malformed, truncated, or does not match its id."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A complete, verified snapshot on disk, as the checkpointer lists and the gRPC server serves it."""

    snapshot_id: str  # sha256 hex of the compressed file
    path: Path
    size_bytes: int
    outer_step: int
    inner_step: int
    kind: str  # "hot" | "cold"
    created_at: float  # unix seconds
    layout: str  # "planes" | "plain"
    run_id: str
    node_id: str
    cursor: dict[str, int] | None = None  # the writer's committed data cursor (DESIGN.md §4)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as stored: its logical dtype/shape and its byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    planes: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SnapshotHeader:
    metadata: dict[str, Any]
    layout: str
    entries: tuple[TensorEntry, ...]

    @property
    def data_bytes(self) -> int:
        return self.entries[-1].end if self.entries else 0


@dataclass(frozen=True)
class LoadedSnapshot:
    snapshot_id: str
    header: SnapshotHeader
    tensors: dict[str, torch.Tensor]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.header.metadata


def snapshot_file_name(kind: str, outer_step: int, inner_step: int, snapshot_id: str) -> str:
    return f"{kind}-o{outer_step:08d}-i{inner_step:010d}-{snapshot_id}{SUFFIX}"


def parse_snapshot_name(name: str) -> tuple[str, int, int, str] | None:
    """(kind, outer_step, inner_step, snapshot_id) from a file name, or None if it is no snapshot."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    return match[1], int(match[2]), int(match[3]), match[4]


# ---------------------------------------------------------------- writing


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
    """zstd output that can end the running frame, so dissimilar data is compressed apart."""

    def __init__(self, sink: _HashingSink, level: int, threads: int) -> None:
        self._compressor = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
        self._sink = sink
        self._frame: Any = None
        self.raw_bytes = 0

    def write(self, data: Any) -> None:
        if self._frame is None:
            self._frame = self._compressor.stream_writer(cast(BinaryIO, self._sink), closefd=False)
        self._frame.write(data)
        self.raw_bytes += memoryview(data).nbytes

    def end_frame(self) -> None:
        if self._frame is not None:
            self._frame.close()
            self._frame = None


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


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
    own_frames = numel >= FRAME_MIN_BYTES
    for plane in range(itemsize):
        if own_frames:
            out.end_frame()
        for start in range(0, numel, len(buffer)):
            count = min(len(buffer), numel - start)
            np.copyto(buffer[:count], columns[start : start + count, plane])
            out.write(buffer[:count])
    if own_frames:
        out.end_frame()


def write_snapshot(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, Any],
    *,
    kind: str,
    layout: str = "planes",
    level: int = 1,
    threads: int = 0,
    fsync: bool = False,
    on_halfway: Callable[[], None] | None = None,
) -> tuple[SnapshotInfo, int]:
    """Write CPU tensors + metadata as a snapshot in `directory`; returns its info and raw byte count.

    `metadata` must hold outer_step, inner_step, run_id and node_id. `on_halfway` is called once about
    half-way through the tensor data (a fault-injection point for tests).
    """
    metadata = dict(metadata, kind=kind, layout=layout, created_at=metadata.get("created_at", clock.now()))
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-{uuid.uuid4().hex}{SUFFIX}.part"
    try:
        with tmp.open("wb") as raw:
            sink = _HashingSink(raw)
            raw_bytes = _write_stream(sink, tensors, metadata, layout, level, threads, on_halfway)
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
) -> int:
    out = _FrameWriter(sink, level, threads)
    out.write(build_header(tensors, metadata, layout))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    written, halfway_called = 0, on_halfway is None
    buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
    for tensor in tensors.values():
        data = _tensor_bytes(tensor)
        if layout == "planes" and DTYPES[tensor.dtype] in FLOAT_DTYPES:
            _write_planes(out, data, tensor.element_size(), buffer)
        else:
            _write_plain(out, data)
        written += data.nbytes
        if not halfway_called and written * 2 >= total:
            halfway_called = True
            on_halfway()  # type: ignore[misc]
    out.end_frame()
    return out.raw_bytes


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading


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
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"header is not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("__metadata__"), dict):
        raise SnapshotError("header lacks __metadata__")
    info = document.pop("__metadata__")
    if info.get("format") != FORMAT or info.get("format_version") != str(FORMAT_VERSION):
        raise SnapshotError(
            f"not a {FORMAT} v{FORMAT_VERSION} file: {info.get('format')!r} v{info.get('format_version')!r}"
        )
    layout = info.get("layout")
    if layout not in ("planes", "plain"):
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


TensorTemplate = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


def check_template(header: SnapshotHeader, template: TensorTemplate, optional_prefix: str = "rng/") -> None:
    """Refuse a header whose tensors differ from what this model expects (before allocating any)."""
    stored = {e.name: e for e in header.entries}
    for name, (dtype, shape) in template.items():
        entry = stored.get(name)
        if entry is None:
            if name.startswith(optional_prefix):
                continue
            raise SnapshotError(f"snapshot lacks tensor {name!r}")
        if TORCH_DTYPES[entry.dtype] != dtype or entry.shape != tuple(shape):
            raise SnapshotError(
                f"tensor {name!r} is {entry.dtype}{list(entry.shape)}, this model "
                f"expects {DTYPES[dtype]}{list(shape)}"
            )
    extra = [n for n in stored if n not in template and not n.startswith(optional_prefix)]
    if extra:
        raise SnapshotError(f"snapshot has {len(extra)} tensors this model lacks, e.g. {extra[0]!r}")


def _read_tensor(stream: _Decompressed, entry: TensorEntry, buffer: np.ndarray) -> torch.Tensor:
    tensor = torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype])
    data = _tensor_bytes(tensor)
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
    with _open(path) as raw:
        source = _HashingSource(raw)
        stream = _Decompressed(source)
        header = _read_header(stream)
        plausible = MAX_EXPANSION * path.stat().st_size + MAX_HEADER_BYTES
        _check_limits(header, template, min(max_bytes, plausible))
        buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
        tensors = {e.name: _read_tensor(stream, e, buffer) for e in header.entries}
        snapshot_id = _finish(stream, source, expected_id)
    return LoadedSnapshot(snapshot_id, header, tensors)


def verify_snapshot(
    path: Path, *, expected_id: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[str, SnapshotHeader]:
    """Stream a snapshot through the decoder and the hash without keeping its tensors."""
    with _open(path) as raw:
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
    with _open(path) as raw:
        return _read_header(_Decompressed(_HashingSource(raw)))


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as exc:
        raise SnapshotError(f"cannot open {path}: {exc.strerror}") from None


def _check_limits(header: SnapshotHeader, template: TensorTemplate | None, max_bytes: int) -> None:
    if template is not None:
        check_template(header, template)
    elif header.data_bytes > max_bytes:
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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with _open(path) as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def info_from_file(path: Path) -> SnapshotInfo | None:
    """SnapshotInfo of a correctly named file, from its name and header (hash not checked)."""
    parsed = parse_snapshot_name(path.name)
    if parsed is None:
        return None
    kind, outer, inner, snapshot_id = parsed
    meta = read_header(path).metadata
    return SnapshotInfo(
        snapshot_id,
        path,
        path.stat().st_size,
        outer,
        inner,
        kind,
        float(meta.get("created_at", 0.0)),
        str(meta.get("layout", "")),
        str(meta.get("run_id", "")),
        str(meta.get("node_id", "")),
        meta.get("committed_cursor", meta.get("cursor")),
    )


def iter_snapshot_files(directory: Path) -> Iterator[Path]:
    """Snapshot files in `directory`, newest (outer, inner step; cold before hot) first."""
    if not directory.is_dir():
        return iter(())
    named = [(parse_snapshot_name(p.name), p) for p in directory.iterdir()]
    ranked = sorted(((n[1], n[2], n[0] == "cold", p) for n, p in named if n is not None), reverse=True)
    return iter([p for *_, p in ranked])


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
    with tmp.open("wb") as f:
        f.write(len(body).to_bytes(8, "little") + body)
        for tensor in tensors.values():
            f.write(_tensor_bytes(tensor.contiguous()).data)
    os.replace(tmp, path)
