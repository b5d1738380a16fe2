"""Test-only fault points: kill, stop or slow the process at a named point and count. Inert unless set.

Tests set `SWARMNODE_FAULTS` on a `swarmnode run` child, e.g.::

    kill@inner_step#37          SIGKILL itself right after inner step 37
    kill@snapshot_halfway#2     SIGKILL itself half-way through writing its 2nd snapshot
    sleep@snapshot_write=2.5    every snapshot write takes 2.5 s longer (a slow disk)
    sleep@inner_step=0.05       every inner step takes 50 ms longer (a slow volunteer)
    stop@allreduce_send#3       SIGSTOP itself at the 3rd hit (a laptop lid closing)
    skew@clock=180              the process's wall clock runs 180 s ahead (negative: behind)

Grammar: comma-separated `ACTION@POINT[#COUNT][=ARG]`; without `#COUNT` the fault fires at every hit.
Points count their own hits from 1 unless the caller passes the index (e.g. the inner step). The fault
fires where the code calls `hit(point)`, so a test kills at a known point, not after a racing timer.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

from swarmnode import clock

logger = logging.getLogger(__name__)

ACTIONS = ("kill", "sleep", "stop", "corrupt", "truncate", "skew")


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
        if fault.action not in ACTIONS or not fault.point:
            raise ValueError(f"SWARMNODE_FAULTS: unknown action or empty point in {item!r}")
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
    """Mark one pass through `point`; carry out a kill/stop/sleep fault that matches it.

    Returns a matching data fault (corrupt/truncate) for the caller to apply, else None.
    """
    if not _faults:
        return None
    with _lock:
        _hits[point] += 1
        count = _hits[point] if index is None else index
    for fault in _faults:
        if fault.point == point and (fault.at is None or fault.at == count):
            data_fault = _act(fault, count)
            if data_fault is not None:
                return data_fault
    return None


def _act(fault: Fault, count: int) -> Fault | None:
    if fault.action == "kill":
        logger.warning("fault: SIGKILL at %s #%d", fault.point, count)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        logger.warning("fault: SIGSTOP at %s #%d", fault.point, count)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "sleep":
        time.sleep(fault.arg or 0.0)
    else:
        return fault
    return None


def armed(point: str) -> bool:
    """Whether any fault targets `point` (lets callers skip setting up a hook)."""
    return any(f.point == point for f in _faults)


def find(action: str, point: str) -> Fault | None:
    return next((f for f in _faults if f.action == action and f.point == point), None)
