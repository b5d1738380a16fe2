"""Who may change the training state: one named thread (and who writes the ledger: another).

The training thread — a single-thread executor named `training` — is the only place that mutates the
model, both optimisers, θ_g and its momentum, the loader's cursor and the checkpointer's staging
buffers: inner and outer steps, restores, repairs and staging copies all run there. The event loop
hands it work with `TrainingThread.run` and reads only the immutable sample it publishes.

The ledger has one writer too, the `ledger` thread: its entries are appended there in order, never
from whatever thread `asyncio.to_thread` picks (`assert_on_thread(LEDGER_THREAD, ...)` proves it).

`assert_training_thread` is the hook that proves it: the owners of that state call it on every
mutation, and with `check_ownership(True)` (the CLI turns it on when SWARMNODE_CHECK_THREADS=1; a test
does) a mutation on any other thread raises `OwnershipError`. Off, it costs one global read.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

TRAINING_THREAD = "training"
LEDGER_THREAD = "ledger"
_checking = False


class OwnershipError(AssertionError):
    """Training state was touched off the training thread (a bug, found with `check_ownership`)."""


def check_ownership(enabled: bool) -> None:
    """Turn the ownership assertions on (tests, debugging) or off (the default)."""
    global _checking
    _checking = enabled


def on_training_thread() -> bool:
    return threading.current_thread().name.startswith(TRAINING_THREAD)


def assert_training_thread(what: str) -> None:
    """OwnershipError if checks are on and the caller is not the training thread."""
    assert_on_thread(TRAINING_THREAD, what)


def assert_on_thread(owner: str, what: str) -> None:
    """OwnershipError if checks are on and the caller is not the thread named `owner`."""
    if _checking and not threading.current_thread().name.startswith(owner):
        raise OwnershipError(
            f"{what} ran on thread {threading.current_thread().name!r}, not the {owner} thread"
        )


class OwnedThread:
    """One named thread that owns some state; `run` awaits a call on it from the event loop."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the training thread, awaited (calls run one at a time, in order)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        """Waits for the call in progress, then ends the thread."""
        self._executor.shutdown(wait=True)


class TrainingThread(OwnedThread):
    """The one thread that changes the training state."""

    def __init__(self) -> None:
        super().__init__(TRAINING_THREAD)
