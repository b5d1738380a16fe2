"""The adapter between swarmnode and the `kademlia` (2.2.3) and `rpcudp` (5.0.1) packages: every
override of their internals lives here, named in `UPSTREAM` with the upstream signature it was written
against, and tests/unit/test_kademlia_adapter.py checks each one, so a version bump fails in the tests,
never silently in a swarm. The package is kept (it is what the swarm's DHT is built on); these are the
behaviours replaced, each by subclassing (never by patching the package):

- one unversioned value per key that any UDP sender overwrites: ``EntryStorage`` merges signed entries;
- ``get`` returns the local copy or the first answer: ``SwarmDHT.get`` collects and merges all answers;
- records age by insertion time and every holder republishes everything hourly, so stale values return:
  expiry is the entry's own signed ``expires_at`` and ``SwarmServer._refresh_table`` republishes nothing;
- ``welcome_if_new`` hashes already-hashed keys, so hand-off to a new node targets the wrong keys:
  ``SwarmProtocol.welcome_if_new`` uses the stored digests and sends the signed entries;
- ``bootstrap`` takes IP addresses only: ``SwarmDHT.start`` resolves ``host:port`` names first;
- a request over 8 KB fails (after the local store) and a reply over ~65 KB is dropped silently: a store
  carries one entry of at most ``MAX_RECORD_BYTES`` and a look-up answer at most ``MAX_ANSWER_ENTRY_BYTES``
  of entries (about 5 full-size ones or ~20 of 300 bytes), the freshest (latest ``expires_at``) first. So a
  key with more publishers than fit shows a reader only the freshest ones: keys must stay small (one entry
  per node of a run, pointers only);
- ``load_state``/``save_state`` unpickle/pickle: disabled, as are the unsigned ``set``/``get`` paths;
- a malformed node list or node id in a request or answer raises inside the crawl: validated here;
- rpcudp sets results on futures a caller had cancelled: ignored here, so look-ups can be cancelled;
- ``asyncio.get_event_loop`` and fire-and-forget tasks: this module owns its tasks and cancels them on stop;
- any datagram framed as a request, from any claimed node id, and any answer to our requests made a routing
  contact, so forged pings filled routing tables with nodes that never answer (every look-up then waited out
  request timeouts, and ``find_node`` answers spread them). Here a contact enters the table, or moves to a
  new address, only once it answered a ping *we* sent to that address with exactly its node id
  (``SwarmProtocol.welcome_if_new`` admits only such contacts), and a contact that moved goes back if its
  old address still answers with its id; a request's sender and a crawl's answerer are only scheduled for
  that check, within bounds (``MAX_VERIFYING_PER_SOURCE`` per source IP, ``MAX_VERIFYING`` in all, a failed
  (address, id) not tried again for ``VERIFY_RETRY_S``);
- requests from *strangers* (senders that are not verified contacts at their address) are answered only
  while their source IP has tokens (``STRANGER_RATE_PER_S``, ``STRANGER_BURST``); the rest are dropped and
  counted as ``throttled``. Verified contacts are never throttled, so a flood from a host does not starve
  the honest nodes on it;
- a crawl waits for a contact that is not a verified one only ``DHTConfig.unverified_timeout_s`` (a quarter
  of the request timeout), and asks every such contact among the k nearest at once, so a lying answer full
  of dead contacts costs one short wait;
- with a swarm token (``DHTConfig.datagram_key``) every datagram carries a tag (``datagram_tag``) that is
  checked before anything is parsed: outsiders' datagrams are dropped and counted as ``unauthenticated``.
  Without a token the wire format is stock rpcudp, so a stock ``kademlia`` client can still bootstrap.

Not addressed: node ids are not bound to keys in the routing layer, so a host that answers can still claim
any unused id at each port it owns (Sybil/eclipse attacks by real, answering hosts), and a live contact's
id claimed elsewhere is held at the claimer's address until the old address answered again; a token
swarm's datagrams can be replayed by an on-path observer (answers match only our own pending msg ids); a
node joining from the same IP as an ongoing flood of strangers may be throttled until it ends; and
kademlia's ``RoutingTable.add_contact`` still pings a full bucket's head with a fire-and-forget future.
- client mode (``SwarmProtocol.client_mode``, a node peers cannot reach: docs/design.md "Behind NAT"), as
  Kademlia's and hivemind's client nodes: its requests name no node id (nil where the sender's id goes),
  so no receiver schedules it for verification or puts it in a routing table, and it answers no
  requests; it still bootstraps, crawls, stores and looks up through others. Anonymous requests are
  answered (``rpc_store`` validates the signed entry as always) within the strangers' rate of their IP.
- FIND_VALUE for a key we hold nothing under answers as the stock protocol expects (the list of our
  closest contacts), so a stock kademlia client's ``get`` finds nothing instead of raising TypeError.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeGuard

import umsgpack
from kademlia.crawling import NodeSpiderCrawl
from kademlia.network import Server
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.utils import gather_dict
from rpcudp.exceptions import MalformedMessage

from swarmnode.net.dht_records import (
    EntryRejected,
    EntryStorage,
    MergeResult,
    SignedEntry,
    decode_and_verify_entry,
    encode_entry,
)
from swarmnode.net.identity import NODE_ID_BYTES
from swarmnode.util import clock
from swarmnode.util.aio import settle
from swarmnode.util.labels import DHTReject
from swarmnode.util.ratelimit import TokenBuckets

logger = logging.getLogger(__name__)

MAX_ANSWER_ENTRY_BYTES = 6000
"""Entry bytes in one look-up answer; with k=20 node contacts the reply stays under ~8 KB."""
MAX_ANSWER_ITEMS = 64
"""Entries or contacts read from one answer; more are ignored (a legitimate answer has fewer)."""
_HANDOFF_BATCH = 8
_MAX_REQUEST_BYTES = 8192
"""rpcudp's limit on a request's encoded name and arguments."""
UNVERIFIED_TIMEOUT_FRACTION = 0.25
"""A crawl request to a contact that is not a verified one waits this fraction of the request timeout."""
STRANGER_RATE_PER_S = 20.0
"""Requests per second answered from one source IP's strangers (senders not verified at their address)."""
STRANGER_BURST = 50
"""Depth of a source IP's token bucket: a joining node's first exchanges fit in it many times over."""
MAX_VERIFYING_PER_SOURCE = 4
"""Verification pings outstanding to one IP at a time; further candidates there are not scheduled."""
MAX_VERIFYING = 64
"""Verification pings outstanding in all."""
VERIFY_RETRY_S = 60.0
"""An (address, node id) that failed verification is not tried again for this long."""
MAX_TRACKED_SOURCES = 4096
"""Source IPs with a token bucket, and failed (address, id) pairs, remembered at most (oldest forgotten)."""
TAG_BYTES = 16
"""Length of the truncated HMAC-SHA256 tag a token swarm appends to every datagram."""


