"""Recovery's fetch from many peers at once (docs/design.md "Recovery from many peers").

Given the peers that announced snapshots at one outer step, it asks up to `2K` of them for their range
manifests (snapshot/ranges.py, net/state_ranges.py), takes each only when signed by the node whose
signed announcement led to it, and trusts a shared-part root only when at least
`min_agreeing` (2) peers hand in range lists that hash to it — a root is recomputed here, never read from
the wire — and when their totals fit this node's own model. Up to K of the agreeing peers serve the
shared ranges (θ_g and outer momentum) in parallel, a bad one's ranges re-fetched from the others
(range_fetch.py); the node part (inner moments) and the metadata come from one of them, the freshest,
whose snapshot metadata must be of this run and step. Once every range verified, θ_g's bytes must hash
to the global digest that metadata records. Only then is a `LoadedSnapshot` built (tensors viewing the
received bytes; nothing unpickled) for `Recovery` to adopt as it adopts a peer's snapshot.

The node part from one peer is the long pole, so that peer goes first: the freshest peer is asked for
its manifest `HEAD_START_S` before the others (sooner once it answers), so its snapshot read need not
share the cores with theirs, and its node ranges are fetched as soon as its signed manifest is in, before
the shared root is agreed on. Each of them is still checked against that signed manifest as it arrives,
and none is used unless that peer's shared root turns out to be the agreed one: if it is not, that
fetch is cancelled and the node part comes from the freshest agreeing peer instead.

Failure semantics: any failure raises a `PeerFault` (fewer than two agreeing peers, a malformed
manifest, a range nobody left can serve, a digest that does not match) and nothing local has changed;
the caller falls back to fetching one whole snapshot from one peer. No range request outlives `fetch`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from swarmnode.net import rpc, state_ranges
from swarmnode.net.state_ranges import RangeManifest
from swarmnode.snapshot.format import SnapshotError, SnapshotHeader
from swarmnode.snapshot.metadata import SnapshotMetadata
from swarmnode.snapshot.ranges import BlobLayout, EncodedRange, node_layout, shared_layout
from swarmnode.snapshot.tensors import LoadedSnapshot, TensorTemplate
from swarmnode.swarm.announcements import Announcement
from swarmnode.swarm.recovery.range_fetch import FetchReport, RangeFetcher, RangeJob
from swarmnode.util.errors import PeerFault
from swarmnode.util.labels import FetchFailure

logger = logging.getLogger(__name__)

MANIFEST_TIMEOUT_S = 30.0
"""A peer may need a second or two to read its snapshot into ranges before it answers."""
MIN_AGREEING = 2
AGREEMENT_GRACE_S = 3.0
"""Once two peers agree on a root, how much longer the other manifests are waited for."""
HEAD_START_S = 1.0
"""How long the freshest peer (whose node part is the long pole) has to itself, reading its snapshot into
ranges, before the others are asked too: on one busy machine their reads would slow its own
(docs/benchmarks.md "Component measurements"); on separate machines it costs nothing, since they are asked as
soon as it answers. A silent freshest peer costs this long."""


class ManyPeersUnavailable(PeerFault):
    """No verified state could be put together from several peers; fall back to one."""


@dataclass(frozen=True)
class RangedState:
    """A peer state put together from ranges, verified, ready to adopt."""

    loaded: LoadedSnapshot
    node_peer: Announcement
    """The peer whose node part (inner moments, cursors, steps) was taken."""
    peers: tuple[str, ...]
    ranges_per_peer: dict[str, int]
    failures: dict[str, int]
    stages_s: dict[str, float] = field(default_factory=dict)


@dataclass
class _Assembly:
    """The blobs being filled, across fetcher runs with different node-part peers."""

    shared: np.ndarray
    """uint8, uninitialised: every byte is a verified range's before the blob is read."""
    node: np.ndarray
    shared_done: set[int] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    report: FetchReport = field(default_factory=FetchReport)

    def merge(self, report: FetchReport) -> None:
        self.report.ranges_per_peer.update(report.ranges_per_peer)
        self.report.failures.update(report.failures)
        self.report.duplicates += report.duplicates
        self.report.wire_bytes += report.wire_bytes
        self.dropped.update(report.dropped)


