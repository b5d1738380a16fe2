"""The node's view of the swarm, through the snapshot announcements in the DHT (see announcements.py).

A node announces each snapshot it writes (a newer one supersedes an announcement still in flight) and
reads its peers' announcements of the same run; a malformed one, or one of another configuration (run
digest), is ignored with one warning per peer. From them it learns which peers a round should expect and
whether it must catch up: when its global params went astray (its digest was in a round's minority) or
its outer step is behind, the up-to-date members to repair from, freshest first.

One identity, one process: DHT entries under this node's own id that name another address (a copied
data dir, or one `--identity` file given to two nodes) are probed over gRPC; if a live node there
answers with this node id, the younger of the two is the duplicate. At start that is this node
(`DuplicateIdentity`, exit 2); later, each reads the other's uptime and only the younger one stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from swarmnode.core.training import RunIdentity, settings_differences
from swarmnode.net import rpc, snapshot_client
from swarmnode.net.dht import SwarmDHT
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.swarm.announcements import (
    ANNOUNCE_TTL_S,
    PRESENCE_TTL_S,
    Announcement,
    Presence,
    members_key,
    snapshots_key,
)
from swarmnode.swarm.averaging.matchmaking import Offer, round_key
from swarmnode.util.errors import ConfigError
from swarmnode.util.labels import SnapshotKind

logger = logging.getLogger(__name__)

IDENTITY_PROBE_TIMEOUT_S = 3.0
IDENTITY_PROBE_INTERVAL_S = 30.0
"""A running node probes an address that claims its identity at most this often."""


class DuplicateIdentity(ConfigError):
    """Another live process runs with this node's identity (one line naming --identity: exit 2)."""


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
        uptime_s: Callable[[], float] = lambda: 0.0,
        on_duplicate: Callable[[DuplicateIdentity], None] | None = None,
        channels: rpc.ChannelCache | None = None,
        reachable: Callable[[], bool] = lambda: True,
    ) -> None:
        """`uptime_s()`: how long this node has run; `on_duplicate` is told, once, when this running
        node turns out to be the younger of two with one identity; `reachable()`: this node's mode now
        (a client announces no address, docs/design.md "Behind NAT")."""
        self.reachable = reachable
        self.dht, self.key, self.run, self.address = dht, snapshots_key(dht_run), run, address
        self.round_key = round_key(dht_run)
        self.members_key = members_key(dht_run)
        self.stop, self.ahead_wait_s = stop, ahead_wait_s
        self.uptime_s, self.on_duplicate, self.channels = uptime_s, on_duplicate, channels
        self._warned: set[str] = set()
        self._explaining: set[asyncio.Task[None]] = set()
        self._announce_task: asyncio.Task[None] | None = None
        self._probed: dict[str, float] = {}  # address -> when it was last probed (monotonic)
        self._probe_task: asyncio.Task[None] | None = None
        self._duplicate_found = False

    # ----- announcing -----

    def announce(self, info: SnapshotInfo) -> None:
        """Publish `info` in the background (call on the event loop); it supersedes one in flight.
        Nothing is published once this node is known to be a duplicate (the entry is the other's)."""
        if self.on_duplicate is None and self._duplicate_found:
            return
        previous = self._announce_task
        self._announce_task = asyncio.create_task(self._announce(info, previous))

    async def _announce(self, info: SnapshotInfo, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and not previous.done():
            previous.cancel()  # a newer snapshot supersedes it
            with contextlib.suppress(asyncio.CancelledError):
                await previous
        reachable = self.reachable()
        announcement = Announcement(
            self.run.node_id,
            self.address if reachable else "",
            info.snapshot_id,
            info.size_bytes,
            info.outer_step,
            info.inner_step,
            SnapshotKind(info.kind),
            info.created_at,
            self.run.run_digest,
            info.cursor,
            reachable,
        )
        try:
            await self.dht.publish(self.key, announcement.to_value(), ANNOUNCE_TTL_S)
        except ValueError as exc:  # a record over the size cap is a bug, but must not stop training
            logger.error("announcement of %s refused locally: %s", info.snapshot_id[:12], exc)
        except (OSError, AttributeError, RuntimeError) as exc:  # the DHT socket closed under a late task
            logger.debug("announcement of %s not sent: %s", info.snapshot_id[:12], exc)

    async def present(self) -> None:
        """Publish (again) that this node runs in this run; the DHT re-announces it while it runs."""
        presence = Presence(self.run.run_digest, self.reachable())
        try:
            await self.dht.publish(self.members_key, msgspec.to_builtins(presence), PRESENCE_TTL_S)
        except (OSError, RuntimeError) as exc:
            logger.debug("presence not published: %s", exc)

    async def members_seen(self) -> set[str]:
        """The other nodes known to run in this run: their presence or their snapshot announcements
        (of this run's configuration)."""
        announced = {a.node_id for a in await self.peers()}
        return (await self._present() | announced) - {self.run.node_id}

    async def _present(self) -> set[str]:
        """The nodes whose presence in this run (this configuration) is in the DHT."""
        entries = await self.dht.get(self.members_key)
        return {
            node_id
            for node_id, entry in entries.items()
            if (p := Presence.from_value(node_id, entry.value)) is not None
            and p.run_digest == self.run.run_digest
        }

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
                if announcement.address:
                    self._watch_own_address(announcement.address)
            elif self._same_run(announcement):
                peers.append(announcement)
        return peers, own

    async def peers(self) -> list[Announcement]:
        return (await self.announcements())[0]

    async def servers(self) -> list[Announcement]:
        """The peers that serve their snapshots: never a client, which nobody can dial."""
        return [a for a in await self.peers() if a.serves]

    # ----- one identity, one process -----

    async def refuse_if_duplicate(self) -> None:
        """At start: DuplicateIdentity if a live node at another address answers with this node's id
        (a bootstrap peer's DHT answer, or the address its announcement or round offer names)."""
        for address in self.dht.twin_addresses():
            raise DuplicateIdentity(
                f"--identity: node id {self.run.node_id} is already running (its DHT answers at {address}); "
                "every node needs its own identity key (its own --data-dir or --identity)"
            )
        for address in await self._own_addresses():
            status = await self._probe(address)
            if status is not None:
                raise DuplicateIdentity(
                    f"--identity: node id {self.run.node_id} is already running at {address} (up "
                    f"{status.uptime_s:.0f} s); every node needs its own identity key (its own --data-dir "
                    "or --identity)"
                )

    async def _own_addresses(self) -> set[str]:
        """Addresses other than this node's that DHT entries under its own id name."""
        me = self.run.node_id
        announced = (await self.dht.get(self.key)).get(me)
        offered = (await self.dht.get(self.round_key)).get(me)
        values = [
            Announcement.from_value(me, announced.value) if announced is not None else None,
            Offer.from_entry(me, offered) if offered is not None else None,
        ]
        return {v.address for v in values if v is not None and v.address and v.address != self.address}

    async def _probe(self, address: str) -> rpc.NodeStatus | None:
        """The status of a live node at `address` that has this node's id, else None."""
        self._probed[address] = time.monotonic()
        try:
            status = await snapshot_client.get_status(address, IDENTITY_PROBE_TIMEOUT_S, self.channels)
        except (rpc.PeerUnavailable, ValueError):
            return None
        return status if status.node_id == self.run.node_id else None

    def _watch_own_address(self, address: str) -> None:
        """While running: an own-id entry at another address is probed (at most every
        IDENTITY_PROBE_INTERVAL_S); of two live nodes with one identity, the younger is told to go."""
        last = self._probed.get(address)
        busy = self._probe_task is not None and not self._probe_task.done()
        if address == self.address or busy or (last and time.monotonic() - last < IDENTITY_PROBE_INTERVAL_S):
            return
        self._probe_task = asyncio.create_task(self._settle_duplicate(address))

    async def _settle_duplicate(self, address: str) -> None:
        status = await self._probe(address)
        if status is None:
            return
        mine = self.uptime_s()
        if status.uptime_s <= mine:
            self._warn_once(
                f"duplicate {address}",
                "node id %s also runs at %s (up %.0f s, this node %.0f s): that younger process is the "
                "duplicate and stops",
                self.run.node_id[:12],
                address,
                status.uptime_s,
                mine,
            )
            return
        self._duplicate_found = True
        if self.on_duplicate is not None:
            self.on_duplicate(
                DuplicateIdentity(
                    f"--identity: node id {self.run.node_id} already runs at {address} (up "
                    f"{status.uptime_s:.0f} s, this process {mine:.0f} s); every node needs its own "
                    "identity key (its own --data-dir or --identity)"
                )
            )
            self.on_duplicate = None

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def _same_run(self, announcement: Announcement) -> bool:
        if announcement.run_digest == self.run.run_digest:
            return True
        if announcement.node_id not in self._warned:
            self._warned.add(announcement.node_id)
            task = asyncio.create_task(self._name_other_configuration(announcement))
            self._explaining.add(task)
            task.add_done_callback(self._explaining.discard)
        return False

    async def _name_other_configuration(self, announcement: Announcement) -> None:
        """Logs, once per peer, that it runs another configuration and which settings differ (asked of
        the peer's status; by digest only when it cannot be asked or answers no settings)."""
        differences: list[str] = []
        if announcement.address and self.run.settings:
            with contextlib.suppress(rpc.PeerUnavailable, ValueError):
                status = await snapshot_client.get_status(
                    announcement.address, IDENTITY_PROBE_TIMEOUT_S, self.channels
                )
                if status.node_id == announcement.node_id and status.run_settings:
                    differences = settings_differences(self.run.settings, status.run_settings)
        logger.warning(
            "peer %s (%s) runs another configuration, not using it: %s",
            announcement.node_id[:12],
            announcement.address or "a client",
            "; ".join(differences)
            or f"run digest {announcement.run_digest[:12]}… vs ours {self.run.run_digest[:12]}…",
        )

    # ----- deciding -----

    async def expected_peers(self, outer_step: int) -> frozenset[str] | None:
        """Peers that announced this round or the last, and members that announced nothing yet (they
        just started: their first offer is on its way), are expected to offer (matchmaking may end as
        soon as they have); None when the routing table is empty (nobody to wait for). Clients are
        expected too: their offers are read from the DHT like anyone's, nobody dials them."""
        if not self.dht.peer_count():
            return None
        peers = await self.peers()
        recent = {a.node_id for a in peers if a.outer_step >= outer_step - 1}
        starting = await self._present() - {a.node_id for a in peers} - {self.run.node_id}
        return frozenset(recent | starting)

    async def repair_sources(
        self, outer_step: int, agreeing: set[str], missed: bool = False
    ) -> tuple[list[Announcement], str]:
        """The members to repair from, freshest first, and why; no members when no repair is due.

        `agreeing` are the members of a round whose global params disagreed with this node's: it waits
        for one of them to finish the round's outer step, else takes their current snapshots.
        `missed`: the round's group formed without this node; it waits for a member to announce the
        step the swarm is taking, rather than train a round the swarm has closed.
        """
        peers = await self.servers()  # a client's snapshots are never fetched: nobody can dial it
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
            ahead = [a for a in await self.servers() if a.outer_step > outer_step]
            if ahead:
                return ahead
            await asyncio.sleep(0.5)
        return []
