"""The swarm's Kademlia DHT node: publishes its own signed records, reads everyone's.

Records, their validation and their storage are ``dht_records``; this module is the network side:

- Every entry is validated before it is stored (``rpc_store``) and again in every look-up answer a reader
  receives; failures are dropped and counted through ``on_reject(reason)``, reason a ``DHTReject``.
- ``get`` asks the k closest nodes and merges all their answers with the local copy.
- A node re-announces only its own records (at least every ``ttl/3``, re-signed with a higher ``seq``);
  other nodes' entries live on only while their publishers keep announcing them.
- A node finds its swarm again whatever its flags: it keeps its routing contacts in a file (refreshed
  while it runs, read at start) and knocks on them and on its bootstrap peers whenever its routing table
  is empty; while it is not, it still knocks now and then on the bootstrap peers missing from its table,
  so a bootstrap peer that restarted (with an empty table, known to nobody) is found again.

What it replaces of the `kademlia` package, and why, is `kademlia_adapter.py` (the one module that touches
kademlia's and rpcudp's internals, with a test per override).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmnode.net.dht_records import (
    MAX_RECORD_BYTES,
    MAX_SEQ,
    MAX_TTL_S,
    MAX_VALUE_BYTES,
    DHTEntry,
    EntryRejected,
    EntryStorage,
    decode_and_verify_entry,
    dht_key,
    encode_value,
    merge_entries,
    sign_entry,
    to_dht_entry,
    verify_answers,
)
from swarmnode.net.identity import Identity
from swarmnode.net.kademlia_adapter import TAG_BYTES, UNVERIFIED_TIMEOUT_FRACTION, SwarmProtocol, SwarmServer
from swarmnode.util import clock
from swarmnode.util.labels import DHTReject
from swarmnode.util.validate import parse_host_port

logger = logging.getLogger(__name__)

MAINTENANCE_INTERVAL_S = 60.0
"""How often expired entries are culled and lonely routing buckets refreshed."""
REJOIN_INTERVAL_S = 2.0
"""How often a node whose routing table is empty knocks on its bootstrap peers and saved contacts."""
REKNOCK_INTERVAL_S = 15.0
"""How often a node with contacts knocks on the bootstrap peers missing from its routing table."""
CONTACTS_SAVE_INTERVAL_S = 30.0
"""How often the routing contacts are written to the contacts file (when they changed)."""
MAX_SAVED_CONTACTS = 64
_LOOKUP_TIMEOUT_FACTOR = 5
"""A crawl gives up after this many request timeouts and uses what it has."""


@dataclass(frozen=True)
class DHTConfig:
    """Settings of one DHT node."""

    host: str = "127.0.0.1"
    """Interface to bind the UDP socket to."""
    port: int = 0
    """UDP port; 0 picks a free one (see ``SwarmDHT.port``)."""
    ksize: int = 20
    """Kademlia's k: replication factor and bucket size."""
    alpha: int = 3
    """Kademlia's alpha: parallel requests per crawl round."""
    request_timeout_s: float = 2.0
    """How long one request waits for its reply."""
    republish_interval_s: float | None = None
    """How often own records are re-announced; never less often than a third of a record's TTL."""
    client_mode: bool = False
    """Start as a client (a node peers cannot reach): see ``SwarmDHT.set_client_mode``."""
    datagram_key: bytes | None = field(default=None, repr=False)
    """A token swarm's key (``Security.dht_datagram_key``): every datagram is tagged with it and every one
    received without a valid tag is dropped. None: stock rpcudp datagrams."""
    contacts_file: Path | None = None
    """Where the routing contacts are kept across restarts (JSON list of HOST:PORT); None: nowhere."""

    @property
    def unverified_timeout_s(self) -> float:
        """How long a crawl waits for a contact it has not verified: a quarter of the request timeout (0.5 s
        of the default 2 s, a round trip around the world with room). A far honest node that misses it is
        only skipped by that crawl; it still gets in by talking to us."""
        return self.request_timeout_s * UNVERIFIED_TIMEOUT_FRACTION

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"DHT port {self.port} is not in 0..65535")
        if self.ksize < 1 or self.alpha < 1:
            raise ValueError(f"DHT ksize ({self.ksize}) and alpha ({self.alpha}) must be at least 1")
        if self.request_timeout_s <= 0:
            raise ValueError(f"DHT request timeout {self.request_timeout_s} s must be positive")
        if self.republish_interval_s is not None and self.republish_interval_s <= 0:
            raise ValueError(f"DHT republish interval {self.republish_interval_s} s must be positive")
        if self.datagram_key is not None and len(self.datagram_key) < TAG_BYTES:
            raise ValueError(f"DHT datagram key must be at least {TAG_BYTES} bytes")


# --- bootstrap addresses ------------------------------------------------------------------------------------