class GrpcRangePeer:
    """A `range_fetch.RangePeer` over gRPC."""

    def __init__(self, address: str, channels: rpc.ChannelCache | None) -> None:
        self.name, self._channels = address, channels

    async def fetch(self, root: str, index: int, timeout_s: float) -> EncodedRange:
        return await state_ranges.fetch_range(self.name, root, index, timeout_s, self._channels)


@dataclass
class _Run:
    """One fetcher run into `assembly`: the whole node part from `peer`, asked for from the start, and
    the shared ranges still missing, from the peers given once the shared root is agreed on (`share`)."""

    peer: Announcement
    manifest: RangeManifest
    assembly: _Assembly
    fetcher: RangeFetcher
    task: asyncio.Task[FetchReport]
    """`fetcher.run()`, started with the node part's jobs."""
    started: float = field(default_factory=time.perf_counter)
    merged: bool = False

    async def share(self, peers: Sequence[GrpcRangePeer], jobs: Sequence[RangeJob]) -> FetchReport:
        """Returns once every range is in (RangeFetchFailed: one that nobody left can serve)."""
        try:
            await self.fetcher.extend(peers, jobs)
            await self.fetcher.close()
            return await self.task
        finally:
            await self.cancel()  # (over already, unless this was cancelled)

    async def cancel(self) -> None:
        """Stops the run, its range requests with it; what it delivered counts in the assembly's report."""
        self.task.cancel()
        await asyncio.wait({self.task})
        if not self.task.cancelled():
            self.task.exception()  # (retrieved: a run given up on has no failure to raise)
        if not self.merged:
            self.merged = True
            self.assembly.merge(self.fetcher.report)


@dataclass
class _HeadStart:
    """The freshest peer's node part, fetched from the moment its manifest is in (`offer`)."""

    peer: Announcement
    start: Callable[[RangeManifest], _Run | None]
    run: _Run | None = None

    def offer(self, peer: Announcement, manifest: RangeManifest | None) -> None:
        if peer is self.peer and manifest is not None:
            self.run = self.start(manifest)

    async def cancel(self) -> None:
        if self.run is not None:
            await self.run.cancel()


