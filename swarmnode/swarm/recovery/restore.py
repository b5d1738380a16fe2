"""Coming back after a crash: pick the freshest verified state, restore it, and leave a receipt.

Candidates are this node's own snapshot files of this run (the checkpointer's scan: other runs' and
nodes' files never compete) and the snapshots its peers announced in the DHT (same run digest only),
tried freshest first (outer step; at the same step its own before a peer's; then inner step). A
candidate that fails (unreachable, refused, hash mismatch, truncated, malformed) is counted and the
next one is tried.
Nothing local changes before a new state has been fully read and verified.

With `--recovery-peers K` above 1, a peer candidate's outer step is first tried from many peers at
once (many_peers.py: the shared θ_g and outer momentum as verified ranges from up to K peers that agree
on them, the inner moments and cursors from one); if that fails for any reason, the same candidates are
tried one whole snapshot at a time, as with K = 1.

The node's own data cursor comes from its own snapshot when that is what it restored; otherwise from the
freshest of its own last DHT announcement and its own older snapshots; else it starts its shard afresh.

A receipt is one JSON line appended to DATA_DIR/receipts.jsonl per start: where the state came from,
which snapshot, the seconds of each stage (look-up, fetch, verify, load), the cursor used, and the first
loss after vs. the loss the snapshot recorded; from many peers also the peers used, the ranges each
served and the range failures by reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swarmnode.core.training import TrainingRun
from swarmnode.snapshot.checkpointer import LocalSnapshot, quarantine
from swarmnode.snapshot.feed import ByteFeed, FeedClosed
from swarmnode.snapshot.format import SnapshotError, SnapshotMismatch
from swarmnode.snapshot.metadata import SnapshotMetadata
from swarmnode.snapshot.read import read_snapshot, read_snapshot_stream
from swarmnode.snapshot.tensors import LoadedSnapshot
from swarmnode.swarm.announcements import Announcement
from swarmnode.swarm.recovery.many_peers import ManyPeerFetch, RangedState
from swarmnode.util.errors import PeerFault, RankFailed
from swarmnode.util.labels import CursorSource, FetchFailure, RecoverySource
from swarmnode.util.threads import TrainingThread

logger = logging.getLogger(__name__)

RECEIPTS_FILE = "receipts.jsonl"

Fetcher = Callable[[Announcement, Callable[[bytes], Awaitable[None]]], Awaitable[str]]
"""Downloads a peer's announced (or newer) snapshot to a path, verified against its id, handing each
arriving chunk to the callback too, and returns the id; raises on any failure with an exception that has
a `reason` attribute (see rpc.PeerUnavailable)."""


@dataclass
class Receipt:
    source: RecoverySource
    snapshot_id: str | None = None
    peer: str | None = None
    bytes: int = 0
    outer_step: int = 0
    inner_step: int = 0
    global_digest: str | None = None
    """sha256 of the restored θ_g (as members' status reports it)."""
    cursor: dict[str, int] = field(default_factory=dict)
    cursor_source: CursorSource = CursorSource.FRESH
    stages_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    loss_before: float | None = None
    first_loss_after: float | None = None
    failed_candidates: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)
    """Recovery from many peers: the agreeing peers asked for ranges (the node part's first)."""
    ranges_per_peer: dict[str, int] = field(default_factory=dict)
    range_failures: dict[str, int] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Candidate:
    outer_step: int
    inner_step: int
    local: LocalSnapshot | None = None  # own snapshot file
    announcement: Announcement | None = None  # a peer's

    @property
    def rank(self) -> tuple[int, bool, int]:
        """Freshest first: outer step, then this node's own snapshot before a peer's of the same step
        (a peer's gives the same θ_g but not this node's progress in its round), then inner step."""
        return self.outer_step, self.local is not None, self.inner_step

    @property
    def path(self) -> Path | None:
        return self.local.info.path if self.local is not None else None

    def describe(self) -> str:
        if self.path is not None:
            return f"own snapshot {self.path.name[:40]}"
        assert self.announcement is not None
        return f"{self.announcement.address} snapshot {self.announcement.snapshot_id[:12]}"


@dataclass(frozen=True)
class CursorChoice:
    cursor: dict[str, int] | None
    source: CursorSource
    steps: tuple[int, int]  # (inner_step, tokens) of this node as of that cursor


CursorRule = Callable[[SnapshotMetadata], "CursorChoice"]
"""Picks this node's cursor given the metadata of the peer snapshot being adopted."""


