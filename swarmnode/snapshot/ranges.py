"""The training state as verifiable byte ranges, for recovery from many peers at once (docs/design.md
"Recovery from many peers").

After an agreed outer step every member of a lineage holds the same θ_g and outer momentum. Their bytes
— the *shared part* — are laid out as one flat fp32 blob: every `global/<param>` tensor in the model's
parameter order, then every `outer_momentum/<param>`. The *node part* is what differs per node and
comes from one peer: every `inner/<param>/exp_avg` and `exp_avg_sq`, in the same order. (`model/*` is
not fetched at all: a node adopting a peer's state restarts its round from θ_g; the RNG stays its own.)

A blob is cut into `range_bytes` pieces (the last may be shorter); its `RangeList` holds the sha256 of
each piece, and its *root* is the sha256 over a domain tag, the range size, the total size and the
concatenated piece hashes. A reader never takes a root from the wire: it recomputes it from the hash
list, so a peer that lies about one hash changes the root and no longer agrees with honest peers. The
bounds below are checked before anything is allocated. This module is torch-free but for the layout,
which reads only names, dtypes and shapes of a template.

On the wire a range travels as its raw bytes or, where that is smaller, as one zstd-1 frame of its byte
planes (`zstd-planesN`, N the blob's element size: the snapshot's own "planes" trick: only the
sign/exponent plane compresses, so θ_g, the momentum and the moments shrink a little). The blobs hold
whatever dtypes and optimizer state the template names (θ_g and the momentum are fp32; the moments have
the parameters' dtype, bf16 or fp16 too, and whatever names the optimizer keeps); a blob of mixed element
sizes is cut in single bytes. The hashes are over the raw bytes, so the encoding is transport only;
decoding is bounded by the range's size before the hash is checked.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import zstandard

from swarmnode.snapshot.tensors import TensorTemplate

HASH_BYTES = 32
ROOT_TAG = b"swarmnode/state-ranges/v1"
DEFAULT_RANGE_BYTES = 1 << 20
"""1 MiB: the fastest size of one protobuf message (docs/benchmarks.md "Component measurements"), and
fine-grained enough
that a slow peer's last range costs little; `small`'s shared part is 83 ranges, its hash list 2.6 KB."""
MIN_RANGE_BYTES = 4 << 10
MAX_RANGE_BYTES = 4 << 20
"""What a reader accepts from a peer's manifest: above it a range would not fit one gRPC message."""
MAX_RANGES = 1 << 16
"""Hash lists of at most 2 MiB; with 4 MiB ranges that is 256 GiB of state."""

RAW = ""
PLANE_WIDTHS = (2, 4, 8)
"""Element sizes cut into byte planes (fp16/bf16, fp32, fp64); others travel as they are."""
ZSTD_PLANES = "zstd-planes4"
ENCODINGS = (RAW, *(f"zstd-planes{width}" for width in PLANE_WIDTHS))
EncodedRange = tuple[str, bytes]
"""(encoding, bytes) of one range on the wire."""
PLANES = 4
"""θ_g and the outer momentum are fp32: the shared blob's element size."""

SHARED_PREFIXES = ("global/", "outer_momentum/")
NODE_PREFIXES = ("inner/",)


class RangeError(ValueError):
    """A range list or a range that does not hold up: malformed bounds, a wrong size, a wrong hash."""