def parse_peer(peer: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError when it is not one."""
    try:
        return parse_host_port(peer.strip())
    except ValueError:
        raise ValueError(f"DHT peer {peer!r} is not HOST:PORT") from None


async def resolve_peers(peers: Sequence[str], family: int, timeout_s: float) -> list[tuple[str, int]]:
    """Resolve ``host:port`` strings to distinct (ip, port) for a socket of ``family``; skip failures."""
    parsed = [parse_peer(peer) for peer in peers]
    resolved = await asyncio.gather(*(_resolve(host, port, family, timeout_s) for host, port in parsed))
    return list(dict.fromkeys(addr for addr in resolved if addr is not None))


async def _resolve(host: str, port: int, family: int, timeout_s: float) -> tuple[str, int] | None:
    flags = socket.AI_V4MAPPED if family == socket.AF_INET6 else 0
    try:
        async with asyncio.timeout(timeout_s):
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, family=family, type=socket.SOCK_DGRAM, flags=flags
            )
    except (OSError, TimeoutError) as exc:
        logger.warning("DHT bootstrap peer %s:%d does not resolve, skipped: %s", host, port, exc)
        return None
    if not infos:
        return None
    address = infos[0][4]
    return str(address[0]), int(address[1])


def load_contacts(path: Path | None) -> list[str]:
    """The HOST:PORT contacts saved in `path` ([] when there is none, or it is unreadable or malformed:
    a start never fails on it)."""
    if path is None or not path.exists():
        return []
    try:
        saved = json.loads(path.read_bytes()[: 64 * MAX_SAVED_CONTACTS])
        if not isinstance(saved, list):
            raise ValueError("not a list")
        contacts = [str(c) for c in saved[:MAX_SAVED_CONTACTS]]
        for contact in contacts:
            parse_peer(contact)
    except (OSError, ValueError) as exc:
        logger.warning("DHT contacts file %s ignored: %s", path, exc)
        return []
    return contacts


def save_contacts(path: Path, contacts: Sequence[str]) -> None:
    """Write `contacts` to `path` atomically (a crash leaves the old list or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(list(contacts)))
    os.replace(tmp, path)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- the node -----------------------------------------------------------------------------------------------


@dataclass
class _OwnRecord:
    """A record this node publishes and keeps re-announcing until ``withdraw``."""

    value_bytes: bytes
    ttl_s: float
    next_due: float  # monotonic


class SwarmDHT:
    """One DHT node: publishes this identity's signed records and reads everyone's.

    Network failures come back as values (``publish`` returns False, ``get`` returns what it found).
    """

    protocol_class: type[SwarmProtocol] = SwarmProtocol

    def __init__(
        self,
        identity: Identity,
        config: DHTConfig,
        on_reject: Callable[[str], None] | None = None,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        """`on_reject(reason)` counts what validation dropped; `on_request(name)` each request sent."""
        self._on_request = on_request
        self._identity = identity
        self._config = config
        self._on_reject = on_reject
        self._storage = EntryStorage()
        self._server: SwarmServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._own: dict[bytes, _OwnRecord] = {}
        self._last_seq = 0
        self._wake = asyncio.Event()
        self._client_mode = config.client_mode
        self._bootstrap: tuple[str, ...] = ()
        self._saved: list[str] = []  # the contacts as last written to (or read from) the contacts file

    async def start(self, bootstrap: Sequence[str]) -> None:
        """Listen on the configured UDP port and join the swarm through ``bootstrap`` (``host:port``).

        Unresolvable or silent peers are skipped with a warning; with none left this node starts a swarm.
        ValueError when a peer is not ``host:port``.
        """
        for peer in bootstrap:
            parse_peer(peer)
        self._bootstrap = tuple(bootstrap)
        self._saved = load_contacts(self._config.contacts_file)
        server = self._make_server()
        await server.listen(self._config.port, self._config.host)
        self._server = server
        server.protocol.client_mode = self._client_mode
        self._tasks = [
            asyncio.create_task(self._maintenance_loop(), name="dht-maintenance"),
            asyncio.create_task(self._reannounce_loop(), name="dht-reannounce"),
            asyncio.create_task(self._rejoin_loop(), name="dht-rejoin"),
        ]
        await self._join(self._knock_list())
        if self._knock_list() and not self.peer_count():
            logger.warning(
                "DHT node %s reached none of its peers %s yet; retrying in the background",
                self._identity.node_id_hex,
                self._knock_list(),
            )
        logger.info("DHT node %s on %s:%d", self._identity.node_id_hex, self._config.host, self.port)

    def _knock_list(self) -> list[str]:
        """Whom to ask for the swarm: the bootstrap peers, then the contacts this node kept."""
        return list(dict.fromkeys([*self._bootstrap, *self._saved]))

    async def _join(self, peers: Sequence[str]) -> None:
        server = self._running()
        family = server.transport.get_extra_info("socket").family
        addrs = await resolve_peers(peers, family, self._config.request_timeout_s)
        if addrs:
            await server.bootstrap(addrs)

    async def _rejoin_loop(self) -> None:
        """Whenever the routing table is empty — peers that did not listen yet (a compose swarm starting
        at once), a partition that made every contact time out, a restart — knock on the bootstrap peers
        and the saved contacts again; while it is not, knock now and then on the bootstrap peers missing
        from it (one that restarted knows nobody). Keeps the contacts file up to date meanwhile."""
        last_reknock = last_save = time.monotonic()
        while True:
            await asyncio.sleep(REJOIN_INTERVAL_S)
            now = time.monotonic()
            if not self.peer_count() and self._knock_list():
                await self._join(self._knock_list())
                if self.peer_count():
                    logger.info(
                        "DHT node %s (re)joined through %s", self._identity.node_id_hex, self._knock_list()
                    )
            elif now - last_reknock >= REKNOCK_INTERVAL_S:
                last_reknock = now
                await self._knock_missing_bootstrap_peers()
            if now - last_save >= CONTACTS_SAVE_INTERVAL_S or not self._saved:  # (the first at once)
                last_save = now
                self._save_contacts()

    async def _knock_missing_bootstrap_peers(self) -> None:
        server = self._running()
        family = server.transport.get_extra_info("socket").family
        known = {(n.ip, n.port) for bucket in server.protocol.router.buckets for n in bucket.get_nodes()}
        addrs = await resolve_peers(self._bootstrap, family, self._config.request_timeout_s)
        missing = [a for a in addrs if a not in known]
        found = await asyncio.gather(*(server.bootstrap_node(a) for a in missing))
        for addr, node in zip(missing, found, strict=True):
            if node is not None:
                logger.info("DHT node %s: bootstrap peer %s:%d is back", self._identity.node_id_hex, *addr)

    def contacts(self) -> list[str]:
        """HOST:PORT of the nodes in the routing table (at most MAX_SAVED_CONTACTS)."""
        if self._server is None:
            return []
        nodes = [n for bucket in self._server.protocol.router.buckets for n in bucket.get_nodes()]
        return sorted({_host_port(n.ip, n.port) for n in nodes})[:MAX_SAVED_CONTACTS]

    def _save_contacts(self) -> None:
        """Write the routing contacts to the contacts file when they changed; never an empty list over
        a saved one (a node cut off from everyone must still know whom to ask when it is back)."""
        path, contacts = self._config.contacts_file, self.contacts()
        if path is None or not contacts or contacts == self._saved:
            return
        try:
            save_contacts(path, contacts)
        except OSError as exc:
            logger.warning("DHT contacts not saved to %s: %s", path, exc)
            return
        self._saved = contacts

    async def wait_for_peers(self, timeout_s: float) -> bool:
        """True once the routing table holds a node, False if `timeout_s` passes first."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.peer_count():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def _make_server(self) -> SwarmServer:
        config, storage = self._config, self._storage
        server = SwarmServer(
            lambda: self.protocol_class(
                server.node,
                storage,
                config.ksize,
                config.request_timeout_s,
                self._on_reject,
                unverified_timeout_s=config.unverified_timeout_s,
                datagram_key=config.datagram_key,
                on_request=self._on_request,
            ),
            lookup_timeout_s=_LOOKUP_TIMEOUT_FACTOR * config.request_timeout_s,
            ksize=config.ksize,
            alpha=config.alpha,
            node_id=self._identity.node_id,
            storage=storage,
        )
        return server

    async def stop(self) -> None:
        """Save the contacts, cancel every background task and close the socket; safe to call twice."""
        if self._server is not None:
            self._save_contacts()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        server, self._server = self._server, None
        if server is not None:
            await server.protocol.aclose()
            server.stop()
            await asyncio.sleep(0)  # let the transport call connection_lost

    @property
    def client_mode(self) -> bool:
        return self._client_mode

    def set_client_mode(self, client: bool) -> None:
        """A client (peers cannot reach it) queries and stores through others but is never put in their
        routing tables: its requests name no node id and it answers none (kademlia_adapter.py). Leaving
        client mode makes this node a contact again from its next requests on (peers verify it then)."""
        was, self._client_mode = self._client_mode, client
        if self._server is not None:
            self._server.protocol.client_mode = client
            if was and not client and self._knock_list():  # knock again, naming our id: peers verify us
                self._tasks.append(
                    asyncio.create_task(self._join(self._knock_list()), name="dht-rejoin-named")
                )

    @property
    def port(self) -> int:
        """The bound UDP port (the chosen one when configured as 0)."""
        port: int = self._running().transport.get_extra_info("sockname")[1]
        return port

    def peer_count(self) -> int:
        """Nodes in the routing table."""
        return 0 if self._server is None else self._server.peer_count()

    def twin_addresses(self) -> list[str]:
        """HOST:PORT of bootstrap peers that answered with this node's own id: another live process
        holds this identity key."""
        twins = set() if self._server is None else self._server.protocol.twins
        return sorted(f"{host}:{port}" for host, port in twins)

    async def publish(self, key: str, value: dict[str, Any], ttl_s: float) -> bool:
        """Sign ``value`` under ``key`` for ``ttl_s`` seconds, store it here and on the k closest nodes.

        The record is re-announced (re-signed, higher seq, new expiry) until ``withdraw`` or ``stop``.
        True if a remote node holds it or no peer is known yet. ValueError for a bad value or TTL.
        """
        server = self._running()
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"DHT record TTL {ttl_s} s is not in (0, {MAX_TTL_S:g}]")
        value_bytes = encode_value(value)
        if len(value_bytes) > MAX_VALUE_BYTES:
            raise ValueError(f"DHT record for {key!r} is over {MAX_RECORD_BYTES} bytes")
        dkey = dht_key(key)
        self._own[dkey] = _OwnRecord(value_bytes, ttl_s, next_due=0.0)
        stored = await self._announce(server, dkey)
        self._wake.set()
        return stored

    def withdraw(self, key: str) -> None:
        """Stop re-announcing this node's record under ``key``; it then expires on its own."""
        self._own.pop(dht_key(key), None)

    async def get(self, key: str) -> dict[str, DHTEntry]:
        """Every publisher's freshest valid, unexpired entry under ``key``: ours and the k closest nodes'."""
        server = self._running()
        dkey = dht_key(key)
        blobs = await server.lookup(dkey)
        now = clock.now()
        remote = verify_answers(dkey, blobs, now, self._report_rejection)
        merged = merge_entries([*self._storage.entries(dkey), *remote])
        return {sub: to_dht_entry(e) for sub, e in merged.items() if e.expires_at > now}

    def verify(self, key: str, signed: bytes) -> DHTEntry | None:
        """The entry a peer passed on (`DHTEntry.signed`, read under `key`) if its publisher signed it
        and it has not expired; None otherwise. Checked like a look-up answer, without a look-up."""
        try:
            entry = decode_and_verify_entry(dht_key(key), signed, clock.now())
        except EntryRejected:
            return None
        return to_dht_entry(entry)

    def _report_rejection(self, reason: DHTReject) -> None:
        if self._server is not None:
            self._server.protocol.report_rejection(reason, "a look-up answer")

    def _running(self) -> SwarmServer:
        if self._server is None:
            raise RuntimeError("SwarmDHT is not started")
        return self._server

    def _next_seq(self) -> int:
        """A seq above every one this process used; time-based so it also rises across restarts."""
        self._last_seq = min(max(clock.now_ns(), self._last_seq + 1), MAX_SEQ)
        return self._last_seq

    async def _announce(self, server: SwarmServer, dkey: bytes) -> bool:
        record = self._own[dkey]
        interval = min(self._config.republish_interval_s or math.inf, record.ttl_s / 3)
        record.next_due = time.monotonic() + interval
        entry = sign_entry(
            self._identity, dkey, record.value_bytes, self._next_seq(), clock.now() + record.ttl_s
        )
        self._storage.merge(dkey, entry)
        stored = await server.store_remote(dkey, entry)
        if not stored:
            logger.warning("DHT node %s: no peer took record %s", self._identity.node_id_hex, dkey.hex())
        return stored

    async def _reannounce_loop(self) -> None:
        """Re-announce each own record when it is due; other nodes' records are never republished."""
        while True:
            await self._wait_for_due()
            now = time.monotonic()
            for dkey in [k for k, r in self._own.items() if r.next_due <= now]:
                if dkey not in self._own:
                    continue  # withdrawn meanwhile
                try:
                    await self._announce(self._running(), dkey)
                except Exception:
                    logger.exception("DHT node %s: re-announce failed", self._identity.node_id_hex)

    async def _wait_for_due(self) -> None:
        self._wake.clear()
        next_due = min((r.next_due for r in self._own.values()), default=None)
        delay = None if next_due is None else max(0.0, next_due - time.monotonic())
        try:
            async with asyncio.timeout(delay):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _maintenance_loop(self) -> None:
        """Cull expired entries and refresh lonely routing buckets."""
        while True:
            await asyncio.sleep(MAINTENANCE_INTERVAL_S)
            try:
                self._storage.cull()
                await self._running()._refresh_table()
            except Exception:
                logger.exception("DHT node %s: maintenance failed", self._identity.node_id_hex)
