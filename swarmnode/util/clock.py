"""This node's wall clock: what it signs DHT expiries with, and what it compares peers' deadlines to.

One indirection so that tests can give a node a clock that is minutes off (`skew@clock=SECONDS` in
SWARMNODE_FAULTS), the way a volunteer's laptop may be, without touching the process's real clock
(gRPC and asyncio keep theirs).
"""

from __future__ import annotations

import time

_skew_s = 0.0


def now() -> float:
    """Unix seconds by this node's clock."""
    return time.time() + _skew_s


def now_ns() -> int:
    return time.time_ns() + int(_skew_s * 1e9)


def set_skew(seconds: float) -> None:
    global _skew_s
    _skew_s = seconds