class Recovery:
    """One start's recovery: candidates in, a restored `TrainingRun` and a receipt out."""

    def __init__(
        self,
        run: TrainingRun,
        training: TrainingThread,
        fetch: Fetcher,
        on_failure: Callable[[str], None],
        many: ManyPeerFetch | None = None,
    ) -> None:
        """Restores run on `training` (the owner of `run`); fetches and decoding on the event loop and
        worker threads. `many`: try recovering from many peers at once first (None: one at a time)."""
        self.run, self.training, self.fetch, self.on_failure = run, training, fetch, on_failure
        self.many = many
        self.verified: set[str] = set()
        self.local: list[LocalSnapshot] = []

    async def recover(
        self,
        peers: list[Announcement],
        own: Announcement | None,
        local: list[LocalSnapshot],
        lookup_s: float,
    ) -> Receipt:
        """Restore the freshest candidate that verifies among `local` (this node's own snapshots of this
        run, from the checkpointer's scan) and `peers`; else start fresh at this node's own cursor."""
        self.local = list(local)
        own_candidates = [Candidate(s.info.outer_step, s.info.inner_step, local=s) for s in self.local]
        candidates = sorted(
            own_candidates + [Candidate(a.outer_step, a.inner_step, announcement=a) for a in peers],
            key=lambda c: c.rank,
            reverse=True,
        )
        failed: list[str] = []

        def freshest_own(meta: SnapshotMetadata) -> CursorChoice:
            return self._own_cursor(own, meta.swarm_cursors)

        tried_ranges: set[int] = set()
        for candidate in candidates:
            receipt = None
            if candidate.announcement is not None and candidate.outer_step not in tried_ranges:
                tried_ranges.add(candidate.outer_step)
                receipt = await self._try_many(peers, candidate.outer_step, freshest_own, failed)
            if receipt is None:
                receipt = await self._try(candidate, freshest_own, failed)
            if receipt is not None:
                receipt.stages_s["lookup"] = lookup_s
                receipt.failed_candidates = failed
                return receipt
        cursor = self._own_cursor(own)
        if cursor.cursor is not None:
            await self.training.run(self.run.resume_cursor, cursor.cursor, cursor.steps)
        return Receipt(
            source=RecoverySource.FRESH,
            cursor=self.run.loader.state_dict(),
            cursor_source=cursor.source,
            stages_s={"lookup": lookup_s},
            failed_candidates=failed,
        )

    async def _try(self, candidate: Candidate, choose: CursorRule, failed: list[str]) -> Receipt | None:
        try:
            if candidate.local is not None:
                return await self.training.run(self._restore_local, candidate.local)
            assert candidate.announcement is not None
            return await self._restore_peer(candidate.announcement, choose)
        except SnapshotMismatch as exc:  # sound, but another configuration's: skip it, keep the file
            self._refused(candidate, FetchFailure.INVALID, exc, failed)
        except SnapshotError as exc:
            if candidate.path is not None:
                quarantine(candidate.path, str(exc))
            self._refused(candidate, FetchFailure.INVALID, exc, failed)
        except PeerFault as exc:
            self._refused(candidate, exc.reason, exc, failed)
        except OSError as exc:  # a disk that fails, or a socket a library let through
            self._refused(candidate, FetchFailure.UNREACHABLE, exc, failed)
        except RankFailed:  # this node's own rank broke: no other candidate helps
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here: never the peer's fault; go on with the next
            logger.exception("recovery candidate %s failed unexpectedly", candidate.describe())
            self._refused(candidate, FetchFailure.INTERNAL, exc, failed)
        return None

    async def _try_many(
        self, peers: list[Announcement], outer_step: int, choose: CursorRule, failed: list[str]
    ) -> Receipt | None:
        """The state at `outer_step` from many peers at once; None (counted, noted) on any failure."""
        if self.many is None or not self.many.worth_trying(peers, outer_step):
            return None  # (one peer at that step: nothing to agree on, nothing to count)
        started = time.perf_counter()
        try:
            state = await self.many.fetch(peers, outer_step)
            receipt = await self.training.run(
                self._adopt_peer_snapshot, state.node_peer, state.loaded, choose
            )
        except (PeerFault, SnapshotError) as exc:
            reason = exc.reason if isinstance(exc, PeerFault) else FetchFailure.INVALID
            self._many_refused(outer_step, reason, exc, failed)
            return None
        except RankFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here: fall back to one peer at a time
            logger.exception("recovery from many peers at outer step %d failed unexpectedly", outer_step)
            self._many_refused(outer_step, FetchFailure.INTERNAL, exc, failed)
            return None
        return self._many_receipt(receipt, state, started)

    def _many_refused(
        self, outer_step: int, reason: FetchFailure, exc: BaseException, failed: list[str]
    ) -> None:
        self.on_failure(reason)
        failed.append(f"many peers at outer step {outer_step}: {reason}: {exc}")
        logger.warning("recovery from many peers refused: %s; one peer at a time now", failed[-1])

    @staticmethod
    def _many_receipt(receipt: Receipt, state: RangedState, started: float) -> Receipt:
        receipt.peers = list(state.peers)
        receipt.ranges_per_peer = dict(state.ranges_per_peer)
        receipt.range_failures = dict(state.failures)
        receipt.stages_s.update(state.stages_s)
        receipt.seconds = time.perf_counter() - started
        return receipt

    def _refused(
        self, candidate: Candidate, reason: FetchFailure, exc: BaseException, failed: list[str]
    ) -> None:
        if candidate.path is None:  # only a peer's candidate counts as a failed fetch
            self.on_failure(reason)
        failed.append(f"{candidate.describe()}: {reason}: {exc}")
        logger.warning("recovery candidate refused: %s; trying the next one", failed[-1])

    async def repair(self, peers: list[Announcement], min_outer_step: int) -> Receipt | None:
        """Adopt the freshest of `peers`' snapshots that verifies and is at least at `min_outer_step`
        (an announcement is only a claim: the snapshot itself must be that far). The data cursor
        becomes this node's record in the adopted lineage, so work the swarm never received is trained
        again; step counters are kept. A catch-up during training: no receipt is written."""
        steps = (self.run.sample.inner_step, self.run.sample.tokens)

        def lineage_or_fresh(meta: SnapshotMetadata) -> CursorChoice:
            """Only batches the adopted θ_g holds count: this node's record in its lineage, else none."""
            if meta.outer_step < min_outer_step:
                raise SnapshotError(f"the peer's snapshot is not at outer step {min_outer_step} as announced")
            mine = self._lineage_cursor(meta.swarm_cursors)
            if mine is not None:
                return CursorChoice(mine, CursorSource.ROUND_METADATA, steps)
            taken = self._takeover_cursor(meta.swarm_cursors)
            if taken is not None:
                return CursorChoice(taken, CursorSource.TAKEOVER, steps)
            return CursorChoice(
                {"shard": self.run.loader.shard, "epoch": 0, "position": 0}, CursorSource.FRESH, steps
            )

        failed: list[str] = []
        for peer in peers:
            candidate = Candidate(peer.outer_step, peer.inner_step, announcement=peer)
            receipt = await self._try(candidate, lineage_or_fresh, failed)
            if receipt is not None:
                return receipt
        return None

    def _restore_local(self, local: LocalSnapshot) -> Receipt:
        path = local.info.path
        started = time.perf_counter()
        loaded = read_snapshot(path, expected_id=local.info.snapshot_id, template=self.run.template())
        self.verified.add(loaded.snapshot_id)
        meta = SnapshotMetadata.parse(loaded.metadata)  # the very bytes verified, not the scan's read
        if meta.run_digest != self.run.identity.run_digest or meta.node_id != self.run.identity.node_id:
            raise SnapshotMismatch("it belongs to another run configuration or node")
        verified = time.perf_counter()
        self.run.restore_own(loaded, meta)
        done = time.perf_counter()
        return Receipt(
            source=RecoverySource.LOCAL,
            snapshot_id=loaded.snapshot_id,
            bytes=path.stat().st_size,
            outer_step=self.run.progress.outer_step,
            inner_step=self.run.progress.inner_step,
            cursor=self.run.loader.state_dict(),
            cursor_source=CursorSource.OWN_SNAPSHOT,
            stages_s={"verify": verified - started, "load": done - verified},
            seconds=done - started,
            loss_before=meta.last_loss,
            global_digest=self.run.sample.global_digest,
        )

    async def _restore_peer(self, peer: Announcement, choose: CursorRule) -> Receipt:
        """Fetch a peer's snapshot while a worker thread decodes and verifies it as it arrives (the
        stages overlap), then adopt it."""
        feed = ByteFeed()
        decoding = asyncio.create_task(asyncio.to_thread(self._decode, feed))
        started = time.perf_counter()
        try:
            snapshot_id = await self.fetch(peer, feed.push)
            feed.close()
            fetched = time.perf_counter()
            loaded = await decoding
            decoded = time.perf_counter()
        except FeedClosed:  # the decoder failed first: its error is the one that explains
            await decoding
            raise
        except BaseException as exc:
            feed.close(exc)
            with contextlib.suppress(Exception):
                await decoding
            raise
        if loaded.snapshot_id != snapshot_id:
            raise SnapshotError("the decoded stream's sha256 differs from the fetched bytes'")
        receipt = await self.training.run(self._adopt_peer_snapshot, peer, loaded, choose)
        receipt.stages_s.update(fetch=fetched - started, verify=decoded - fetched)
        receipt.seconds = time.perf_counter() - started
        return receipt

    def _decode(self, feed: ByteFeed) -> LoadedSnapshot:
        try:
            return read_snapshot_stream(feed, template=self.run.template())  # type: ignore[arg-type]
        except BaseException:
            feed.abandon()  # else a download the reader no longer drains would wait forever
            raise

    def _adopt_peer_snapshot(self, peer: Announcement, loaded: LoadedSnapshot, choose: CursorRule) -> Receipt:
        meta = SnapshotMetadata.parse(loaded.metadata)
        if meta.run_digest != self.run.identity.run_digest:
            raise SnapshotMismatch("its run digest differs from the one it announced")
        started = time.perf_counter()
        cursor = choose(meta)
        self.run.restore_from_peer(loaded, meta, cursor.cursor, cursor.steps)
        if cursor.cursor is None:
            logger.info(
                "no cursor of this node's own survives: starting shard %d afresh", self.run.loader.shard
            )
        return Receipt(
            source=RecoverySource.PEER,
            snapshot_id=loaded.snapshot_id,
            peer=peer.address,
            bytes=loaded.compressed_bytes,
            outer_step=self.run.progress.outer_step,
            inner_step=self.run.progress.inner_step,
            cursor=self.run.loader.state_dict(),
            cursor_source=cursor.source,
            stages_s={"load": time.perf_counter() - started},
            loss_before=meta.last_loss,
            global_digest=self.run.sample.global_digest,
        )

    def _lineage_cursor(self, lineage: Mapping[str, dict[str, int]] | None) -> dict[str, int] | None:
        """This node's record in a lineage's round metadata (`swarm_cursors`), if it can resume it."""
        mine = lineage.get(self.run.identity.node_id) if lineage is not None else None
        return dict(mine) if mine and self._resumable(mine) else None

    def _takeover_cursor(self, lineage: Mapping[str, dict[str, int]] | None) -> dict[str, int] | None:
        """The furthest committed cursor other nodes reached on this node's shard in the lineage: where
        a shard this node took over (swarm/shards.py) goes on, so no batch is lost or trained twice."""
        shard = self.run.loader.shard
        on_shard = [
            dict(cursor)
            for node, cursor in (lineage or {}).items()
            if node != self.run.identity.node_id and cursor.get("shard") == shard and self._resumable(cursor)
        ]
        return max(on_shard, key=lambda c: (c["epoch"], c["position"]), default=None)

    def _resumable(self, cursor: Any) -> bool:
        """Whether this node's loader can resume `cursor` (its shard, within it): a record that came
        from a peer or the DHT is checked before it is chosen, so a bad one is passed over, not fatal."""
        try:
            self.run.loader.check_state_dict(cursor)
        except (ValueError, TypeError, KeyError):
            return False
        return True

    def _own_cursor(
        self, own: Announcement | None, lineage: Mapping[str, dict[str, int]] | None = None
    ) -> CursorChoice:
        """This node's cursor for the adopted state. The lineage's record of this node (round metadata
        carried by every snapshot: how far its batches are in θ_g) is exact and wins; without one (a
        node that never averaged with this lineage), the freshest of its own last announcement and its
        own snapshots' committed cursors (this run's only: the scan left other configurations out);
        else afresh (docs/design.md "The swarm": recovery on start)."""
        mine = self._lineage_cursor(lineage)
        if mine is not None:
            steps = (own.inner_step, 0) if own is not None else (0, 0)
            return CursorChoice(mine, CursorSource.ROUND_METADATA, steps)
        options = [CursorChoice(None, CursorSource.FRESH, (0, 0))]
        taken = self._takeover_cursor(lineage)
        if taken is not None:  # (an own snapshot or announcement further on the shard still wins)
            options.append(CursorChoice(taken, CursorSource.TAKEOVER, (0, 0)))
        if own is not None and own.cursor is not None:
            options.append(CursorChoice(own.cursor, CursorSource.ANNOUNCEMENT, (own.inner_step, 0)))
        for local in self.local:  # a file set aside as corrupt still says how far this node got
            meta = local.meta
            steps = (meta.inner_step, meta.tokens)
            options.append(CursorChoice(dict(meta.committed_cursor), CursorSource.OWN_SNAPSHOT, steps))
        usable = [o for o in options if o.cursor is None or self._resumable(o.cursor)]
        return max(
            usable, key=lambda o: (-1, -1) if o.cursor is None else (o.cursor["epoch"], o.cursor["position"])
        )


def append_receipt(data_dir: Path, receipt: Receipt) -> None:
    """Append a receipt; a full disk is logged, never fatal (the log line carries the receipt too)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with (data_dir / RECEIPTS_FILE).open("a") as f:
            f.write(receipt.to_json() + "\n")
    except OSError as exc:
        logger.error("restart receipt not written to %s: %s", data_dir / RECEIPTS_FILE, exc)


def read_receipts(data_dir: Path) -> list[dict[str, Any]]:
    path = data_dir / RECEIPTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
