"""The byte feed hands a download to a decoding thread in order, with backpressure and failures."""

from __future__ import annotations

import asyncio
import os

import pytest

from swarmnode.snapshot.feed import ByteFeed, FeedClosed


def test_bytes_arrive_in_order_across_chunk_boundaries_with_backpressure() -> None:
    data = os.urandom(3_000_000)

    async def scenario() -> bytes:
        feed = ByteFeed(cap_bytes=100_000)
        consumer = asyncio.create_task(
            asyncio.to_thread(lambda: b"".join(iter(lambda: feed.read(77_777), b"")))
        )
        for start in range(0, len(data), 65_536):
            await feed.push(data[start : start + 65_536])  # waits whenever the reader is 100 KB behind
        feed.close()
        return await consumer

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == data


def test_a_failed_download_fails_the_reader() -> None:
    async def scenario() -> None:
        feed = ByteFeed()
        await feed.push(b"abc")
        feed.close(RuntimeError("peer went away"))
        with pytest.raises(FeedClosed, match="peer went away"):
            await asyncio.to_thread(feed.read, 10)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_reader_that_gives_up_releases_a_waiting_producer() -> None:
    async def scenario() -> None:
        feed = ByteFeed(cap_bytes=1000)
        await feed.push(b"x" * 500)
        waiting = asyncio.create_task(feed.push(b"y" * 5000))  # over the cap: waits for the reader
        await asyncio.sleep(0)
        assert not waiting.done()
        await asyncio.to_thread(feed.abandon)
        with pytest.raises(FeedClosed):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(FeedClosed):
            await feed.push(b"z")

    asyncio.run(asyncio.wait_for(scenario(), 10))