class ManyPeerFetch:
    """Puts a peer state together from up to `max_peers` peers for one node's template."""

    def __init__(
        self,
        template: TensorTemplate,
        run_digest: str,
        max_peers: int,
        channels: rpc.ChannelCache | None = None,
        on_range_failure: Callable[[str], None] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        min_agreeing: int = MIN_AGREEING,
    ) -> None:
        self._template, self._run_digest, self._max_peers = dict(template), run_digest, max_peers
        self._channels, self._on_range_failure, self._on_bytes = channels, on_range_failure, on_bytes
        self._min_agreeing = min_agreeing
        self._shared, self._node = shared_layout(template), node_layout(template)

    def worth_trying(self, peers: Sequence[Announcement], outer_step: int) -> bool:
        """Whether enough peers announced `outer_step` that they could agree on its shared part."""
        return sum(p.outer_step == outer_step for p in peers) >= self._min_agreeing

    async def fetch(self, peers: Sequence[Announcement], outer_step: int) -> RangedState:
        """The state at `outer_step` from the peers that announced it; ManyPeersUnavailable else."""
        started = time.perf_counter()
        at_step = self._at_step(peers, outer_step)
        # Not zero-filled: that touched most of the state's pages before the first range was asked for
        # (docs/benchmarks.md "Component measurements"); the pages fault in as the ranges land.
        assembly = _Assembly(
            np.empty(self._shared.total_bytes, dtype=np.uint8),
            np.empty(self._node.total_bytes, dtype=np.uint8),
        )
        head = _HeadStart(at_step[0], lambda m: self._early_run(assembly, at_step[0], m, outer_step))
        try:
            agreeing = await self._agreeing(at_step[: 2 * self._max_peers], outer_step, head.offer)
            sources = agreeing[: self._max_peers]
            asked = time.perf_counter()
            run, meta = await self._fetch_blobs(assembly, sources, outer_step, head.run)
        finally:
            await head.cancel()  # (over already, unless this failed)
        fetched = time.perf_counter()
        await asyncio.to_thread(self._check_global_digest, assembly.shared, meta)
        loaded = self._loaded(run.manifest, meta, assembly.shared, assembly.node, assembly.report.wire_bytes)
        report = assembly.report
        return RangedState(
            loaded,
            run.peer,
            tuple(a.address for a, _ in sources),
            dict(report.ranges_per_peer),
            dict(report.failures),
            {
                "manifests": asked - started,
                "node_part_start": run.started - started,
                "fetch": fetched - asked,
                "verify": time.perf_counter() - fetched,
            },
        )

    def _at_step(self, peers: Sequence[Announcement], outer_step: int) -> list[Announcement]:
        """The peers that announced `outer_step`, freshest first (ManyPeersUnavailable: too few)."""
        at_step = sorted((p for p in peers if p.outer_step == outer_step), key=lambda p: p.freshness)[::-1]
        if len(at_step) < self._min_agreeing:
            raise ManyPeersUnavailable(
                FetchFailure.REFUSED,
                f"{len(at_step)} peer(s) at outer step {outer_step}, fewer than {self._min_agreeing}",
            )
        return at_step

    async def _agreeing(
        self,
        peers: Sequence[Announcement],
        outer_step: int,
        on_manifest: Callable[[Announcement, RangeManifest | None], None] | None = None,
    ) -> list[tuple[Announcement, RangeManifest]]:
        """The peers (freshest first) whose shared range list is the one most of them hand in, if at
        least `min_agreeing` do and it fits this node's model. `on_manifest` hears each answer as it
        comes (None: none usable)."""
        answers = await self._manifests(peers, outer_step, on_manifest)
        usable = [(p, m) for p in peers if (m := answers.get(p.node_id)) is not None]
        votes = Counter(m.shared.root for _, m in usable)
        if not votes or votes.most_common(1)[0][1] < self._min_agreeing:
            raise ManyPeersUnavailable(
                FetchFailure.REFUSED,
                f"no shared root at outer step {outer_step} that {self._min_agreeing} peers agree on "
                f"({len(usable)} of {len(peers)} manifests, {len(votes)} distinct roots)",
            )
        root = votes.most_common(1)[0][0]
        return [(p, m) for p, m in usable if m.shared.root == root]

    async def _manifests(
        self,
        peers: Sequence[Announcement],
        outer_step: int,
        on_manifest: Callable[[Announcement, RangeManifest | None], None] | None = None,
    ) -> dict[str, RangeManifest | None]:
        """The peers' manifests by node id: the first peer's at once, the others' `HEAD_START_S` later
        or once it answered. A dead or silent peer must not hold the recovery up: once K agree the rest
        are not awaited, and once two agree the others get `AGREEMENT_GRACE_S` more."""
        tasks = {asyncio.create_task(self._manifest(peers[0], outer_step)): peers[0]}
        later = list(peers[1:])
        answers: dict[str, RangeManifest | None] = {}
        deadline: float | None = None
        try:
            pending = set(tasks)
            while pending:
                timeout = HEAD_START_S if later else None
                if deadline is not None:
                    timeout = max(0.0, deadline - time.monotonic())
                done, pending = await asyncio.wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")
                for task in done:
                    peer = tasks[task]
                    answers[peer.node_id] = task.result()
                    if on_manifest is not None:
                        on_manifest(peer, answers[peer.node_id])
                if later:  # the first peer answered, or its head start is over
                    asked = {asyncio.create_task(self._manifest(p, outer_step)): p for p in later}
                    tasks.update(asked)
                    pending.update(asked)
                    later = []
                elif not done:  # the grace after two agreed is over
                    break
                votes = Counter(m.shared.root for m in answers.values() if m is not None)
                best = votes.most_common(1)[0][1] if votes else 0
                if best >= self._max_peers:
                    break
                if best >= self._min_agreeing and deadline is None:
                    deadline = time.monotonic() + AGREEMENT_GRACE_S
        finally:  # a manifest no longer waited for is not asked for any more
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        return answers

    async def _manifest(self, peer: Announcement, outer_step: int) -> RangeManifest | None:
        try:
            manifest = await state_ranges.get_range_manifest(
                peer.address, outer_step, MANIFEST_TIMEOUT_S, self._channels
            )
            if not manifest.signed_by(peer.node_id):
                raise ManyPeersUnavailable(
                    FetchFailure.INVALID, f"{peer.address}: manifest not signed by node {peer.node_id[:12]}"
                )
            self._check_sizes(manifest, outer_step)
        except PeerFault as exc:
            logger.info("no range manifest from %s: %s", peer.address, exc)
            if self._on_range_failure is not None:
                self._on_range_failure(str(exc.reason))
            return None
        return manifest

    def _check_sizes(self, manifest: RangeManifest, outer_step: int) -> None:
        for name, ranges, layout in (
            ("shared", manifest.shared, self._shared),
            ("node", manifest.node, self._node),
        ):
            if ranges.total_bytes != layout.total_bytes:
                raise ManyPeersUnavailable(
                    FetchFailure.INVALID,
                    f"its {name} part has {ranges.total_bytes} bytes, this model {layout.total_bytes}",
                )
        if manifest.outer_step != outer_step:
            raise ManyPeersUnavailable(FetchFailure.INVALID, f"a manifest of step {manifest.outer_step}")

    def _check_metadata(self, manifest: RangeManifest, outer_step: int) -> SnapshotMetadata:
        try:
            meta = SnapshotMetadata.parse(json.loads(manifest.metadata_json))
        except (ValueError, TypeError, SnapshotError) as exc:
            raise ManyPeersUnavailable(FetchFailure.INVALID, f"its metadata: {exc}") from None
        if meta.run_digest != self._run_digest or meta.outer_step != outer_step:
            raise ManyPeersUnavailable(
                FetchFailure.INVALID, "its metadata is of another run configuration or outer step"
            )
        return meta

    def _early_run(
        self, assembly: _Assembly, peer: Announcement, manifest: RangeManifest, outer_step: int
    ) -> _Run | None:
        """The node part of the freshest peer, fetched before the shared root is agreed on: every range
        is checked against its signed manifest, and none is used unless its shared root is agreed on."""
        try:
            self._check_metadata(manifest, outer_step)
        except ManyPeersUnavailable:
            return None  # (refused as the node part's source when its turn comes)
        logger.info("node part from %s: fetching before the shared root is agreed on", peer.address)
        return self._run(assembly, peer, manifest)

    def _run(self, assembly: _Assembly, peer: Announcement, manifest: RangeManifest) -> _Run:
        node_jobs = [RangeJob(manifest.node, i, pinned=peer.address) for i in range(len(manifest.node))]

        def deliver(job: RangeJob, data: bytes) -> None:
            start, stop = job.ranges.span(job.index)
            if job.pinned is None:
                assembly.shared[start:stop] = np.frombuffer(data, dtype=np.uint8)
                assembly.shared_done.add(job.index)
            else:
                assembly.node[start:stop] = np.frombuffer(data, dtype=np.uint8)
            if self._on_bytes is not None:
                self._on_bytes(len(data))

        peers = [GrpcRangePeer(peer.address, self._channels)]
        fetcher = RangeFetcher(peers, node_jobs, deliver, on_failure=self._on_range_failure, open_ended=True)
        return _Run(peer, manifest, assembly, fetcher, asyncio.create_task(fetcher.run()))

    async def _fetch_blobs(
        self,
        assembly: _Assembly,
        sources: list[tuple[Announcement, RangeManifest]],
        outer_step: int,
        early: _Run | None,
    ) -> tuple[_Run, SnapshotMetadata]:
        """Fills both blobs from `sources`, the node part from the first of them that serves it whole
        (`early`: its fetch, if already started): a node-part peer that fails is dropped and its
        successor's node part fetched instead, while the shared ranges already verified are kept."""
        if early is not None and early.peer is not sources[0][0]:
            logger.warning(
                "%s's shared root is not the agreed one: its node part is not used", early.peer.address
            )
            await early.cancel()
        refusals = []
        for node_peer, manifest in sources:
            if node_peer.address in assembly.dropped:
                continue
            addresses = [a.address for a, _ in sources if a.address not in assembly.dropped]
            try:
                meta = self._check_metadata(manifest, outer_step)
                run = early if early is not None and early.peer is node_peer else None
                run = run or self._run(assembly, node_peer, manifest)
                await self._share(run, addresses, assembly)
            except PeerFault as exc:
                refusals.append(f"{node_peer.address}: {exc}")
                assembly.dropped.add(node_peer.address)
                continue
            return run, meta
        raise ManyPeersUnavailable(FetchFailure.UNREACHABLE, "; ".join(refusals) or "no source left")

    async def _share(self, run: _Run, addresses: list[str], assembly: _Assembly) -> None:
        """Completes `run` with the shared ranges still missing, from any of `addresses`."""
        shared = run.manifest.shared
        missing = [RangeJob(shared, i) for i in range(len(shared)) if i not in assembly.shared_done]
        report = await run.share([GrpcRangePeer(a, self._channels) for a in addresses], missing)
        logger.info(
            "fetched %d shared + %d node ranges from %d peers: %s (failures %s, %d end-game copies)",
            len(missing),
            len(run.manifest.node),
            len(addresses),
            dict(report.ranges_per_peer),
            dict(report.failures) or "none",
            report.duplicates,
        )

    def _check_global_digest(self, shared: np.ndarray, meta: SnapshotMetadata) -> None:
        global_bytes = sum(size for name, size in self._shared.tensors if name.startswith("global/"))
        digest = hashlib.sha256(shared[:global_bytes].data).hexdigest()
        if digest != meta.global_digest:
            raise ManyPeersUnavailable(
                FetchFailure.HASH_MISMATCH,
                f"θ_g from the agreed ranges hashes to {digest[:12]}, not {meta.global_digest[:12]}",
            )

    def _loaded(
        self,
        manifest: RangeManifest,
        meta: SnapshotMetadata,
        shared: np.ndarray,
        node: np.ndarray,
        wire_bytes: int,
    ) -> LoadedSnapshot:
        tensors = {**self._views(shared, self._shared), **self._views(node, self._node)}
        for name, (dtype, shape) in self._template.items():
            if name.startswith("model/"):  # never fetched: adopting restarts the round from θ_g
                tensors[name] = tensors["global/" + name.removeprefix("model/")]
            elif name.startswith("rng/"):  # never fetched: the RNG stays this node's own
                tensors[name] = torch.zeros(shape, dtype=dtype)
        header = SnapshotHeader(json.loads(manifest.metadata_json), meta.layout, ())
        return LoadedSnapshot(manifest.snapshot_id, header, tensors, wire_bytes)

    def _views(self, blob: np.ndarray, layout: BlobLayout) -> dict[str, torch.Tensor]:
        views = {}
        for name, start, stop in layout.offsets():
            dtype, shape = self._template[name]
            count = (stop - start) // dtype.itemsize
            views[name] = torch.frombuffer(blob, dtype=dtype, count=count, offset=start).view(shape)
        return views