UPSTREAM_VERSIONS = {"kademlia": "2.2.3", "rpcudp": "5.0.1"}
"""The versions these overrides were written against (pinned in pyproject.toml)."""
UPSTREAM: dict[tuple[str, str], str] = {
    # rpcudp's datagram handling: tagging, refusal counting, cancellable requests.
    ("rpcudp.protocol", "RPCProtocol.__init__"): "(self, wait_timeout=5)",
    ("rpcudp.protocol", "RPCProtocol.connection_made"): "(self, transport)",
    ("rpcudp.protocol", "RPCProtocol.datagram_received"): "(self, data, addr)",
    ("rpcudp.protocol", "RPCProtocol._solve_datagram"): "(self, datagram, address)",
    ("rpcudp.protocol", "RPCProtocol._accept_request"): "(self, msg_id, data, address)",
    ("rpcudp.protocol", "RPCProtocol._accept_response"): "(self, msg_id, data, address)",
    ("rpcudp.protocol", "RPCProtocol._timeout"): "(self, msg_id)",
    # kademlia's protocol: validated handlers, verified admission, signed hand-off, crawl timeouts.
    ("kademlia.protocol", "KademliaProtocol.__init__"): "(self, source_node, storage, ksize)",
    ("kademlia.protocol", "KademliaProtocol.rpc_ping"): "(self, sender, nodeid)",
    ("kademlia.protocol", "KademliaProtocol.rpc_store"): "(self, sender, nodeid, key, value)",
    ("kademlia.protocol", "KademliaProtocol.rpc_find_node"): "(self, sender, nodeid, key)",
    ("kademlia.protocol", "KademliaProtocol.rpc_find_value"): "(self, sender, nodeid, key)",
    ("kademlia.protocol", "KademliaProtocol.welcome_if_new"): "(self, node)",
    ("kademlia.protocol", "KademliaProtocol.handle_call_response"): "(self, result, node)",
    ("kademlia.protocol", "KademliaProtocol.call_find_node"): "(self, node_to_ask, node_to_find)",
    ("kademlia.protocol", "KademliaProtocol.call_find_value"): "(self, node_to_ask, node_to_find)",
    ("kademlia.protocol", "KademliaProtocol.call_ping"): "(self, node_to_ask)",
    ("kademlia.protocol", "KademliaProtocol.call_store"): "(self, node_to_ask, key, value)",
    ("kademlia.protocol", "KademliaProtocol.get_refresh_ids"): "(self)",
    # kademlia's crawls: defensive answer parsing, all unverified contacts asked at once.
    ("kademlia.crawling", "SpiderCrawl.__init__"): "(self, protocol, node, peers, ksize, alpha)",
    ("kademlia.crawling", "SpiderCrawl._find"): "(self, rpcmethod)",
    ("kademlia.crawling", "NodeSpiderCrawl.find"): "(self)",
    ("kademlia.crawling", "NodeSpiderCrawl._nodes_found"): "(self, responses)",
    # kademlia's server: our protocol, no republish of others' records, the unsigned paths disabled.
    ("kademlia.network", "Server.__init__"): "(self, ksize=20, alpha=3, node_id=None, storage=None)",
    ("kademlia.network", "Server.listen"): "(self, port, interface='0.0.0.0')",
    ("kademlia.network", "Server._create_protocol"): "(self)",
    ("kademlia.network", "Server._refresh_table"): "(self)",
    ("kademlia.network", "Server.bootstrap"): "(self, addrs)",
    ("kademlia.network", "Server.bootstrap_node"): "(self, addr)",
    ("kademlia.network", "Server.get"): "(self, key)",
    ("kademlia.network", "Server.set"): "(self, key, value)",
    ("kademlia.network", "Server.set_digest"): "(self, dkey, value)",
    ("kademlia.network", "Server.refresh_table"): "(self, interval=3600)",
    ("kademlia.network", "Server.save_state"): "(self, fname)",
    ("kademlia.network", "Server.save_state_regularly"): "(self, fname, frequency=600)",
    ("kademlia.network", "Server.load_state"): "(fname, port, interface='0.0.0.0')",
    ("kademlia.network", "Server.stop"): "(self)",
    # kademlia internals read or driven here: the routing table, a crawl's heap, gather_dict.
    ("kademlia.routing", "RoutingTable.is_new_node"): "(self, node)",
    ("kademlia.routing", "RoutingTable.add_contact"): "(self, node)",
    ("kademlia.routing", "RoutingTable.remove_contact"): "(self, node)",
    ("kademlia.routing", "RoutingTable.find_neighbors"): "(self, node, k=None, exclude=None)",
    ("kademlia.routing", "RoutingTable.get_bucket_for"): "(self, node)",
    ("kademlia.node", "NodeHeap.push"): "(self, nodes)",
    ("kademlia.node", "NodeHeap.remove"): "(self, peers)",
    ("kademlia.node", "NodeHeap.get_uncontacted"): "(self)",
    ("kademlia.node", "NodeHeap.mark_contacted"): "(self, node)",
    ("kademlia.node", "NodeHeap.have_contacted_all"): "(self)",
    ("kademlia.node", "NodeHeap.get_ids"): "(self)",
    ("kademlia.utils", "gather_dict"): "(dic)",
}
"""Every upstream member this module overrides or relies on, with the signature it was written against
(the attributes read: `RPCProtocol._outstanding` and `_wait_timeout`, `KademliaProtocol.router`,
`storage` and `source_node`, `KBucket.nodes`, `SpiderCrawl.nearest` and `last_ids_crawled`,
`Server.protocol`, `transport` and `node`, are checked on live objects by the test)."""


