"""What a node serves as state ranges: its newest snapshot at an asked outer step, cut into the ranges
of two blobs (snapshot/ranges.py: the shared part and this node's node part), each range kept as it
goes on the wire (compressed where smaller), with their range lists.

The ranges are built only when a peer asks (recoveries are rare; a node that nobody asks holds nothing
extra) on a worker thread that reads and verifies the snapshot file, never the live training state, so
the training thread and the event loop are untouched (docs/design.md "Who owns what"). One entry is
held at a time — θ_g, the outer momentum and the inner moments, less as ranges are sent compressed — and let
go `HOLD_IDLE_S` after its last use. Concurrent first asks share one read. A snapshot that no longer reads
(rotated out mid-read, or corrupt) is answered as "no snapshot at that step". Every snapshot of one outer step
holds the same θ_g and momentum (they change only at outer steps), so a newer snapshot of that step replaces
the node part's root but keeps serving the same shared root.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable

import torch

from swarmnode.net.state_ranges import RangeManifest
from swarmnode.snapshot.format import SnapshotError, SnapshotInfo
from swarmnode.snapshot.ranges import (
    DEFAULT_RANGE_BYTES,
    PLANES,
    RAW,
    BlobLayout,
    EncodedRange,
    RangeError,
    RangeList,
    encode_range,
    node_layout,
    shared_layout,
)
from swarmnode.snapshot.read import read_snapshot
from swarmnode.snapshot.tensors import TensorTemplate, tensor_bytes

logger = logging.getLogger(__name__)

HOLD_IDLE_S = 120.0
"""How long the blobs stay in memory after the last manifest or range asked of them."""


class HeldRanges:
    """One snapshot's manifest and its ranges. Each range is encoded for the wire the first time it is
    asked for (on a worker thread, overlapping the transfer instead of delaying the manifest), and the raw
    copy is then dropped. Only the event loop replaces an entry; what a worker thread sees is immutable
    bytes."""

    def __init__(
        self,
        manifest: RangeManifest,
        raw: dict[str, list[bytes]],
        element_bytes: dict[str, int] | None = None,
    ) -> None:
        self.manifest = manifest
        self._ranges: dict[str, list[EncodedRange]] = {
            root: [(RAW, data) for data in pieces] for root, pieces in raw.items()
        }
        self._element_bytes = element_bytes or {}
        """Per root: the element size its ranges are cut in byte planes by (`ranges.encode_range`)."""
        self._encoded: set[tuple[str, int]] = set()

    async def range(self, root: str, index: int) -> EncodedRange | None:
        ranges = self._ranges.get(root)
        if ranges is None:
            return None
        if not 0 <= index < len(ranges):
            raise RangeError(f"range {index} of {len(ranges)}")
        if (root, index) not in self._encoded:
            width = self._element_bytes.get(root, PLANES)
            encoded = await asyncio.to_thread(encode_range, ranges[index][1], width)
            if (root, index) not in self._encoded:  # (two asks at once: the first to finish is kept)
                ranges[index] = encoded
                self._encoded.add((root, index))
        return ranges[index]


def cut_blob(tensors: dict[str, torch.Tensor], layout: BlobLayout, range_bytes: int) -> list[bytes]:
    """The blob of `layout` as range-sized pieces, cut straight from the tensors (never joined whole),
    each tensor dropped from `tensors` once cut: memory stays at about one copy of the state."""
    pieces: list[bytes] = []
    pending: list[memoryview] = []
    filled = 0
    for name, _ in layout.tensors:
        view = memoryview(tensor_bytes(tensors.pop(name)).data).cast("B")
        position = 0
        while position < len(view):
            take = min(range_bytes - filled, len(view) - position)
            pending.append(view[position : position + take])
            filled, position = filled + take, position + take
            if filled == range_bytes:
                pieces.append(b"".join(pending))
                pending, filled = [], 0
    if pending:
        pieces.append(b"".join(pending))
    return pieces


def hashed(pieces: list[bytes], range_bytes: int) -> RangeList:
    total = sum(len(piece) for piece in pieces)
    return RangeList(total, range_bytes, tuple(hashlib.sha256(piece).digest() for piece in pieces))


def read_ranges(info: SnapshotInfo, template: TensorTemplate, range_bytes: int) -> HeldRanges:
    """Reads and verifies a snapshot file and cuts its blobs into hashed ranges (on a worker thread)."""
    loaded = read_snapshot(info.path, expected_id=info.snapshot_id, template=template)
    tensors = dict(loaded.tensors)
    metadata = json.dumps(loaded.metadata)
    del loaded
    for name in [n for n in tensors if n.startswith("model/")]:
        del tensors[name]  # never served: a peer adopting this state restarts its round from θ_g
    shared_blob, node_blob = shared_layout(template), node_layout(template)
    shared = cut_blob(tensors, shared_blob, range_bytes)
    node = cut_blob(tensors, node_blob, range_bytes)
    shared_ranges, node_ranges = hashed(shared, range_bytes), hashed(node, range_bytes)
    manifest = RangeManifest(info.outer_step, info.snapshot_id, shared_ranges, node_ranges, metadata)
    return HeldRanges(
        manifest,
        {shared_ranges.root: shared, node_ranges.root: node},
        {shared_ranges.root: shared_blob.element_bytes, node_ranges.root: node_blob.element_bytes},
    )


class SnapshotRanges:
    """A `state_ranges.RangeProvider` over a node's snapshot catalog."""

    def __init__(
        self,
        snapshots: Callable[[], list[SnapshotInfo]],
        template: TensorTemplate,
        range_bytes: int = DEFAULT_RANGE_BYTES,
        hold_idle_s: float = HOLD_IDLE_S,
    ) -> None:
        """`snapshots`: the complete snapshots served now (cheap: called on the event loop)."""
        self._snapshots, self._template, self._range_bytes = snapshots, dict(template), range_bytes
        self._hold_idle_s = hold_idle_s
        self._held: HeldRanges | None = None
        self._reading = asyncio.Lock()
        self._release: asyncio.TimerHandle | None = None

    async def manifest(self, outer_step: int) -> RangeManifest | None:
        at_step = [s for s in self._snapshots() if s.outer_step == outer_step]
        if not at_step:
            return None
        newest = max(at_step, key=lambda s: (s.inner_step, s.created_at))
        async with self._reading:
            held = self._held
            if held is None or held.manifest.snapshot_id != newest.snapshot_id:
                held = await self._read(newest)
                if held is None:
                    return None
                self._held = held
        self._touch()
        return held.manifest

    async def _read(self, info: SnapshotInfo) -> HeldRanges | None:
        started = time.perf_counter()
        try:
            held = await asyncio.to_thread(read_ranges, info, self._template, self._range_bytes)
        except (SnapshotError, OSError) as exc:
            logger.warning("cannot serve snapshot %s as ranges: %s", info.snapshot_id[:12], exc)
            return None
        logger.info(
            "serving snapshot %s (outer step %d) as %d + %d ranges (read in %.2f s)",
            info.snapshot_id[:12],
            info.outer_step,
            len(held.manifest.shared),
            len(held.manifest.node),
            time.perf_counter() - started,
        )
        return held

    async def range(self, root: str, index: int) -> EncodedRange | None:
        held = self._held
        if held is None:
            return None
        self._touch()
        return await held.range(root, index)

    def _touch(self) -> None:
        """Postpones the release of the held blobs to `hold_idle_s` from now."""
        if self._release is not None:
            self._release.cancel()
        self._release = asyncio.get_running_loop().call_later(self._hold_idle_s, self._let_go)

    def _let_go(self) -> None:
        self._held, self._release = None, None
