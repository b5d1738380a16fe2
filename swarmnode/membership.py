"""The node's view of the swarm, through the snapshot announcements in the DHT (see announcements.py).

A node announces each snapshot it writes (a newer one supersedes an announcement still in flight) and
reads its peers' announcements of the same run; a malformed one, or one of another configuration (run
digest), is ignored with one warning per peer. From them it learns which peers a round should expect and
whether it must catch up: when its global params went astray (its digest was in a round's minority) or
its outer step is behind, the up-to-date members to repair from, freshest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from swarmnode.announcements import ANNOUNCE_TTL_S, Announcement, snapshots_key
from swarmnode.dht import SwarmDHT
from swarmnode.snapshot import SnapshotInfo
from swarmnode.training import RunIdentity

logger = logging.getLogger(__name__)


class Membership:
    """Announcements out and in for one node; `stop` ends its waits early."""

    def __init__(
        self,
        dht: SwarmDHT,
        dht_run: str,
        run: RunIdentity,
        address: str,
        stop: threading.Event,
        ahead_wait_s: float,
    ) -> None:
        self.dht, self.key, self.run, self.address = dht, snapshots_key(dht_run), run, address
        self.stop, self.ahead_wait_s = stop, ahead_wait_s
        self._warned: set[str] = set()
        self._announce_task: asyncio.Task[None] | None = None

    # ----- announcing -----

    def announce(self, info: SnapshotInfo) -> None:
        """Publish `info` in the background (call on the event loop); it supersedes one in flight."""
        previous = self._announce_task
        self._announce_task = asyncio.create_task(self._announce(info, previous))

    async def _announce(self, info: SnapshotInfo, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and not previous.done():
            previous.cancel()  # a newer snapshot supersedes it
            with contextlib.suppress(asyncio.CancelledError):
                await previous
        announcement = Announcement(
            self.run.node_id,
            self.address,
            info.snapshot_id,
            info.size_bytes,
            info.outer_step,
            info.inner_step,
            info.kind,
            info.created_at,
            self.run.run_digest,
            info.cursor,
        )
        try:
            await self.dht.publish(self.key, announcement.to_value(), ANNOUNCE_TTL_S)
        except ValueError as exc:  # a record over the size cap is a bug, but must not stop training
            logger.error("announcement of %s refused locally: %s", info.snapshot_id[:12], exc)
        except (OSError, AttributeError, RuntimeError) as exc:  # the DHT socket closed under a late task
            logger.debug("announcement of %s not sent: %s", info.snapshot_id[:12], exc)

    async def flush(self) -> None:
        """Give the last announcement up to 5 s to go out (before the node stops)."""
        task = self._announce_task
        if task is not None and not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=5.0)

    # ----- reading -----

    async def announcements(self) -> tuple[list[Announcement], Announcement | None]:
        """Peers' announcements of this run, and this node's own last one (for its cursor)."""
        entries = await self.dht.get(self.key)
        peers: list[Announcement] = []
        own = None
        for node_id, entry in entries.items():
            announcement = Announcement.from_value(node_id, entry.value)
            if announcement is None:
                self._warn_once(node_id, "ignoring a malformed announcement from %s", node_id[:12])
            elif node_id == self.run.node_id:
                own = announcement
            elif self._same_run(announcement):
                peers.append(announcement)
        return peers, own

    async def peers(self) -> list[Announcement]:
        return (await self.announcements())[0]

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def _same_run(self, announcement: Announcement) -> bool:
        if announcement.run_digest == self.run.run_digest:
            return True
        self._warn_once(
            announcement.node_id,
            "peer %s (%s) runs another configuration (run digest %s… vs ours %s…): not using it",
            announcement.node_id[:12],
            announcement.address,
            announcement.run_digest[:12],
            self.run.run_digest[:12],
        )
        return False

    # ----- deciding -----

    async def expected_peers(self, outer_step: int) -> frozenset[str] | None:
        """Peers that announced this round or the last are expected to offer (matchmaking may end as
        soon as they have); None when the routing table is empty (nobody to wait for)."""
        if not self.dht.peer_count():
            return None
        return frozenset(a.node_id for a in await self.peers() if a.outer_step >= outer_step - 1)

    async def repair_sources(
        self, outer_step: int, agreeing: set[str], missed: bool = False
    ) -> tuple[list[Announcement], str]:
        """The members to repair from, freshest first, and why; no members when no repair is due.

        `agreeing` are the members of a round whose global params disagreed with this node's: it waits
        for one of them to finish the round's outer step, else takes their current snapshots.
        `missed`: the round's group formed without this node; it waits for a member to announce the
        step the swarm is taking, rather than train a round the swarm has closed.
        """
        peers = await self.peers()
        ahead = [a for a in peers if a.outer_step > outer_step]
        if (agreeing or missed) and not ahead:  # the swarm may still be finishing the round's outer step
            ahead = await self._wait_for_peers_ahead(outer_step) or [
                a for a in peers if a.node_id in agreeing
            ]
        if not ahead:
            return [], ""
        why = (
            "its global params disagreed with the swarm's"
            if agreeing
            else (f"it was behind the swarm (outer step {outer_step} < {max(a.outer_step for a in ahead)})")
        )
        ahead.sort(key=lambda a: a.freshness, reverse=True)
        return ahead, why

    async def _wait_for_peers_ahead(self, outer_step: int) -> list[Announcement]:
        deadline = time.monotonic() + self.ahead_wait_s
        while time.monotonic() < deadline and not self.stop.is_set():
            ahead = [a for a in await self.peers() if a.outer_step > outer_step]
            if ahead:
                return ahead
            await asyncio.sleep(0.5)
        return []
