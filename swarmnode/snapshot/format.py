"""The snapshot file format (the contract; docs/design.md "Snapshots" describes it for users).

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

This module holds what writer, reader and the network share, without torch: constants, file names, the
header and info types (the `swarmnode status`/`fetch` client imports it). The tensors' side is
`tensors.py`; writing is `write.py`, reading `read.py`.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

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

LAYOUTS = ("planes", "plain")
"""Tensor layouts: byte planes (smaller) or plain (`zstd -d` gives an ordinary safetensors file)."""
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
"""Bytes per element of each safetensors dtype this format stores."""
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_NAME_RE = re.compile(r"^(hot|cold)-o(\d{8})-i(\d{10})-([0-9a-f]{64})" + re.escape(SUFFIX) + "$")


class SnapshotError(Exception):
    """A snapshot file is malformed, truncated, or does not match its id."""


class SnapshotMismatch(SnapshotError):
    """A sound snapshot of another configuration (other tensors, shapes or run digest): not this node's
    to use, but nothing to quarantine either."""


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
    cursor: dict[str, int] | None = None  # the writer's committed data cursor


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


def snapshot_file_name(kind: str, outer_step: int, inner_step: int, snapshot_id: str) -> str:
    return f"{kind}-o{outer_step:08d}-i{inner_step:010d}-{snapshot_id}{SUFFIX}"


def parse_snapshot_name(name: str) -> tuple[str, int, int, str] | None:
    """(kind, outer_step, inner_step, snapshot_id) from a file name, or None if it is no snapshot."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    return match[1], int(match[2]), int(match[3]), match[4]


def iter_snapshot_files(directory: Path) -> Iterator[Path]:
    """Snapshot files in `directory`, newest (outer, inner step; cold before hot) first."""
    if not directory.is_dir():
        return iter(())
    named = [(parse_snapshot_name(p.name), p) for p in directory.iterdir()]
    ranked = sorted(((n[1], n[2], n[0] == "cold", p) for n, p in named if n is not None), reverse=True)
    return iter([p for *_, p in ranked])


def open_snapshot_file(path: Path) -> BinaryIO:
    """Open for reading; a file that cannot be opened is a SnapshotError."""
    try:
        return path.open("rb")
    except OSError as exc:
        raise SnapshotError(f"cannot open {path}: {exc.strerror}") from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open_snapshot_file(path) as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()