# --- wire helpers -------------------------------------------------------------------------------------------


def _is_node_id(value: object) -> TypeGuard[bytes]:
    return isinstance(value, bytes) and len(value) == NODE_ID_BYTES


def _contact(sender: object, nodeid: object) -> Node | None:
    """The sender of a request as a routing contact, or None when its node id is not one."""
    if not _is_node_id(nodeid) or not isinstance(sender, tuple) or len(sender) < 2:
        return None
    return Node(nodeid, sender[0], sender[1])


def _parse_contacts(items: object) -> list[Node]:
    """Contacts from an answer's ``[[id, ip, port], ...]``; malformed ones are skipped."""
    if not isinstance(items, list):
        return []
    nodes = []
    for item in items[:MAX_ANSWER_ITEMS]:
        if isinstance(item, list | tuple) and len(item) == 3:
            node_id, ip, port = item
            if _is_node_id(node_id) and isinstance(ip, str) and isinstance(port, int) and 0 < port < 65536:
                nodes.append(Node(node_id, ip, port))
    return nodes


def _parse_value_answer(answer: object) -> tuple[list[object], list[Node]]:
    """(entry blobs, contacts) of a find_value answer: ``{"value": [blob, ...], "nodes": [...]}``."""
    if isinstance(answer, list):
        return [], _parse_contacts(answer)
    if not isinstance(answer, dict):
        return [], []
    blobs = answer.get("value")
    return (blobs[:MAX_ANSWER_ITEMS] if isinstance(blobs, list) else []), _parse_contacts(answer.get("nodes"))


def _sample_that_fit(entries: list[SignedEntry], budget: int) -> list[bytes]:
    """Every entry, freshest first, when they fit in ``budget`` bytes; else a random sample that fits.

    A key with more publishers than one answer holds (a round's offers in a swarm of dozens: about 15
    fit) would otherwise answer every reader with the same freshest ones, and the oldest — the round's
    leader, whose offer came first — would reach nobody who does not hold the key itself. Each of the
    k answers a look-up merges is its own sample, so together they cover the key."""
    encoded = [(entry.expires_at, encode_entry(entry)) for entry in entries]  # each encoded once
    if sum(len(blob) + 3 for _, blob in encoded) <= budget:  # msgpack's bin16 header
        return [blob for _, blob in sorted(encoded, key=lambda pair: pair[0], reverse=True)]
    random.shuffle(encoded)  # our own list: the caller's stays as it was
    blobs = []
    for _, blob in encoded:
        budget -= len(blob) + 3
        if budget < 0:
            break
        blobs.append(blob)
    return blobs


def datagram_tag(key: bytes, data: bytes) -> bytes:
    """The tag a token swarm appends to ``data``: HMAC-SHA256 under ``key``, truncated to ``TAG_BYTES``."""
    return hmac.new(key, data, hashlib.sha256).digest()[:TAG_BYTES]


