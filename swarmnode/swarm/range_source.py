"""What a node serves as state ranges: its newest snapshot at an asked outer step, cut into the ranges
of two blobs (snapshot/ranges.py: the shared part and this node's node part), each range kept as it
goes on the wire (compressed where smaller), with their range lists.

The ranges are built only when a peer asks (recoveries are rare; a node that nobody asks holds nothing
extra) on a worker thread that reads and verifies the snapshot file, never the live training state, so
the training thread and the event loop are untouched (README "Who owns what"). One entry is held at a
time — about 0.65× the training state for `small` (θ_g, outer momentum and the inner moments, encoded)
— and let go `HOLD_IDLE_S` after its last use. Concurrent first asks share one read. A snapshot that no
longer reads (rotated out mid-read, or corrupt) is answered as "no snapshot at that step". Every
snapshot of one outer step holds the same θ_g and momentum (they change only at outer steps), so a
newer snapshot of that step replaces the node part's root but keeps serving the same shared root."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarmnode.net.state_ranges import RangeManifest
from swarmnode.snapshot.format import SnapshotError, SnapshotInfo
from swarmnode.snapshot.ranges import (
    DEFAULT_RANGE_BYTES,
    BlobLayout,
    EncodedRange,
    RangeError,
    RangeList,
    encode_range,
    node_layout,
    shared_layout,
)
from swarmnode.snapshot.read import read_snapshot
from swarmnode.snapshot.tensors import LoadedSnapshot, TensorTemplate, tensor_bytes

logger = logging.getLogger(__name__)

HOLD_IDLE_S = 120.0
"""How long the blobs stay in memory after the last manifest or range asked of them."""


@dataclass(frozen=True)
class HeldRanges:
    """One snapshot's ranges, as they go on the wire, and its manifest; immutable, so the event loop
    may hand them out."""

    manifest: RangeManifest
    encoded: dict[str, tuple[EncodedRange, ...]]  # by root

    def range(self, root: str, index: int) -> EncodedRange | None:
        ranges = self.encoded.get(root)
        if ranges is None:
            return None
        if not 0 <= index < len(ranges):
            raise RangeError(f"range {index} of {len(ranges)}")
        return ranges[index]


def join_blob(loaded: LoadedSnapshot, layout: BlobLayout) -> bytes:
    return b"".join(tensor_bytes(loaded.tensors[name]).data for name, _ in layout.tensors)


def encode_blob(blob: bytes, ranges: RangeList) -> tuple[EncodedRange, ...]:
    view = memoryview(blob)
    return tuple(encode_range(bytes(view[slice(*ranges.span(i))])) for i in range(len(ranges)))


def read_ranges(info: SnapshotInfo, template: TensorTemplate, range_bytes: int) -> HeldRanges:
    """Reads and verifies a snapshot file, cuts its blobs into ranges and encodes them for the wire
    (on a worker thread); only the encoded ranges are kept."""
    loaded = read_snapshot(info.path, expected_id=info.snapshot_id, template=template)
    shared = join_blob(loaded, shared_layout(template))
    node = join_blob(loaded, node_layout(template))
    metadata = json.dumps(loaded.metadata)
    del loaded
    shared_ranges, node_ranges = RangeList.of(shared, range_bytes), RangeList.of(node, range_bytes)
    manifest = RangeManifest(info.outer_step, info.snapshot_id, shared_ranges, node_ranges, metadata)
    encoded = {
        shared_ranges.root: encode_blob(shared, shared_ranges),
        node_ranges.root: encode_blob(node, node_ranges),
    }
    return HeldRanges(manifest, encoded)


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

    def range(self, root: str, index: int) -> EncodedRange | None:
        held = self._held
        if held is None:
            return None
        self._touch()
        return held.range(root, index)

    def _touch(self) -> None:
        """Postpones the release of the held blobs to `hold_idle_s` from now."""
        if self._release is not None:
            self._release.cancel()
        self._release = asyncio.get_running_loop().call_later(self._hold_idle_s, self._let_go)

    def _let_go(self) -> None:
        self._held, self._release = None, None
