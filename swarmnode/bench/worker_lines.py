"""The line protocol of the benches' worker processes, child side: one JSON line out once listening, then
one JSON line answered per JSON line read from stdin, until stdin closes (`bench/procs.py`'s `Worker`
is the parent side)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def answer_requests(handle: Handler) -> None:
    """Answers each stdin line with `handle`'s reply until stdin closes (`{"error": …}` if it failed)."""
    while line := await asyncio.to_thread(sys.stdin.readline):
        try:
            reply = await handle(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the bench
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        say(reply)
