"""Small asyncio helpers every layer uses."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


async def settle(*tasks: asyncio.Task[Any], expected: tuple[type[BaseException], ...] = ()) -> None:
    """Cancels the tasks and waits for them to end. A task that failed with anything but a cancellation
    or one of the `expected` exceptions (already reported by its owner) is a bug: logged with its
    traceback."""
    for task in tasks:
        task.cancel()
    for task, outcome in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
        if isinstance(outcome, Exception) and not isinstance(outcome, expected):
            logger.error("task %s failed", task.get_name(), exc_info=outcome)
