"""CPU priority of background threads (snapshot writes): idle-only until they fall behind.

A snapshot write is background work on a volunteer's few cores, and on a CPU-only node both cores run
the training's intra-op threads. At nice 10 the writer still took its share: every cycle it ran
stalled a training thread, and the other one waited for it at the next barrier (docs/benchmarks.md
"How the train bench's anchor is measured" has what it cost). So background threads run
under Linux's SCHED_IDLE, which gives them only CPU time no runnable normal thread wants; a waking
training thread preempts them at once.

An idle-only thread can starve on a machine that is busy with other work (other processes, the other
nodes of a test swarm). So a write is *hurried* — its threads move to SCHED_OTHER at nice 10 until it
ends — when the next snapshot falls due while it is still in flight, when someone waits for it, or
when it has run idle-only for longer than its grace (a watchdog thread of normal priority); the next
write starts idle-only again. Leaving SCHED_IDLE needs
CAP_SYS_NICE or a permissive RLIMIT_NICE (Docker's default root has neither); where a probe thread
finds it refused, background threads stay at nice 10 from the start and are never idle-only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10
"""The priority of background work that must not starve (a hurried write; no SCHED_IDLE)."""


def _set_idle(tid: int) -> None:
    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _set_nice(tid: int) -> None:
    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICENESS)


@functools.cache
def idle_policy_usable() -> bool:
    """Whether a thread may enter SCHED_IDLE *and leave it again* here (probed once, on a thread of
    its own, so a refusal strands nobody)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            _set_nice(tid)
            _set_idle(tid)
            _set_nice(tid)
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="sched-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(result and result[0])


class BackgroundPriority:
    """The threads of one kind of background work, all idle-only or all hurried together.

    A thread joins with `enter()` (its first call: a writer loop's start, a pool's initializer) and
    must leave (`leave(tid)`) before it ends: the kernel reuses thread ids, and a stale one could name
    a training thread later. `hurry()` (any thread) raises every member to nice 10 and has threads
    that enter afterwards start there, until `relax(grace_s)`, which also has the watchdog hurry them
    once `grace_s` pass. Create it on a thread of normal priority (the watchdog inherits its policy);
    `close()` ends the watchdog.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._members: set[int] = set()
        self._hurried = False
        self._deadline: float | None = None
        self._closed = False
        self._idle = idle_policy_usable()
        self._watchdog: threading.Thread | None = None
        if self._idle:
            self._watchdog = threading.Thread(target=self._watch, name="background-watchdog", daemon=True)
            self._watchdog.start()

    @property
    def hurried(self) -> bool:
        return self._hurried

    @property
    def idle_only(self) -> bool:
        """Whether members run idle-only now (False when hurried or where SCHED_IDLE is not usable)."""
        return self._idle and not self._hurried

    def members(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._members)

    def enter(self) -> int:
        """Join (the calling thread); returns its thread id, for `leave`."""
        tid = threading.get_native_id()
        with self._lock:
            self._members.add(tid)
            self._apply(tid)
        return tid

    def leave(self, tid: int) -> None:
        with self._lock:
            self._members.discard(tid)

    def hurry(self) -> None:
        """The work is overdue: no longer idle-only (no-op where it never was, or already hurried)."""
        with self._lock:
            self._hurry_locked()

    def _hurry_locked(self) -> None:
        self._deadline = None
        if self._hurried:
            return
        self._hurried = True
        for tid in list(self._members):
            self._apply(tid)
        if self._idle:
            logger.debug("background work overdue: raised from idle-only to nice %d", BACKGROUND_NICENESS)

    def relax(self, grace_s: float) -> None:
        """New work begins: idle-only again, for `grace_s` seconds at most."""
        with self._lock:
            self._deadline = time.monotonic() + grace_s
            self._changed.notify_all()
            if not self._hurried:
                return
            self._hurried = False
            for tid in list(self._members):
                self._apply(tid)

    def finished(self) -> None:
        """The work ended: the watchdog has nothing to hurry until the next `relax`."""
        with self._lock:
            self._deadline = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        if self._watchdog is not None:
            self._watchdog.join(5)

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                if self._deadline is None:
                    self._changed.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self._hurry_locked()

    def _apply(self, tid: int) -> None:
        # A member that has exited meanwhile (ESRCH) or a platform without these calls keeps nothing.
        with contextlib.suppress(OSError, AttributeError):
            if self.idle_only:
                _set_idle(tid)
            else:
                _set_nice(tid)