@dataclass(frozen=True)
class RangeList:
    """One blob's size, range size and per-range sha256 digests; `root` names the blob."""

    total_bytes: int
    range_bytes: int
    hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not MIN_RANGE_BYTES <= self.range_bytes <= MAX_RANGE_BYTES:
            raise RangeError(
                f"range size {self.range_bytes} is outside {MIN_RANGE_BYTES}..{MAX_RANGE_BYTES} bytes"
            )
        expected = math.ceil(self.total_bytes / self.range_bytes)
        if not 0 <= expected <= MAX_RANGES or len(self.hashes) != expected:
            raise RangeError(
                f"{len(self.hashes)} range hashes for {self.total_bytes} bytes in ranges of "
                f"{self.range_bytes} (expected {expected}, at most {MAX_RANGES})"
            )
        if any(len(h) != HASH_BYTES for h in self.hashes):
            raise RangeError("a range hash is not 32 bytes")

    @classmethod
    def of(cls, data: bytes | memoryview, range_bytes: int = DEFAULT_RANGE_BYTES) -> RangeList:
        """The range list of `data` (hashes every range, so call it off the loop)."""
        view = memoryview(data)
        hashes = tuple(
            hashlib.sha256(view[a : a + range_bytes]).digest() for a in range(0, len(view), range_bytes)
        )
        return cls(len(view), range_bytes, hashes)

    @classmethod
    def from_wire(cls, total_bytes: int, range_bytes: int, packed: bytes) -> RangeList:
        """From a manifest's fields (hashes packed 32 bytes each); RangeError when malformed."""
        if len(packed) % HASH_BYTES or len(packed) > MAX_RANGES * HASH_BYTES:
            raise RangeError(f"a packed hash list of {len(packed)} bytes")
        hashes = tuple(packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES))
        return cls(total_bytes, range_bytes, hashes)

    @property
    def packed(self) -> bytes:
        return b"".join(self.hashes)

    @property
    def root(self) -> str:
        """sha256 hex over the tag, both sizes and the hash list: equal roots, equal blobs."""
        head = ROOT_TAG + self.range_bytes.to_bytes(8, "little") + self.total_bytes.to_bytes(8, "little")
        return hashlib.sha256(head + self.packed).hexdigest()

    def __len__(self) -> int:
        return len(self.hashes)

    def span(self, index: int) -> tuple[int, int]:
        """The byte range [start, stop) of range `index`."""
        if not 0 <= index < len(self.hashes):
            raise RangeError(f"range {index} of {len(self.hashes)}")
        start = index * self.range_bytes
        return start, min(start + self.range_bytes, self.total_bytes)

    def check(self, index: int, data: bytes) -> None:
        """Raises RangeError unless `data` is exactly range `index` (size, then sha256)."""
        start, stop = self.span(index)
        if len(data) != stop - start:
            raise RangeError(f"range {index} has {len(data)} bytes, expected {stop - start}")
        if hashlib.sha256(data).digest() != self.hashes[index]:
            raise RangeError(f"range {index} does not match its hash")


@dataclass(frozen=True)
class BlobLayout:
    """Which tensors, in which order, a blob concatenates: (name, bytes) per tensor."""

    tensors: tuple[tuple[str, int], ...]
    element_bytes: int = PLANES
    """The element size all its tensors share (1: they differ): the byte planes its ranges are cut in."""

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.tensors)

    def offsets(self) -> list[tuple[str, int, int]]:
        """(name, start, stop) of each tensor in the blob."""
        out, position = [], 0
        for name, size in self.tensors:
            out.append((name, position, position + size))
            position += size
        return out


def blob_layout(template: TensorTemplate, prefixes: tuple[str, ...]) -> BlobLayout:
    """The tensors of `template` whose names start with `prefixes`, grouped by prefix in that order and
    in the template's order within one (the model's parameter order: `DilocoTrainer.state_tensors`)."""
    tensors, sizes = [], set()
    for prefix in prefixes:
        for name, (dtype, shape) in template.items():
            if name.startswith(prefix):
                tensors.append((name, math.prod(shape) * dtype.itemsize))
                sizes.add(dtype.itemsize)
    return BlobLayout(tuple(tensors), sizes.pop() if len(sizes) == 1 else 1)


def shared_layout(template: TensorTemplate) -> BlobLayout:
    """θ_g then the outer momentum: the same bytes on every member after an agreed outer step."""
    return blob_layout(template, SHARED_PREFIXES)


def node_layout(template: TensorTemplate) -> BlobLayout:
    """The inner optimizer's moments: one node's own, fetched from one peer."""
    return blob_layout(template, NODE_PREFIXES)


def encode_range(data: bytes, element_bytes: int = PLANES) -> EncodedRange:
    """(encoding, bytes) of one range for the wire: its byte planes (`element_bytes` of them) in one
    zstd-1 frame when that is smaller, else the raw bytes (~0.7 GB/s: call it off the event loop)."""
    if element_bytes not in PLANE_WIDTHS or len(data) % element_bytes:
        return RAW, data
    planes = np.frombuffer(data, dtype=np.uint8).reshape(-1, element_bytes).T.copy()
    packed = zstandard.ZstdCompressor(level=1).compress(planes.data)
    return (f"zstd-planes{element_bytes}", packed) if len(packed) < len(data) else (RAW, data)


def decode_range(encoding: str, data: bytes, size: int) -> bytes:
    """The raw bytes of a range of `size` bytes sent as `encoding`; RangeError when it does not decode
    to exactly `size` bytes (never more is allocated)."""
    if encoding == RAW:
        return data
    width = int(encoding.removeprefix("zstd-planes")) if encoding in ENCODINGS else 0
    if not width or size % width:
        raise RangeError(f"unknown range encoding {encoding!r} for {size} bytes")
    try:
        # A frame that declares its size is decoded to that size whatever the bound: check it first.
        if zstandard.frame_content_size(data) not in (size, -1):
            raise RangeError(f"a range frame that declares {zstandard.frame_content_size(data)} bytes")
        flat = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise RangeError(f"a range that does not decode: {exc}") from None
    if len(flat) != size:
        raise RangeError(f"a range that decodes to {len(flat)} bytes, expected {size}")
    planes = np.frombuffer(flat, dtype=np.uint8).reshape(width, -1)
    return planes.T.tobytes()
