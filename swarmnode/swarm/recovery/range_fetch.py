"""Fetching byte ranges from several peers at once, each range verified, a bad peer's work re-assigned.

Every peer gets `streams_per_peer` workers; a free worker takes the next range in this order: a range
pinned to its peer (the node part, which only that peer holds), any unpinned range not yet taken, and —
once none is left (the end game) — a copy of an unpinned range still in flight on another peer, so a
slow peer's last ranges are fetched again by a fast one and the first verified copy wins (the other is
cancelled). A range that arrives is checked (size, sha256) before it is delivered.

A fetch may be open-ended: it starts with some peers and jobs (recovery's node part, from one peer,
before the shared part's root is agreed on) and takes more of both while it runs (`extend`) until told
that no more will come (`close`); only then can it be over.

Failure semantics: a range that fails goes back to the queue, never to the peer that failed it unless
it is pinned there. A peer that sends a range of the wrong size or hash is lying and is dropped at once;
one that times out or is refused is dropped after `max_failures`. Ranges may travel compressed
(snapshot/ranges.py `decode_range`, bounded by the range's size): one that does not decode is a lie
too. Every failure is counted by reason (`on_failure`). The fetch fails (`RangeFetchFailed`) only when
a range has no peer left, among those given so far, that could serve it; nothing is delivered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swarmnode.snapshot.ranges import EncodedRange, RangeError, RangeList, decode_range
from swarmnode.util.errors import PeerFault
from swarmnode.util.labels import FetchFailure

logger = logging.getLogger(__name__)

STREAMS_PER_PEER = 2
"""Ranges asked of one peer at once: one in flight while the next request crosses the link."""
MAX_FAILURES = 2
MIN_RANGE_TIMEOUT_S = 10.0
MIN_RATE_BYTES_S = 256 << 10
"""A range may take 10 s plus its bytes at this rate (4 s per MiB) before it is another peer's."""


class RangePeer(Protocol):
    """Where ranges come from: `fetch` returns a range as sent (encoding, bytes) and raises a PeerFault
    (with a reason) for what the peer did."""

    name: str

    async def fetch(self, root: str, index: int, timeout_s: float) -> EncodedRange: ...


class RangeFetchFailed(PeerFault):
    """Some range has no peer left that could serve it."""


@dataclass(frozen=True)
class RangeJob:
    """Range `index` of the blob `ranges`; `pinned`: the only peer that may serve it."""

    ranges: RangeList
    index: int
    pinned: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.ranges.root, self.index


@dataclass
class FetchReport:
    ranges_per_peer: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    """By reason (labels.FetchFailure)."""
    duplicates: int = 0
    """End-game copies fetched of a range another peer still had in flight."""
    wire_bytes: int = 0
    """Bytes of the delivered ranges as they travelled (compressed where smaller)."""
    dropped: list[str] = field(default_factory=list)


_Arrived = tuple[bytes, int]
"""A verified range's raw bytes, and how many bytes it travelled as."""


def _decoded_and_checked(job: RangeJob, encoding: str, sent: bytes) -> bytes:
    start, stop = job.ranges.span(job.index)
    data = decode_range(encoding, sent, stop - start)
    job.ranges.check(job.index, data)
    return data


def range_timeout_s(nbytes: int) -> float:
    return MIN_RANGE_TIMEOUT_S + nbytes / MIN_RATE_BYTES_S


