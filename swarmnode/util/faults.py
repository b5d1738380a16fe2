"""Test-only fault points: kill, stop or slow the process at a named point and count. Inert unless set.

Tests set `SWARMNODE_FAULTS` on a `swarmnode run` child, e.g.::

    kill@inner_step#37          SIGKILL itself right after inner step 37
    kill@snapshot_halfway#2     SIGKILL itself half-way through writing its 2nd snapshot
    sleep@snapshot_write=2.5    every snapshot write takes 2.5 s longer (a slow disk)
    sleep@inner_step=0.05       every inner step takes 50 ms longer (a slow volunteer)
    stop@allreduce_send#3       SIGSTOP itself at the 3rd hit (a laptop lid closing)
    skew@clock=180              the process's wall clock runs 180 s ahead (negative: behind)
    scale@delta#1=1000          the pseudo-gradient it sends in round 1 (outer step 0) is ×1000 (a poisoner)
    nan@delta                   the pseudo-gradients it sends hold NaNs
    direction@delta=7           it sends one fixed random direction, 7 × its Δ's norm, every round
    noise@delta                 it sends fresh random noise of its Δ's norm
    follow@delta=-4             it sends −4 × the last round's average (its own Δ the first round)
    lie@weight=100              its offers declare 100 × the tokens it trained (no cap of its own)
    drop@allreduce_send         it accepts groups, then sends and reduces nothing (a no-show)
    lie@sender                  its all-reduce headers claim another member's index and node id
    lie@part                    its all-reduce headers claim another member's part
    corrupt@serve_range         every state range it serves to a recovering peer has a byte flipped

Grammar: comma-separated `ACTION@POINT[#COUNT][=ARG]`; without `#COUNT` the fault fires at every hit.
Points count their own hits from 1 unless the caller passes the index (e.g. the inner step). The fault
fires where the code calls `hit(point)` (on a thread) or `await ahit(point)` (on the event loop, so a
sleep there pauses only that task), so a test kills at a known point, not after a racing timer. The
points are declared once, below; a spec naming any other is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

from swarmnode.util import clock

logger = logging.getLogger(__name__)

ACTIONS = (
    *("kill", "sleep", "stop", "corrupt", "truncate", "skew"),
    *("scale", "nan", "direction", "noise", "follow", "lie", "drop"),
)
THREAD_POINTS = (
    "inner_step",  # after each inner step (training thread)
    "rank_step",  # after each inner step of a training rank > 0 (its own process, --nproc-per-node)
    "overlap_step",  # after each inner step taken while a round is in flight (--overlap on)
    "snapshot_write",  # before each snapshot write (writer thread)
    "snapshot_halfway",  # half-way through writing a snapshot, counted over both kinds
    "hot_snapshot_halfway",
    "cold_snapshot_halfway",
    "serve_chunk",  # each chunk a snapshot stream reads (reader thread); corrupt flips a byte
)
"""Points hit with `hit()`, off the event loop."""
LOOP_POINTS = (
    "fetch_chunk",  # each chunk a recovery or repair download receives
    "global_params",  # after an outer step; corrupt makes the node's global params go astray
    "allreduce_send",  # before each part an all-reduce member sends; drop: it sends and reduces nothing
    "allreduce_reduce",  # before a reducer publishes its part's average
    "lead_round",  # a round's leader, after it offered and before it proposes the group
    "serve_range",  # each state range served to a recovering peer; corrupt flips a byte
)
"""Points hit with `await ahit()`, on the event loop."""
LOOKED_UP_POINTS = (
    "serve_stream",  # truncate: streams end early
    "clock",  # skew: the wall clock is off
    "delta",  # scale, nan, direction, noise, follow: the pseudo-gradient handed to the all-reduce
    # (#COUNT: the round, from 1)
    "weight",  # lie: the token weight its offers declare
    "sender",  # lie: all-reduce headers name another member as their sender
    "part",  # lie: all-reduce headers name another member's part
)
POINTS = (*THREAD_POINTS, *LOOP_POINTS, *LOOKED_UP_POINTS)
"""Every fault point; the `LOOKED_UP_POINTS` are looked up (`find`, `due`), not hit."""


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    at: int | None
    arg: float | None


_faults: tuple[Fault, ...] = ()
_hits: Counter[str] = Counter()
_lock = threading.Lock()


def parse(spec: str) -> tuple[Fault, ...]:
    """Parse a fault spec; raise ValueError naming the bad item."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            action, rest = item.split("@", 1)
            rest, _, arg = rest.partition("=")
            point, _, at = rest.partition("#")
            fault = Fault(action, point, int(at) if at else None, float(arg) if arg else None)
        except ValueError:
            raise ValueError(f"SWARMNODE_FAULTS: expected ACTION@POINT[#COUNT][=ARG], got {item!r}") from None
        if fault.action not in ACTIONS:
            raise ValueError(f"SWARMNODE_FAULTS: unknown action in {item!r} (one of {', '.join(ACTIONS)})")
        if fault.point not in POINTS:
            raise ValueError(f"SWARMNODE_FAULTS: unknown point in {item!r} (one of {', '.join(POINTS)})")
        faults.append(fault)
    return tuple(faults)


