"""A node (re)joining the swarm: the restore at start, and the fetcher its restores and repairs use.

At start a node gives its --peers up to JOIN_WAIT_S to answer (then goes on without them), restores the
freshest verified state among its own snapshots (the checkpointer's scan: this node's files of this run
only) and its peers' announced ones (recovery.py), and takes its own snapshot files into its catalog;
those recovery verified are not hashed again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from swarmnode.core.training import TrainingRun
from swarmnode.net import rpc, snapshot_client
from swarmnode.net.dht import SwarmDHT
from swarmnode.snapshot.checkpointer import SpeculativeCheckpointer
from swarmnode.swarm.announcements import Announcement
from swarmnode.swarm.membership import Membership
from swarmnode.swarm.recovery.restore import Fetcher, Receipt, Recovery
from swarmnode.util import faults
from swarmnode.util.labels import RecoverySource
from swarmnode.util.metrics import Metrics

logger = logging.getLogger(__name__)

JOIN_WAIT_S = 15.0
"""How long a starting node waits for its --peers to answer before it recovers without them."""


async def restore_at_start(
    recovery: Recovery,
    membership: Membership,
    dht: SwarmDHT,
    checkpointer: SpeculativeCheckpointer,
    has_peers: bool,
) -> Receipt:
    """Restore the freshest verified state and adopt the local snapshot files; returns the receipt."""
    started = time.perf_counter()
    if has_peers and not await dht.wait_for_peers(JOIN_WAIT_S):
        logger.warning("no peer reachable after %.0f s: recovering from local snapshots only", JOIN_WAIT_S)
    await membership.refuse_if_duplicate()  # before anything of this node's is announced or fetched
    local = await asyncio.to_thread(checkpointer.scan)
    peers, own = await membership.announcements()
    peers = [p for p in peers if p.serves]  # a client's snapshots serve its own restarts only
    lookup_s = time.perf_counter() - started
    receipt = await recovery.recover(peers, own, local, lookup_s)
    receipt.seconds = time.perf_counter() - started
    await asyncio.to_thread(checkpointer.adopt, local, recovery.verified.__contains__)
    log_receipt(receipt)
    return receipt


def log_receipt(receipt: Receipt) -> None:
    if receipt.source == RecoverySource.FRESH:
        logger.info(
            "no snapshot to resume from: starting at outer step 0 with %s cursor %s",
            receipt.cursor_source,
            receipt.cursor,
        )
    else:
        logger.info(
            "recovered from %s snapshot %s%s at outer step %d, inner step %d in %.2f s (cursor %s from %s)",
            receipt.source,
            (receipt.snapshot_id or "")[:12],
            f" of {receipt.peer}" if receipt.peer else "",
            receipt.outer_step,
            receipt.inner_step,
            receipt.seconds,
            receipt.cursor,
            receipt.cursor_source,
        )


def peer_fetcher(run: TrainingRun, metrics: Metrics, channels: rpc.ChannelCache | None = None) -> Fetcher:
    """Fetches a peer's snapshot of at most a little more than this run's state, counting the bytes
    (over the node's cached channels, if given)."""

    async def count_fetched(size: int) -> None:
        metrics.fetch_bytes.inc(size)
        await faults.ahit("fetch_chunk")  # on the event loop: a sleep fault must not stall it

    async def fetch(peer: Announcement, on_data: Callable[[bytes], Awaitable[None]]) -> str:
        """Fetch the announced snapshot, or the peer's newest if it has rotated the announced one out
        (a node keeps training after it announces); returns the id of what was fetched and verified.
        The bytes go only to `on_data` (decoded as they arrive): nothing is written here."""
        limit = int(run.state_bytes() * 1.25) + (4 << 20)
        received = 0

        async def forward(data: bytes) -> None:
            nonlocal received
            received += len(data)
            await count_fetched(len(data))
            await on_data(data)

        get = functools.partial(
            snapshot_client.fetch_snapshot,
            peer.address,
            None,
            max_bytes=limit,
            on_data=forward,
            channels=channels,
        )
        try:
            result = await get(snapshot_id=peer.snapshot_id, expected_sha256=peer.snapshot_id)
        except rpc.PeerUnavailable as exc:
            if exc.reason != "refused" or received:  # the decoder holds part of one stream already
                raise
            result = await get()  # the newest it serves; still verified against its own id
        return result.snapshot_id

    return fetch