class _TaggingTransport:
    """A datagram transport's ``sendto`` with ``datagram_tag`` appended to every datagram."""

    def __init__(self, transport: Any, key: bytes) -> None:
        self._transport = transport
        self._key = key

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._transport.sendto(data + datagram_tag(self._key, data), addr)


# --- admission ----------------------------------------------------------------------------------------------


_Candidate = tuple[str, int, bytes]  # (ip, port, node id) of a contact to verify


def _candidate(node: Node) -> _Candidate:
    return node.ip, node.port, node.id


class _VerificationSlots:
    """Which contacts may be sent a verification ping now: none already pending, none that failed less
    than ``retry_after_s`` ago, at most ``per_source`` pending per IP and ``total`` in all."""

    def __init__(
        self,
        per_source: int,
        total: int,
        retry_after_s: float,
        max_failures: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_source, self._total, self._retry_after_s = per_source, total, retry_after_s
        self._max_failures, self._clock = max_failures, clock
        self._pending: set[_Candidate] = set()
        self._pending_per_ip: Counter[str] = Counter()
        self._failed: OrderedDict[_Candidate, float] = OrderedDict()  # candidate -> when it failed

    def acquire(self, node: Node) -> bool:
        """Take a slot for ``node``; False when it may not be verified now."""
        candidate = _candidate(node)
        failed_at = self._failed.get(candidate)
        if failed_at is not None and self._clock() - failed_at < self._retry_after_s:
            return False
        if (
            candidate in self._pending
            or self._pending_per_ip[node.ip] >= self._per_source
            or len(self._pending) >= self._total
        ):
            return False
        self._pending.add(candidate)
        self._pending_per_ip[node.ip] += 1
        return True

    def release(self, node: Node, verified: bool) -> None:
        """Give ``node``'s slot back; a failure is remembered for ``retry_after_s``."""
        candidate = _candidate(node)
        self._pending.discard(candidate)
        self._pending_per_ip[node.ip] -= 1
        if self._pending_per_ip[node.ip] <= 0:
            del self._pending_per_ip[node.ip]
        self._failed.pop(candidate, None)
        if not verified:
            self.refuse(node)

    def refuse(self, node: Node) -> None:
        """Count ``node`` as failed now: not verified again for ``retry_after_s``."""
        self._failed[_candidate(node)] = self._clock()
        if len(self._failed) > self._max_failures:
            self._failed.popitem(last=False)


# --- protocol -----------------------------------------------------------------------------------------------


class SwarmProtocol(KademliaProtocol):
    """Kademlia's protocol with validated requests, signed dictionary values, a working hand-off, routing
    contacts admitted only once they proved their id, throttled strangers and, with a key, tagged datagrams.
    """

    def __init__(
        self,
        source_node: Node,
        storage: EntryStorage,
        ksize: int,
        wait_timeout_s: float = 5.0,
        on_reject: Callable[[str], None] | None = None,
        *,
        unverified_timeout_s: float | None = None,
        datagram_key: bytes | None = None,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        """`on_request(name)` is told of each request sent (ping, store, find_node, find_value)."""
        super().__init__(source_node, storage, ksize)
        self._on_request = on_request
        self._wait_timeout = wait_timeout_s  # rpcudp's per-request timeout
        self._unverified_timeout = unverified_timeout_s or wait_timeout_s * UNVERIFIED_TIMEOUT_FRACTION
        self._datagram_key = datagram_key
        self._on_reject = on_reject
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()
        self._strangers = TokenBuckets(STRANGER_RATE_PER_S, STRANGER_BURST, MAX_TRACKED_SOURCES)
        self._slots = _VerificationSlots(
            MAX_VERIFYING_PER_SOURCE, MAX_VERIFYING, VERIFY_RETRY_S, MAX_TRACKED_SOURCES
        )
        self.client_mode = False
        """True: requests carry no node id and requests from others are not answered (see above)."""
        self.twins: set[tuple[str, int]] = set()
        """Addresses of other processes that answered our ping with our own node id (one identity key
        in two processes: the node refuses to go on, see `SwarmDHT.twin_addresses`)."""

    def report_rejection(self, reason: DHTReject, sender: object = None, what: str = "an entry") -> None:
        """Count a refused entry (or ``what`` else); log the first of each reason at warning, the rest at
        debug level."""
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        node = self.source_node.id.hex()
        logger.log(level, "DHT node %s refused %s from %s: %s", node, what, sender, reason)
        if self._on_reject is not None:
            self._on_reject(reason)

    @property
    def sender_id(self) -> bytes | None:
        """The node id our requests name: none in client mode."""
        return None if self.client_mode else bytes(self.source_node.id)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(
            transport if self._datagram_key is None else _TaggingTransport(transport, self._datagram_key)
        )

    def rpc_ping(self, sender: tuple[str, int], nodeid: object) -> bytes:
        source = _contact(sender, nodeid)
        if source is not None:
            self._note_sender(source)
        node_id: bytes = self.source_node.id
        return node_id

    def rpc_store(self, sender: tuple[str, int], nodeid: object, key: object, value: object) -> bool:
        """Store one signed entry after validating it; True when it is held (now or already). A
        client's store names no sender (its entry is signed all the same)."""
        source = _contact(sender, nodeid)
        if (source is None and nodeid is not None) or not _is_node_id(key):
            return False
        if source is not None:
            self._note_sender(source)
        try:
            entry = decode_and_verify_entry(key, value, clock.now())
        except EntryRejected as exc:
            if exc.counted:
                self.report_rejection(exc.reason, sender)
            return False
        result = self.storage.merge(key, entry)
        if result is MergeResult.QUOTA:
            self.report_rejection(DHTReject.QUOTA, sender)
        return result in (MergeResult.STORED, MergeResult.UNCHANGED)

    def rpc_find_node(self, sender: tuple[str, int], nodeid: object, key: object) -> list[tuple[Any, ...]]:
        source = _contact(sender, nodeid)
        if (source is None and nodeid is not None) or not _is_node_id(key):
            return []
        if source is not None:
            self._note_sender(source)
        neighbors = self.router.find_neighbors(Node(key), exclude=source)
        return [tuple(n) for n in neighbors]

    def rpc_find_value(
        self, sender: tuple[str, int], nodeid: object, key: object
    ) -> dict[str, Any] | list[tuple[Any, ...]]:
        """Our freshest entries under ``key`` that fit in one answer, and our closest contacts to it. For
        a key we hold nothing under, the answer is what the stock protocol expects — the list of our
        closest contacts — so a stock kademlia client's ``get`` goes on looking instead of failing."""
        nodes = self.rpc_find_node(sender, nodeid, key)
        entries = self.storage.entries(key) if _is_node_id(key) else []
        if not entries:
            return nodes
        return {"value": _sample_that_fit(entries, MAX_ANSWER_ENTRY_BYTES), "nodes": nodes}

    # --- admission: who becomes a routing contact ---

    def is_verified(self, node: Node) -> bool:
        """True when the routing table holds ``node``'s id at ``node``'s address (it proved that id there)."""
        held = self._held(node)
        return held is not None and bool(held.same_home_as(node))

    def _held(self, node: Node) -> Node | None:
        """The routing table's contact with ``node``'s id (at whatever address), if any."""
        held: Node | None = self.router.buckets[self.router.get_bucket_for(node)].nodes.get(node.id)
        return held

    def _note_sender(self, source: Node) -> None:
        """A request's sender: a verified contact is refreshed; anyone else is only scheduled for
        verification, never added on its own word."""
        if self.is_verified(source):
            self.router.add_contact(source)  # moves it to the bucket's tail (most recently seen)
        else:
            self._verify_later(source)

    def _verify_later(self, node: Node) -> None:
        """Ping ``node`` at its address now; it is admitted (``welcome_if_new``) once the answer is exactly
        its id. Nothing happens when the verification slots refuse it (one pending already, a recent
        failure, too many pending for its IP or in all)."""
        if node.id == self.source_node.id or not self._slots.acquire(node):
            return
        answer = self._request((node.ip, node.port), self._wait_timeout, "ping", self.sender_id)
        self._spawn(self._await_verification(node, answer))

    async def _await_verification(self, node: Node, answer: asyncio.Future[tuple[bool, Any]]) -> None:
        verified = False
        try:
            ok, node_id = await answer
            verified = ok and node_id == node.id
        finally:
            self._slots.release(node, verified)
        if verified:
            self._admit(node)

    def _admit(self, node: Node) -> None:
        """``welcome_if_new`` for a node that proved its id; where that moves a held contact to a new
        address, the old address is asked again (``_keep_if_alive``)."""
        previous = self._held(node)
        self.welcome_if_new(node)
        if previous is not None and not previous.same_home_as(node):
            self._spawn(self._keep_if_alive(previous, node))

    async def _keep_if_alive(self, previous: Node, moved: Node) -> None:
        """A contact moved to ``moved``'s address. If its old address still answers with its id, it moves
        back and the new address counts as failed: a live node's id claimed elsewhere (a restarted node's
        old address no longer answers, so its move stands)."""
        address = (previous.ip, previous.port)
        ok, node_id = await self._request(address, self._wait_timeout, "ping", self.sender_id)
        if ok and node_id == previous.id and self.is_verified(moved):
            logger.warning(
                "DHT node %s: %s claimed the id of live contact %s",
                self.source_node.id.hex(),
                moved,
                previous,
            )
            self.router.add_contact(previous)
            self._slots.refuse(moved)

    async def identify(self, address: tuple[str, int]) -> Node | None:
        """Ping ``address`` (a bootstrap peer) and admit whoever answers with a node id: its answer to our
        own ping proves that id there. None when nothing answers in time, or not with a node id."""
        ok, node_id = await self._request(address, self._wait_timeout, "ping", self.sender_id)
        if not ok or not _is_node_id(node_id):
            return None
        if node_id == self.source_node.id:
            if not self._is_own_socket(address):
                self.twins.add(address)
            return None
        node = Node(node_id, address[0], address[1])
        self._admit(node)
        return node

    def _is_own_socket(self, address: tuple[str, int]) -> bool:
        """Whether `address` is this very socket (a --peers entry naming the node itself)."""
        host, port = self.transport.get_extra_info("sockname")[:2]
        local = {host, "127.0.0.1", "::1", "localhost"} if host in ("0.0.0.0", "::") else {host}
        return port == address[1] and address[0] in local

    def handle_call_response(self, result: tuple[bool, Any], node: Node) -> tuple[bool, Any]:
        """Routing bookkeeping after our request to ``node``: an answer refreshes a verified contact and
        only schedules the verification of anyone else (an answer proves an address, not the id we
        assumed); no answer removes ``node`` only where the table holds it at that very address, so a lie
        about a known id's address cannot evict it."""
        verified = self.is_verified(node)
        if result[0] and verified:
            self.router.add_contact(node)
        elif result[0]:
            self._verify_later(node)
        elif verified:
            logger.info(
                "DHT node %s: %s did not answer; dropped as a contact", self.source_node.id.hex(), node
            )
            self.router.remove_contact(node)
        return result

    def welcome_if_new(self, node: Node) -> None:
        """Admit a contact that proved its id (``_verify_later``) and hand it the signed entries it should
        hold (Kademlia paper §2.5).

        Unlike kademlia's version this uses the stored digests as they are (it hashed them again), and a
        known node that proved its id at a new address (restarted on another port) gets its contact moved,
        rather than being asked at its dead address until it times out.
        """
        if node.id == self.source_node.id:
            return
        if not self.router.is_new_node(node):
            self.router.add_contact(node)  # refreshes the address and the bucket order
            return
        entries = [
            (k, e)
            for k in self.storage.held_keys()
            if self._hands_off(node, k)
            for e in self.storage.entries(k)
        ]
        if entries:
            self._spawn(self._hand_off(node, entries))
        self.router.add_contact(node)

    def _hands_off(self, new_node: Node, dkey: bytes) -> bool:
        """True when ``new_node`` is among the k closest to ``dkey`` and we are the closest we know of."""
        keynode = Node(dkey)
        neighbors = self.router.find_neighbors(keynode)
        if not neighbors:
            return True
        new_is_close = len(neighbors) < self.router.ksize or (
            new_node.distance_to(keynode) < neighbors[-1].distance_to(keynode)
        )
        we_are_closest = self.source_node.distance_to(keynode) < neighbors[0].distance_to(keynode)
        return bool(new_is_close and we_are_closest)

    async def _hand_off(self, node: Node, entries: list[tuple[bytes, SignedEntry]]) -> None:
        logger.debug("DHT node %s hands %d entries to %s", self.source_node.id.hex(), len(entries), node)
        for start in range(0, len(entries), _HANDOFF_BATCH):
            batch = entries[start : start + _HANDOFF_BATCH]
            results = await asyncio.gather(*(self.call_store(node, k, encode_entry(e)) for k, e in batch))
            if not any(ok for ok, _ in results):
                return  # gone again

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        """rpcudp decodes every datagram in a fire-and-forget task, and garbage (or a request with the
        wrong arguments) raises there; here each one is handled in an owned task that counts it. With a
        datagram key, one without a valid tag is dropped and counted before anything is parsed."""
        if self._datagram_key is not None:
            body = self._untagged(data)
            if body is None:
                self.report_rejection(DHTReject.UNAUTHENTICATED, addr, "a datagram")
                return
            data = body
        self._spawn(self._solve_safely(data, addr))

    def _untagged(self, data: bytes) -> bytes | None:
        """``data`` without its tag, or None when the tag is missing or wrong (compared in constant time)."""
        assert self._datagram_key is not None
        body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        valid = len(data) > TAG_BYTES and hmac.compare_digest(tag, datagram_tag(self._datagram_key, body))
        return body if valid else None

    async def _solve_safely(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            await self._solve_datagram(data, addr)
        except Exception:  # noqa: BLE001 - a peer's garbage must never reach the event loop
            self.report_rejection(DHTReject.MALFORMED, addr)

    async def _accept_request(self, msg_id: bytes, data: Any, address: tuple[str, int]) -> None:
        """Answer a request, unless it is a stranger's over its source's rate: dropped unanswered and
        counted as ``throttled``."""
        if self.client_mode:
            return  # a client serves no one; a peer that still knew it as a contact times out
        if not self._admits(data, address):
            self.report_rejection(DHTReject.THROTTLED, address, "a request")
            return
        try:
            await super()._accept_request(msg_id, data, address)
        except Exception:  # noqa: BLE001 - wrong arity or types in a request: drop and count it
            self.report_rejection(DHTReject.MALFORMED, address)

    def _admits(self, data: Any, address: tuple[str, int]) -> bool:
        """Always a verified contact's request (by the node id it names and the address it came from);
        anyone else's only while its source IP has tokens."""
        args = data[1] if isinstance(data, list) and len(data) == 2 else None
        source = _contact(address, args[0] if isinstance(args, list) and args else None)
        return (source is not None and self.is_verified(source)) or self._strangers.take(str(address[0]))

    # --- our requests ---

    def _request(
        self, address: tuple[str, int], timeout_s: float, name: str, *args: Any
    ) -> asyncio.Future[tuple[bool, Any]]:
        """Send request ``name(*args)`` to ``address`` now; the future gives (True, answer), or (False, None)
        after ``timeout_s``. rpcudp's framing, with a timeout per request; MalformedMessage over 8 KB."""
        data = umsgpack.packb([name, args])
        if len(data) > _MAX_REQUEST_BYTES:
            raise MalformedMessage(f"request {name} is {len(data)} bytes, over {_MAX_REQUEST_BYTES}")
        msg_id = os.urandom(20)
        if self._on_request is not None:
            self._on_request(name)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        self._outstanding[msg_id] = (future, loop.call_later(timeout_s, self._timeout, msg_id))
        self.transport.sendto(b"\x00" + msg_id + data, address)
        return future

    def _crawl_timeout(self, node: Node) -> float:
        """The full request timeout for a verified contact, the short one for anyone else."""
        return self._wait_timeout if self.is_verified(node) else self._unverified_timeout

    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        address, timeout_s = (node_to_ask.ip, node_to_ask.port), self._crawl_timeout(node_to_ask)
        result = await self._request(address, timeout_s, "find_node", self.sender_id, node_to_find.id)
        return self.handle_call_response(result, node_to_ask)

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        address, timeout_s = (node_to_ask.ip, node_to_ask.port), self._crawl_timeout(node_to_ask)
        result = await self._request(address, timeout_s, "find_value", self.sender_id, node_to_find.id)
        return self.handle_call_response(result, node_to_ask)

    async def call_ping(self, node_to_ask: Node) -> tuple[bool, Any]:
        """Ping ``node_to_ask``; an answer with another id than the one asked counts as none."""
        address = (node_to_ask.ip, node_to_ask.port)
        result = await self._request(address, self._wait_timeout, "ping", self.sender_id)
        if result[0] and result[1] != node_to_ask.id:
            result = (False, None)
        return self.handle_call_response(result, node_to_ask)

    async def call_store(self, node_to_ask: Node, key: bytes, value: bytes) -> tuple[bool, Any]:
        address = (node_to_ask.ip, node_to_ask.port)
        result = await self._request(address, self._wait_timeout, "store", self.sender_id, key, value)
        return self.handle_call_response(result, node_to_ask)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def idle(self) -> None:
        """Wait until every task this protocol has started (verification pings and what they lead to,
        hand-offs) has ended, those they start included. A request's sender is scheduled for
        verification before the request is answered, so after an answer this covers its verification."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def aclose(self) -> None:
        """Cancel our tasks and answer every outstanding request with a failure."""
        await settle(*self._tasks)
        for future, timeout in list(self._outstanding.values()):
            timeout.cancel()
            if not future.done():
                future.set_result((False, None))
        self._outstanding.clear()

    # rpcudp resolves a request's future without checking that its caller is still waiting, and logs a
    # warning for every late or unknown answer and an error for every timeout: a flood's worth of lines.
    def _accept_response(self, msg_id: bytes, data: Any, address: tuple[str, int]) -> None:
        if msg_id not in self._outstanding:
            logger.debug(
                "DHT node %s: an answer from %s to no pending request", self.source_node.id.hex(), address
            )
        elif not self._drop_if_abandoned(msg_id):
            super()._accept_response(msg_id, data, address)

    def _timeout(self, msg_id: bytes) -> None:
        if not self._drop_if_abandoned(msg_id):
            future, _ = self._outstanding.pop(msg_id)
            future.set_result((False, None))

    def _drop_if_abandoned(self, msg_id: bytes) -> bool:
        pending = self._outstanding.get(msg_id)
        if pending is None or not pending[0].done():
            return False
        pending[1].cancel()
        del self._outstanding[msg_id]
        return True


# --- crawls and server --------------------------------------------------------------------------------------


class _NodeCrawl(NodeSpiderCrawl):
    """kademlia's node crawl, reading answers defensively; ``partial`` is what it found so far."""

    protocol: SwarmProtocol
    last_ids_crawled: list[bytes]

    async def _find(self, rpcmethod: Callable[[Node, Node], Coroutine[Any, Any, Any]]) -> list[Any]:
        """One round, as kademlia's (the alpha nearest uncontacted peers, all of them when the nearest did
        not change) plus every other uncontacted peer that is not a verified contact: those get the short
        timeout, so dead ones in a lying answer cost the round one short wait, not a wait per alpha."""
        count = len(self.nearest) if self.nearest.get_ids() == self.last_ids_crawled else self.alpha
        self.last_ids_crawled = self.nearest.get_ids()
        uncontacted = self.nearest.get_uncontacted()
        peers = uncontacted[:count] + [p for p in uncontacted[count:] if not self.protocol.is_verified(p)]
        calls = {}
        for peer in peers:
            calls[peer.id] = rpcmethod(peer, self.node)
            self.nearest.mark_contacted(peer)
        found: list[Any] = await self._nodes_found(await gather_dict(calls))
        return found

    async def _nodes_found(self, responses: dict[bytes, tuple[bool, Any]]) -> list[Any]:
        dead = [peer for peer, (ok, _) in responses.items() if not ok]
        for ok, answer in responses.values():
            if ok:
                self._read(answer)
        self.nearest.remove(dead)
        if self.nearest.have_contacted_all():
            return self.partial()
        found: list[Any] = await self.find()
        return found

    def _read(self, answer: object) -> None:
        self.nearest.push(_parse_contacts(answer))

    def partial(self) -> list[Any]:
        """The closest live nodes found so far."""
        return list(self.nearest)


class _EntryCrawl(_NodeCrawl):
    """Asks every one of the k closest nodes to a key for its entries and keeps all answers (unverified)."""

    def __init__(
        self, protocol: SwarmProtocol, node: Node, peers: list[Node], ksize: int, alpha: int
    ) -> None:
        super().__init__(protocol, node, peers, ksize, alpha)
        self.blobs: list[object] = []

    async def find(self) -> list[Any]:
        found: list[Any] = await self._find(self.protocol.call_find_value)
        return found

    def _read(self, answer: object) -> None:
        blobs, contacts = _parse_value_answer(answer)
        self.blobs.extend(blobs)
        self.nearest.push(contacts)

    def partial(self) -> list[Any]:
        """Every entry blob answered so far."""
        return self.blobs


def _disabled(name: str) -> NoReturn:
    raise NotImplementedError(f"kademlia's {name} is disabled in swarmnode: use SwarmDHT")


class SwarmServer(Server):
    """kademlia's server without its unsigned value paths, pickled state or republish of others' records."""

    def __init__(
        self, protocol_factory: Callable[[], SwarmProtocol], lookup_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._protocol_factory = protocol_factory
        self.lookup_timeout_s = lookup_timeout_s

    def _create_protocol(self) -> SwarmProtocol:
        return self._protocol_factory()

    async def listen(self, port: int, interface: str = "0.0.0.0") -> None:
        loop = asyncio.get_running_loop()
        self.transport, self.protocol = await loop.create_datagram_endpoint(
            self._create_protocol, local_addr=(interface, port)
        )

    async def _refresh_table(self) -> None:
        """Refresh lonely buckets (paper §2.3); unlike kademlia, republish nobody's records."""
        crawls = []
        for node_id in self.protocol.get_refresh_ids():
            target = Node(node_id)
            crawls.append(
                self._crawl(_NodeCrawl, target, self.protocol.router.find_neighbors(target, self.alpha))
            )
        await asyncio.gather(*crawls)

    async def bootstrap(self, addrs: list[tuple[str, int]]) -> list[Node]:
        gathered = await asyncio.gather(*(self.bootstrap_node(addr) for addr in addrs))
        return await self._crawl(_NodeCrawl, self.node, [node for node in gathered if node is not None])

    async def bootstrap_node(self, addr: tuple[str, int]) -> Node | None:
        node: Node | None = await self.protocol.identify(addr)
        return node

    async def closest_nodes(self, dkey: bytes) -> list[Node] | None:
        """The k closest live nodes to ``dkey``; None when no peer is known at all."""
        target = Node(dkey)
        nearest = self.protocol.router.find_neighbors(target)
        return await self._crawl(_NodeCrawl, target, nearest) if nearest else None

    async def lookup(self, dkey: bytes) -> list[object]:
        """Every entry blob the k closest nodes to ``dkey`` answer with, unverified."""
        target = Node(dkey)
        nearest = self.protocol.router.find_neighbors(target)
        return await self._crawl(_EntryCrawl, target, nearest) if nearest else []

    async def store_remote(self, dkey: bytes, entry: SignedEntry) -> bool:
        """Send ``entry`` to the k closest nodes; True if one holds it, or if no peer is known yet."""
        nodes = await self.closest_nodes(dkey)
        if nodes is None:
            return True
        blob = encode_entry(entry)
        results = await asyncio.gather(*(self.protocol.call_store(n, dkey, blob) for n in nodes))
        return any(ok and answer is True for ok, answer in results)

    async def _crawl(self, crawl_class: type[_NodeCrawl], target: Node, peers: list[Node]) -> list[Any]:
        """Crawl from ``peers`` towards ``target`` for at most ``lookup_timeout_s``; then, what it found."""
        crawl = crawl_class(self.protocol, target, peers, self.ksize, self.alpha)
        try:
            async with asyncio.timeout(self.lookup_timeout_s):
                found: list[Any] = await crawl.find()
                return found
        except TimeoutError:
            logger.warning("DHT node %s: crawl for %s timed out", self.node.id.hex(), target.id.hex())
            return crawl.partial()

    def peer_count(self) -> int:
        return sum(len(bucket) for bucket in self.protocol.router.buckets)

    async def get(self, key: Any) -> NoReturn:
        _disabled("get")

    async def set(self, key: Any, value: Any) -> NoReturn:
        _disabled("set")

    async def set_digest(self, dkey: Any, value: Any) -> NoReturn:
        _disabled("set_digest")

    def refresh_table(self, interval: float = 3600) -> NoReturn:
        _disabled("refresh_table")

    def save_state(self, fname: Any) -> NoReturn:
        _disabled("save_state")

    def save_state_regularly(self, fname: Any, frequency: float = 600) -> NoReturn:
        _disabled("save_state_regularly")

    @classmethod
    async def load_state(cls, fname: Any, port: int, interface: str = "0.0.0.0") -> NoReturn:
        _disabled("load_state")
