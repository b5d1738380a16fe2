"""The speculative checkpointer: rolling hot and cold snapshots written off the training path.

The training thread only copies the state into reused staging buffers (`staging.py`: preallocated host
memory; from a GPU, a pinned arena filled by a side stream); compression, hashing and writing happen on
one background writer thread. At most one write is in flight: a hot snapshot that falls due meanwhile
is skipped and counted, never waited for; a cold one waits (that wait is the stall it reports). The
writer's threads run idle-only (SCHED_IDLE: `util/background.py`) so that they take no cycle training
wants; a write still in flight when the next snapshot falls due, that someone waits for, or that has
run idle-only for twice the last write's time (2-30 s) is hurried to nice 10, so a busy machine cannot
starve it.

A full disk: the write makes room by removing this node's oldest snapshots early (hot ones first, never
the newest) and tries again. A write that still fails — a full disk with nothing left to remove, an
unwritable directory — is counted, logged as an error at most every FAILURE_LOG_INTERVAL_S per reason
(with how many failed meanwhile and which step is the newest on disk), and reported by `save_health`
(the node's status, a gauge, and the exit code of a stop whose final snapshot failed); training goes on
with the snapshots it has.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmnode.snapshot.format import (
    MAX_EXPANSION,
    MAX_HEADER_BYTES,
    SnapshotError,
    SnapshotInfo,
    SnapshotMismatch,
    iter_snapshot_files,
    parse_snapshot_name,
    sha256_file,
)
from swarmnode.snapshot.metadata import SnapshotMetadata
from swarmnode.snapshot.read import check_template, read_header
from swarmnode.snapshot.staging import Staged, StagingBuffers
from swarmnode.snapshot.tensors import TensorTemplate
from swarmnode.snapshot.write import write_snapshot
from swarmnode.util import faults
from swarmnode.util.background import BackgroundPriority
from swarmnode.util.metrics import Metrics
from swarmnode.util.threads import assert_training_thread

logger = logging.getLogger(__name__)

IDLE_GRACE_S = (2.0, 30.0)
"""Bounds of the seconds a write runs idle-only before it is hurried (see `_idle_grace_s`)."""
FAILURE_LOG_INTERVAL_S = 60.0
"""A failing kind of write is logged as an error at most this often (every failure is counted)."""
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class SaveHealth:
    """Whether the training state is being saved: the last write's failure, if it failed, and the
    newest snapshot on disk (what a restart would resume from)."""

    failing: str | None = None
    """Why the last write failed ("disk_full", "io_error"); None: it succeeded (or none ran yet)."""
    failures_in_a_row: int = 0
    newest_on_disk: tuple[int, int] | None = None
    """(outer step, inner step) of the newest snapshot this node keeps; None: none."""

    def describe(self) -> str:
        """One line for people ("" while snapshots are written)."""
        if self.failing is None:
            return ""
        newest = "none" if self.newest_on_disk is None else "o{}/i{}".format(*self.newest_on_disk)
        return (
            f"snapshot writes failing ({self.failing}, {self.failures_in_a_row} in a row); "
            f"newest snapshot on disk: {newest}"
        )


@dataclass(frozen=True)
class CheckpointerConfig:
    directory: Path
    """Where snapshot files live."""
    keep_hot: int = 3
    keep_cold: int = 2
    layout: str = "planes"
    hot_level: int = 1
    """zstd level of hot snapshots (fast)."""
    cold_level: int = 3
    zstd_threads: int = 1
    """Threads that compress a snapshot's large byte planes in parallel (as independent frames)."""

    def __post_init__(self) -> None:
        if self.keep_hot < 1 or self.keep_cold < 1:
            raise ValueError("keep_hot and keep_cold must be at least 1")


@dataclass(frozen=True)
class SnapshotOwner:
    """Whose snapshots a checkpointer keeps: one node's, of one run configuration, with one tensor set."""

    node_id: str
    run_digest: str
    template: TensorTemplate