class RangeFetcher:
    """One fetch of `jobs` from `peers`; `deliver(job, data)` receives each verified range once.
    `open_ended`: more peers and jobs may come (`extend`) until `close`."""

    def __init__(
        self,
        peers: Sequence[RangePeer],
        jobs: Sequence[RangeJob],
        deliver: Callable[[RangeJob, bytes], None],
        *,
        streams_per_peer: int = STREAMS_PER_PEER,
        max_failures: int = MAX_FAILURES,
        on_failure: Callable[[str], None] | None = None,
        open_ended: bool = False,
    ) -> None:
        self._peers, self._deliver, self._streams = list(peers), deliver, streams_per_peer
        self._max_failures, self._on_failure = max_failures, on_failure
        self._pending: deque[RangeJob] = deque(jobs)
        self._in_flight: dict[tuple[str, int], dict[str, asyncio.Task[_Arrived]]] = {}
        self._jobs = {job.key: job for job in jobs}
        self._done: set[tuple[str, int]] = set()
        self._refused_by: dict[tuple[str, int], set[str]] = {}
        self._failures: Counter[str] = Counter()
        self._dropped: set[str] = set()
        self._changed = asyncio.Condition()
        self._stuck: RangeJob | None = None
        self._closed = not open_ended
        self._group: asyncio.TaskGroup | None = None
        self.report = FetchReport()

    async def run(self) -> FetchReport:
        """Fetches every job; raises RangeFetchFailed when one cannot be served by anyone left."""
        self._check_stuck()  # (no peer at all)
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._until_over())  # keeps the group open for `extend`'s workers
                for peer in self._peers:
                    self._start(peer)
        finally:  # a cancelled or failed fetch leaves no range request behind
            self._group = None
            for copies in self._in_flight.values():
                for task in copies.values():
                    task.cancel()
        if self._stuck is not None:
            job = self._stuck
            raise RangeFetchFailed(
                FetchFailure.UNREACHABLE,
                f"range {job.index} of {job.ranges.root[:12]}: no peer left to serve it "
                f"(dropped: {', '.join(self.report.dropped) or 'none'})",
            )
        assert len(self._done) == len(self._jobs), "a fetch over with ranges neither won nor stuck"
        return self.report

    async def extend(self, peers: Sequence[RangePeer], jobs: Sequence[RangeJob]) -> None:
        """More peers (one already here is kept as it is) and more jobs for an open-ended fetch, running
        or not yet."""
        assert not self._closed, "extending a fetch that was closed"
        async with self._changed:
            known = {p.name for p in self._peers}
            for peer in peers:
                if peer.name not in known:
                    known.add(peer.name)
                    self._peers.append(peer)
                    if self._group is not None and not self._over():
                        self._start(peer)
            fresh = [job for job in jobs if job.key not in self._jobs]
            self._jobs.update((job.key, job) for job in fresh)
            self._pending.extend(fresh)
            self._check_stuck()
            self._changed.notify_all()

    async def close(self) -> None:
        """No more peers or jobs will come: the fetch is over once every job is done."""
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _start(self, peer: RangePeer) -> None:
        assert self._group is not None
        for _ in range(self._streams):
            self._group.create_task(self._worker(peer))

    async def _until_over(self) -> None:
        async with self._changed:
            await self._changed.wait_for(self._over)

    # ----- choosing work -----

    def _over(self) -> bool:
        return (self._closed and len(self._done) == len(self._jobs)) or self._stuck is not None

    def _pick(self, peer: str) -> RangeJob | None:
        """The next range for `peer` (see the module docstring), without taking it."""
        if peer in self._dropped:
            return None
        usable = [j for j in self._pending if self._may_serve(peer, j)]
        pinned = next((j for j in usable if j.pinned == peer), None)
        if pinned is not None or usable:
            return pinned or usable[0]
        for key, copies in self._in_flight.items():  # the end game
            if key in self._done:  # won already: its other copy is being cancelled, not still needed
                continue
            job = self._jobs[key]
            if job.pinned is None and peer not in copies and len(copies) < 2 and self._may_serve(peer, job):
                return job
        return None

    def _may_serve(self, peer: str, job: RangeJob) -> bool:
        if job.pinned is not None:
            return job.pinned == peer
        return peer not in self._refused_by.get(job.key, ())

    def _check_stuck(self) -> None:
        """A range nobody left may serve, with nothing in flight that could still deliver it: the fetch is
        over, and nothing still in flight can help any more."""
        if self._over():
            return
        live = [p.name for p in self._peers if p.name not in self._dropped]
        for job in self._pending:
            if job.key not in self._in_flight and not any(self._may_serve(p, job) for p in live):
                self._stuck = job
                break
        else:
            return
        for copies in self._in_flight.values():
            for task in copies.values():
                task.cancel()

    # ----- one worker per peer stream -----

    async def _worker(self, peer: RangePeer) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self._over() or peer.name in self._dropped or self._pick(peer.name) is not None
                )
                job = None if self._over() else self._pick(peer.name)
                if job is None:
                    return
                task = self._take(peer, job)
            await asyncio.wait({task})
            async with self._changed:
                self._record(peer.name, job, task)
                self._changed.notify_all()

    def _take(self, peer: RangePeer, job: RangeJob) -> asyncio.Task[_Arrived]:
        with contextlib.suppress(ValueError):
            self._pending.remove(job)
        copies = self._in_flight.setdefault(job.key, {})
        if copies:
            self.report.duplicates += 1
        start, stop = job.ranges.span(job.index)
        task = asyncio.create_task(self._fetch_checked(peer, job, range_timeout_s(stop - start)))
        copies[peer.name] = task
        return task

    async def _fetch_checked(self, peer: RangePeer, job: RangeJob, timeout_s: float) -> _Arrived:
        try:
            async with asyncio.timeout(timeout_s):
                encoding, sent = await peer.fetch(job.ranges.root, job.index, timeout_s)
        except TimeoutError:
            raise PeerFault(FetchFailure.TIMEOUT, f"no range within {timeout_s:.0f} s") from None
        try:
            data = await asyncio.to_thread(_decoded_and_checked, job, encoding, sent)
        except RangeError as exc:
            reason = FetchFailure.HASH_MISMATCH if "hash" in str(exc) else FetchFailure.INVALID
            raise PeerFault(reason, str(exc)) from None
        return data, len(sent)

    def _record(self, peer: str, job: RangeJob, task: asyncio.Task[_Arrived]) -> None:
        copies = self._in_flight.get(job.key, {})
        copies.pop(peer, None)
        if not copies:
            self._in_flight.pop(job.key, None)
        if task.cancelled():  # another copy won, or the fetch is over
            pass
        elif task.exception() is None:
            self._won(peer, job, *task.result(), copies)
        else:
            self._failed(peer, job, task.exception())
        self._check_stuck()

    def _won(
        self, peer: str, job: RangeJob, data: bytes, sent: int, copies: dict[str, asyncio.Task[_Arrived]]
    ) -> None:
        if job.key in self._done:
            return
        self._done.add(job.key)
        self._deliver(job, data)
        self.report.ranges_per_peer[peer] += 1
        self.report.wire_bytes += sent
        for other in copies.values():
            other.cancel()

    def _failed(self, peer: str, job: RangeJob, exc: BaseException | None) -> None:
        if not isinstance(exc, PeerFault):
            raise exc if exc is not None else AssertionError("a failed range without an exception")
        reason = str(exc.reason)
        self.report.failures[reason] += 1
        if self._on_failure is not None:
            self._on_failure(reason)
        logger.warning("range %d from %s refused: %s", job.index, peer, exc)
        if job.pinned is None:
            self._refused_by.setdefault(job.key, set()).add(peer)
        lied = exc.reason in (FetchFailure.HASH_MISMATCH, FetchFailure.INVALID)
        self._failures[peer] += 1
        if lied or self._failures[peer] >= self._max_failures:
            self._drop(peer, reason)
        if job.key not in self._done and job.key not in self._in_flight and job not in self._pending:
            self._pending.appendleft(job)

    def _drop(self, peer: str, reason: str) -> None:
        if peer not in self._dropped:
            self._dropped.add(peer)
            self.report.dropped.append(peer)
            logger.warning("range peer %s dropped (%s): its ranges go to the others", peer, reason)