def configure(spec: str | None) -> None:
    global _faults
    _faults = parse(spec) if spec else ()
    _hits.clear()
    if _faults:
        logger.warning("fault injection armed: %s", spec)
    skew = find("skew", "clock")
    clock.set_skew(skew.arg or 0.0 if skew is not None else 0.0)


def hit(point: str, index: int | None = None) -> Fault | None:
    """Mark one pass through `point` (a thread point); carry out a kill/stop/sleep fault that matches it.

    Returns a matching data fault (corrupt/truncate) for the caller to apply, else None.
    """
    assert point in THREAD_POINTS, f"{point} is not a thread fault point"
    for fault, count in _matching(point, index):
        if fault.action == "sleep":
            time.sleep(fault.arg or 0.0)
        elif (data_fault := _act(fault, count)) is not None:
            return data_fault
    return None


async def ahit(point: str, index: int | None = None) -> Fault | None:
    """`hit` for a point on the event loop: a sleep fault sleeps with `asyncio.sleep`, so the loop
    goes on serving while this task waits."""
    assert point in LOOP_POINTS, f"{point} is not an event-loop fault point"
    for fault, count in _matching(point, index):
        if fault.action == "sleep":
            await asyncio.sleep(fault.arg or 0.0)
        elif (data_fault := _act(fault, count)) is not None:
            return data_fault
    return None


def _matching(point: str, index: int | None) -> list[tuple[Fault, int]]:
    """Counts one pass through `point`; the faults that fire at it, with the count."""
    if not _faults:
        return []
    with _lock:
        _hits[point] += 1
        count = _hits[point] if index is None else index
    return [(f, count) for f in _faults if f.point == point and (f.at is None or f.at == count)]


def _act(fault: Fault, count: int) -> Fault | None:
    """Carries out a kill or stop fault; returns a data fault (corrupt/truncate/drop) for the caller."""
    if fault.action == "kill":
        logger.warning("fault: SIGKILL at %s #%d", fault.point, count)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        logger.warning("fault: SIGSTOP at %s #%d", fault.point, count)
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        return fault
    return None


def armed(point: str) -> bool:
    """Whether any fault targets `point` (lets callers skip setting up a hook)."""
    return any(f.point == point for f in _faults)


def find(action: str, point: str) -> Fault | None:
    return next((f for f in _faults if f.action == action and f.point == point), None)


def due(action: str, point: str, index: int) -> Fault | None:
    """The fault `action@point` that applies at `index` (one without `#COUNT` applies at every one)."""
    return next(
        (f for f in _faults if f.action == action and f.point == point and f.at in (None, index)), None
    )