@dataclass(frozen=True)
class LocalSnapshot:
    """A snapshot file of this node's, as the scan found it (hash not yet checked)."""

    info: SnapshotInfo
    meta: SnapshotMetadata


def read_local_snapshot(path: Path, owner: SnapshotOwner | None) -> LocalSnapshot:
    """A snapshot file's info and metadata from its header (cheap; the hash is not checked).

    SnapshotError: the header or metadata is malformed, the name disagrees with the metadata, or the
    header declares more data than the file could hold. SnapshotMismatch: a sound snapshot, but of
    another run configuration, another node or another tensor set than `owner`'s (None: any).
    """
    parsed = parse_snapshot_name(path.name)
    if parsed is None:
        raise SnapshotError("not a snapshot file name")
    kind, outer, inner, snapshot_id = parsed
    size = path.stat().st_size
    header = read_header(path)
    meta = SnapshotMetadata.parse(header.metadata)
    if (meta.kind, meta.outer_step, meta.inner_step) != (kind, outer, inner):
        raise SnapshotError(
            f"its name says {kind} o{outer}/i{inner}, its metadata {meta.kind} o{meta.outer_step}/"
            f"i{meta.inner_step}"
        )
    if header.data_bytes > MAX_EXPANSION * size + MAX_HEADER_BYTES:
        raise SnapshotError(f"its header declares {header.data_bytes} bytes, implausible for {size}")
    if owner is not None:
        if meta.run_digest != owner.run_digest:
            raise SnapshotMismatch(
                f"run digest {meta.run_digest[:12]}…, this run's is {owner.run_digest[:12]}…"
            )
        if meta.node_id != owner.node_id:
            raise SnapshotMismatch(f"written by node {meta.node_id[:12]}, not by this node")
        check_template(header, owner.template)
    info = SnapshotInfo(
        snapshot_id,
        path,
        size,
        outer,
        inner,
        kind,
        meta.created_at,
        meta.layout,
        meta.run_id,
        meta.node_id,
        meta.committed_cursor,
    )
    return LocalSnapshot(info, meta)


def _rank(info: SnapshotInfo) -> tuple[int, int, float]:
    return info.outer_step, info.inner_step, info.created_at


@dataclass
class _Job:
    kind: str
    metadata: dict[str, Any]
    staged: Staged


