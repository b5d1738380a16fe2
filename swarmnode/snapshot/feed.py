"""A bounded byte pipe from the event loop to a worker thread, so a download can be decoded while it
is still arriving (recovery's fetch and verify/decode stages overlap instead of running one after the
other). The producer awaits when the consumer falls `cap` bytes behind; the consumer blocks until
bytes arrive; either side can end it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque


class FeedClosed(Exception):
    """The producer failed; the consumer gets this instead of the rest of the bytes."""


class ByteFeed:
    """`await push(data)` on the event loop; `read(n)` (a file-like) on a worker thread."""

    def __init__(self, cap_bytes: int = 64 << 20) -> None:
        self._loop = asyncio.get_running_loop()
        self._cap = cap_bytes
        self._chunks: deque[memoryview] = deque()
        self._buffered = 0
        self._done = False
        self._abandoned = False
        self._error: BaseException | None = None
        self._ready = threading.Condition()
        self._drained = asyncio.Event()
        self._drained.set()

    async def push(self, data: bytes) -> None:
        """Hand over a chunk; waits while the reader is `cap` behind. FeedClosed once the reader gave
        up (its own failure is the real story: the caller should look there)."""
        with self._ready:
            if self._abandoned:
                raise FeedClosed("the reader stopped")
            self._chunks.append(memoryview(data))
            self._buffered += len(data)
            if self._buffered > self._cap:
                self._drained.clear()
            self._ready.notify()
        await self._drained.wait()
        if self._abandoned:
            raise FeedClosed("the reader stopped")

    def close(self, error: BaseException | None = None) -> None:
        """No more bytes (or, with `error`, the download failed)."""
        with self._ready:
            self._done, self._error = True, error
            self._ready.notify_all()

    def abandon(self) -> None:
        """The reader's side: it stops reading (it failed); a waiting producer is released at once."""
        with self._ready:
            self._abandoned = True
            self._chunks.clear()
            self._buffered = 0
        self._loop.call_soon_threadsafe(self._drained.set)

    def read(self, size: int = -1) -> bytes:
        with self._ready:
            while not self._chunks and not self._done:
                self._ready.wait()
            if self._error is not None:
                raise FeedClosed(str(self._error))
            out = self._take(size)
            if self._buffered <= self._cap // 2:
                self._loop.call_soon_threadsafe(self._drained.set)
            return out

    def _take(self, size: int) -> bytes:
        parts, wanted = [], size if size >= 0 else self._buffered
        while self._chunks and wanted > 0:
            chunk = self._chunks[0]
            part = chunk[:wanted]
            parts.append(bytes(part))
            wanted -= len(part)
            self._buffered -= len(part)
            if len(part) == len(chunk):
                self._chunks.popleft()
            else:
                self._chunks[0] = chunk[len(part) :]
        return b"".join(parts)