class SpeculativeCheckpointer:
    """Hot/cold rolling snapshots with one background writer; also the catalog of complete snapshots."""

    def __init__(
        self,
        cfg: CheckpointerConfig,
        metrics: Metrics,
        on_written: Callable[[SnapshotInfo], None] | None = None,
        owner: SnapshotOwner | None = None,
    ) -> None:
        """`owner`: whose files `scan` accepts from the directory (None: any sound snapshot)."""
        self.cfg, self.metrics, self.on_written, self.owner = cfg, metrics, on_written, owner
        self._staging = StagingBuffers()
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._slot = threading.BoundedSemaphore(1)
        """Held from staging until the write's end: the staging buffers and the one write in flight
        belong to whoever holds it (the training thread while it stages, the writer while it writes)."""
        self._lock = threading.Lock()
        self._snapshots: list[SnapshotInfo] = []
        self._writes = 0
        self._writes_by_kind: dict[str, int] = {}
        self._health = SaveHealth()
        self._failure_logged_at: dict[str, float] = {}  # reason -> monotonic time of its last error line
        self._failures_unlogged: dict[str, int] = {}
        self.priority = BackgroundPriority()
        """The writer's and its compressing threads' CPU priority (idle-only unless hurried)."""
        self._last_write_s = 0.0
        self._thread = threading.Thread(target=self._writer_loop, name="snapshot-writer", daemon=True)
        self._thread.start()

    # ----- the training thread's side -----

    def subscribe(self, on_written: Callable[[SnapshotInfo], None]) -> None:
        """Call `on_written(info)` on the writer thread after each snapshot that retention kept (set it
        before the first snapshot)."""
        self.on_written = on_written

    def snapshot(self, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any], kind: str) -> bool:
        """Stage the state and hand its write to the writer; a hot one is skipped (False) while a write
        is in flight, a cold one waits for it (that wait is its stall). Training thread only."""
        assert_training_thread("staging a snapshot")
        started = time.perf_counter()
        if not self._slot.acquire(blocking=False):
            self.priority.hurry()  # the write in flight is overdue: it must not starve
            if kind == "hot":
                self.metrics.snapshots_skipped.inc()
                logger.debug("hot snapshot at %s skipped: a write is in flight", _steps(metadata))
                return False
            self._slot.acquire()
        try:
            self._jobs.put(_Job(kind, dict(metadata), self._staging.stage(tensors)))
        except BaseException:
            self._slot.release()  # nothing was handed over
            raise
        self.metrics.snapshot_stall.labels(kind).observe(time.perf_counter() - started)
        return True

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no write is in flight (shutdown, tests); False if `timeout_s` passed first."""
        if self._slot.acquire(blocking=False):
            self._slot.release()
            return True
        self.priority.hurry()  # somebody waits for it now
        if not self._slot.acquire(timeout=timeout_s):
            return False
        self._slot.release()
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        self.wait_idle(timeout_s)
        self._jobs.put(None)
        self._thread.join(timeout_s)
        self.priority.close()
        if not self._thread.is_alive():
            self._staging.close()

    # ----- the writer thread -----

    def _writer_loop(self) -> None:
        tid = self.priority.enter()
        try:
            while (job := self._jobs.get()) is not None:
                self.priority.relax(self._idle_grace_s())  # idle-only again, for a while at most
                try:
                    self._write(job)
                except Exception:  # a bug must not kill the writer and wedge every later cold snapshot
                    logger.exception("snapshot writer failed unexpectedly")
                finally:
                    self.priority.finished()
                    self._slot.release()  # the write is over: the staging buffers are free again
        finally:
            self.priority.leave(tid)

    def _idle_grace_s(self) -> float:
        """How long a write may run idle-only before the watchdog hurries it: twice the last one's
        time (a bigger state or a slower disk takes longer), within IDLE_GRACE_S."""
        low, high = IDLE_GRACE_S
        return min(max(2.0 * self._last_write_s, low), high)

    def _write(self, job: _Job) -> None:
        job.staged.wait()  # the device copies, if any, have landed
        self._writes += 1
        index = self._writes
        faults.hit("snapshot_write", index)

        self._writes_by_kind[job.kind] = kind_index = self._writes_by_kind.get(job.kind, 0) + 1

        def halfway() -> None:
            faults.hit("snapshot_halfway", index)
            faults.hit(f"{job.kind}_snapshot_halfway", kind_index)

        started = time.perf_counter()
        try:
            info, raw_bytes = self._write_making_room(job, halfway)
        except OSError as exc:
            self._record_failure(exc, job.metadata)
            return
        seconds = time.perf_counter() - started
        self._last_write_s = seconds
        self._record_success(info, raw_bytes, seconds)
        kept = self._apply_retention()
        if self.on_written is not None and info in kept:  # never announce a file retention just removed
            self.on_written(info)

    def _write_making_room(self, job: _Job, halfway: Callable[[], None]) -> tuple[SnapshotInfo, int]:
        """Write the job; on a full disk, remove the oldest snapshot that may go and try again, until
        the write fits or nothing may go (then the OSError is the caller's)."""
        while True:
            try:
                return write_snapshot(
                    self.cfg.directory,
                    job.staged.tensors,
                    job.metadata,
                    kind=job.kind,
                    layout=self.cfg.layout,
                    level=self.cfg.hot_level if job.kind == "hot" else self.cfg.cold_level,
                    threads=self.cfg.zstd_threads,
                    fsync=job.kind == "cold",
                    on_halfway=halfway,
                    priority=self.priority,
                )
            except OSError as exc:
                if exc.errno not in _NO_ROOM or not self._remove_one_for_room():
                    raise

    def _remove_one_for_room(self) -> bool:
        """Remove the oldest hot snapshot (else the oldest cold one) that is not the newest of all:
        the newest verified state always stays. False when there is none to remove."""
        with self._lock:
            by_age = sorted(self._snapshots, key=_rank)[:-1]
            victim = next((i for i in by_age if i.kind == "hot"), by_age[0] if by_age else None)
            if victim is None:
                return False
            self._snapshots.remove(victim)
        victim.path.unlink(missing_ok=True)
        self.metrics.snapshot_evictions.inc()
        logger.warning(
            "disk full: removed %s snapshot o%d/i%d early to make room for the next one",
            victim.kind,
            victim.outer_step,
            victim.inner_step,
        )
        return True

    def _record_success(self, info: SnapshotInfo, raw_bytes: int, seconds: float) -> None:
        m = self.metrics
        m.snapshot_write.labels(info.kind).observe(seconds)
        m.snapshots_written.labels(info.kind).inc()
        m.snapshot_raw_bytes.labels(info.kind).inc(raw_bytes)
        m.snapshot_compressed_bytes.labels(info.kind).inc(info.size_bytes)
        m.snapshot_size.labels(info.kind).set(info.size_bytes)
        m.snapshot_save_failing.set(0)
        with self._lock:
            self._snapshots.append(info)
            self._health = SaveHealth(newest_on_disk=(info.outer_step, info.inner_step))
        logger.info(
            "%s snapshot o%d/i%d written: %s, %.1f MB (ratio %.3f) in %.2f s",
            info.kind,
            info.outer_step,
            info.inner_step,
            info.snapshot_id[:12],
            info.size_bytes / 1e6,
            info.size_bytes / max(raw_bytes, 1),
            seconds,
        )

    def _record_failure(self, exc: OSError, metadata: Mapping[str, Any]) -> None:
        reason = "disk_full" if exc.errno in _NO_ROOM else "io_error"
        self.metrics.snapshot_failures.labels(reason).inc()
        self.metrics.snapshot_save_failing.set(1)
        newest = self.find(None)
        with self._lock:
            self._health = SaveHealth(
                reason,
                self._health.failures_in_a_row + 1,
                None if newest is None else (newest.outer_step, newest.inner_step),
            )
        self._failures_unlogged[reason] = self._failures_unlogged.get(reason, 0) + 1
        now = time.monotonic()
        last = self._failure_logged_at.get(reason)
        if last is not None and now - last < FAILURE_LOG_INTERVAL_S:
            return
        self._failure_logged_at[reason] = now
        failed, self._failures_unlogged[reason] = self._failures_unlogged[reason], 0
        logger.error(
            "snapshot write failed (%s) at %s: %s; the newest snapshot on disk is %s, so a restart now "
            "resumes from there (%d failed write(s) since the last such line; training goes on; free "
            "room in %s)",
            reason,
            _steps(metadata),
            exc,
            "none" if newest is None else f"o{newest.outer_step}/i{newest.inner_step}",
            failed,
            self.cfg.directory,
        )

    def save_health(self) -> SaveHealth:
        """Whether the last write failed, and the newest snapshot on disk (any thread)."""
        with self._lock:
            return self._health

    def _apply_retention(self) -> list[SnapshotInfo]:
        """Delete the catalog's oldest snapshots beyond --keep-hot/--keep-cold; the catalog only ever
        holds this node's snapshots of this run (see `scan`), so nothing else is ever deleted."""
        with self._lock:
            keep = {"hot": self.cfg.keep_hot, "cold": self.cfg.keep_cold}
            kept, seen = [], {"hot": 0, "cold": 0}
            for info in sorted(self._snapshots, key=_rank, reverse=True):
                seen[info.kind] += 1
                if seen[info.kind] <= keep[info.kind]:
                    kept.append(info)
                else:
                    info.path.unlink(missing_ok=True)
            self._snapshots = sorted(kept, key=_rank)
            return list(self._snapshots)

    # ----- the catalog -----

    def scan(self) -> list[LocalSnapshot]:
        """This node's snapshot files of this run, newest first: headers and metadata checked, hashes not
        yet (see `adopt`). Temporary files of interrupted writes are removed; a file whose header or
        metadata is malformed, or whose name disagrees with it, is renamed `*.corrupt` (one warning
        each); a sound file of another configuration or node is left alone and never counted (one line
        for all of them). Only what this returns may enter the catalogue and its retention."""
        self._remove_interrupted_writes()
        found: list[LocalSnapshot] = []
        foreign: list[str] = []
        for path in iter_snapshot_files(self.cfg.directory):
            try:
                found.append(read_local_snapshot(path, self.owner))
            except SnapshotMismatch as exc:
                foreign.append(f"{path.name[:40]}: {exc}")
            except (SnapshotError, OSError) as exc:
                quarantine(path, str(exc))
        if foreign:
            logger.warning(
                "%d snapshot file(s) in %s belong to another run configuration or node and are ignored "
                "(kept, never served or counted), e.g. %s",
                len(foreign),
                self.cfg.directory,
                foreign[0],
            )
        return found

    def adopt(self, snapshots: list[LocalSnapshot], verified: Callable[[str], bool]) -> list[SnapshotInfo]:
        """Take scanned snapshots into the catalog once their sha256 matches their name (`verified(id)`
        skips files a restore already verified); a mismatch is renamed `*.corrupt`."""
        adopted = []
        for local in snapshots:
            info = local.info
            if not info.path.exists():
                continue  # quarantined meanwhile (a restore found it bad)
            if not verified(info.snapshot_id) and sha256_file(info.path) != info.snapshot_id:
                quarantine(info.path, "its sha256 does not match its name")
                continue
            adopted.append(info)
        with self._lock:
            self._snapshots = sorted(adopted, key=_rank)
        return adopted

    def adopt_existing(self) -> list[SnapshotInfo]:
        """`scan` then `adopt`, hashing every file (tests, tools)."""
        return self.adopt(self.scan(), lambda _id: False)

    def _remove_interrupted_writes(self) -> None:
        directory = self.cfg.directory
        leftovers = list(directory.glob(".tmp-*.part")) if directory.is_dir() else []
        for path in leftovers:
            path.unlink(missing_ok=True)
        if leftovers:
            logger.info("removed %d temporary file(s) of writes a crash interrupted", len(leftovers))

    def list_snapshots(self) -> list[SnapshotInfo]:
        """Complete snapshots, newest last."""
        with self._lock:
            return [s for s in self._snapshots if s.path.exists()]

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        """The snapshot with this id, or the newest for None."""
        snapshots = self.list_snapshots()
        if snapshot_id is None:
            return snapshots[-1] if snapshots else None
        return next((s for s in snapshots if s.snapshot_id == snapshot_id), None)

    def newest_created_at(self) -> float | None:
        snapshots = self.list_snapshots()
        return max((s.created_at for s in snapshots), default=None)


def quarantine(path: Path, why: str) -> None:
    """Move a bad snapshot aside (never delete what might be someone's only copy)."""
    target = path.with_name(path.name + ".corrupt")
    try:
        path.rename(target)
    except OSError:
        target = path
    logger.warning("snapshot %s refused: %s; kept as %s", path.name, why, target.name)


def _steps(metadata: Mapping[str, Any]) -> str:
    return f"o{metadata.get('outer_step')}/i{metadata.get('inner_step')}"
