"""The swarm's Kademlia DHT: signed, per-publisher dictionary records (DESIGN.md §3 "DHT records").

What it promises:

- A key (a str such as ``swarmnode/<run>/snapshots``, hashed to 160 bits with kademlia's ``digest``) holds a
  dictionary: one entry per publisher, under the publisher's node id (hex). An entry is a JSON object plus
  ``seq`` and ``expires_at``, signed with the publisher's Ed25519 key. The node id is always derived from the
  public key the entry carries, never taken from the wire, so nobody can announce for another node.
- Every entry is validated before it is stored (``rpc_store``) and again in every look-up answer a reader
  receives; failures are dropped and counted through ``on_reject(reason)``, reason one of ``REJECT_REASONS``.
- Entries merge per publisher on store and on look-up: the higher ``seq`` wins, an equal ``seq`` keeps the
  entry already held. Each entry is culled at its own ``expires_at``.
- ``get`` asks the k closest nodes and merges all their answers with the local copy.
- A node re-announces only its own records (at least every ``ttl/3``, re-signed with a higher ``seq``);
  other nodes' entries live on only while their publishers keep announcing them.

kademlia 2.2.3 flaws this module fixes, by subclassing its ``Server``, ``KademliaProtocol``, ``IStorage``
and crawlers (never by patching the package):

- one unversioned value per key that any UDP sender overwrites: ``EntryStorage`` merges signed entries;
- ``get`` returns the local copy or the first answer: ``SwarmDHT.get`` collects and merges all answers;
- records age by insertion time and every holder republishes everything hourly, so stale values return:
  expiry is the entry's own signed ``expires_at`` and ``_SwarmServer._refresh_table`` republishes nothing;
- ``welcome_if_new`` hashes already-hashed keys, so hand-off to a new node targets the wrong keys:
  ``SwarmProtocol.welcome_if_new`` uses the stored digests and sends the signed entries;
- ``bootstrap`` takes IP addresses only: ``SwarmDHT.start`` resolves ``host:port`` names first;
- a request over 8 KB fails (after the local store) and a reply over ~65 KB is dropped silently: a store
  carries one entry of at most ``MAX_RECORD_BYTES`` and a look-up answer at most ``MAX_ANSWER_ENTRY_BYTES``
  of entries, the freshest (latest ``expires_at``) first. So a key with more publishers than fit shows a
  reader only the freshest ones: keys must stay small (one entry per node of a run, pointers only);
- ``load_state``/``save_state`` unpickle/pickle: disabled, as are the unsigned ``set``/``get`` paths;
- a malformed node list or node id in a request or answer raises inside the crawl: validated here;
- rpcudp sets results on futures a caller had cancelled: ignored here, so look-ups can be cancelled;
- ``asyncio.get_event_loop`` and fire-and-forget tasks: this module owns its tasks and cancels them on stop.

Limits: an entry is at most ``MAX_RECORD_BYTES`` (1,200) encoded, lives at most ``MAX_TTL_S``; a storing node
holds at most ``MAX_KEYS_PER_PUBLISHER`` keys per publisher, ``MAX_TOTAL_KEYS`` keys, ``MAX_TOTAL_ENTRIES``
entries; a look-up answer carries at most ``MAX_ANSWER_ENTRY_BYTES`` of entries (about 5 full-size entries or
~20 of 300 bytes). An entry that expired less than ``CLOCK_SKEW_S`` ago is dropped without a count.

Not addressed: routing-table node ids are not authenticated (Sybil/eclipse attacks), and kademlia's
``RoutingTable.add_contact`` still pings a full bucket's head with a fire-and-forget future.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, NoReturn, TypeGuard

from kademlia.crawling import NodeSpiderCrawl, SpiderCrawl
from kademlia.network import Server
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.storage import IStorage
from kademlia.utils import digest

from swarmnode.identity import NODE_ID_BYTES, Identity, node_id_from_public_key, verify_signature

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1200
"""Largest encoded entry (header + JSON value) that is signed, stored or accepted."""
MAX_TTL_S = 3600.0
"""Longest lifetime a publisher may give an entry."""
CLOCK_SKEW_S = 120.0
"""Tolerance for publishers' clocks running ahead when checking ``expires_at`` against ``MAX_TTL_S``."""
MAX_KEYS_PER_PUBLISHER = 64
"""Keys one publisher may hold entries under, on one storing node."""
MAX_TOTAL_KEYS = 2048
"""Keys one storing node holds at most."""
MAX_TOTAL_ENTRIES = 8192
"""Entries (all keys, all publishers) one storing node holds at most: ~10 MB worst case."""
MAX_ANSWER_ENTRY_BYTES = 6000
"""Entry bytes in one look-up answer; with k=20 node contacts the reply stays under ~8 KB."""
MAX_ANSWER_ITEMS = 64
"""Entries or contacts read from one answer; more are ignored (a legitimate answer has fewer)."""
MAINTENANCE_INTERVAL_S = 60.0
"""How often expired entries are culled and lonely routing buckets refreshed."""
_LOOKUP_TIMEOUT_FACTOR = 5
"""A crawl gives up after this many request timeouts and uses what it has."""
_HANDOFF_BATCH = 8

RejectReason = Literal["bad_signature", "oversized", "expired", "ttl_too_long", "malformed", "quota"]
REJECT_REASONS: tuple[RejectReason, ...] = (
    "bad_signature",
    "oversized",
    "expired",
    "ttl_too_long",
    "malformed",
    "quota",
)

# Wire form of an entry: version, public key, signature, seq, expires_at, then the canonical JSON value.
_WIRE_VERSION = 1
_HEADER = struct.Struct(">B32s64sQd")
_SIGN_DOMAIN = b"swarmnode/dht-entry/v1\x00"
_SEQ_AND_EXPIRY = struct.Struct(">Qd")
_MAX_SEQ = 2**64 - 1


class EntryRejected(ValueError):
    """An entry failed validation; ``reason`` is one of ``REJECT_REASONS``.

    ``counted`` is False for an entry that expired less than ``CLOCK_SKEW_S`` ago: honest nodes send those
    when an entry expires in flight or their clocks differ a little, so they are dropped without a count.
    """

    def __init__(self, reason: RejectReason, counted: bool = True) -> None:
        super().__init__(reason)
        self.reason: RejectReason = reason
        self.counted = counted


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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"DHT port {self.port} is not in 0..65535")
        if self.ksize < 1 or self.alpha < 1:
            raise ValueError(f"DHT ksize ({self.ksize}) and alpha ({self.alpha}) must be at least 1")
        if self.request_timeout_s <= 0:
            raise ValueError(f"DHT request timeout {self.request_timeout_s} s must be positive")
        if self.republish_interval_s is not None and self.republish_interval_s <= 0:
            raise ValueError(f"DHT republish interval {self.republish_interval_s} s must be positive")


@dataclass(frozen=True)
class DHTEntry:
    """One publisher's validated entry under a key."""

    node_id: str
    value: dict[str, Any]
    seq: int
    expires_at: float


@dataclass(frozen=True)
class SignedEntry:
    """An entry as signed and sent: publisher's raw public key, canonical JSON value, signature."""

    public_key: bytes
    value_bytes: bytes
    seq: int
    expires_at: float
    signature: bytes

    @property
    def node_id_hex(self) -> str:
        return node_id_from_public_key(self.public_key).hex()


# --- records: encoding, signing, validation -------------------------------------------------------------


def dht_key(key: str) -> bytes:
    """The 160-bit DHT key of a key string (kademlia's SHA-1 digest)."""
    dkey: bytes = digest(key)
    return dkey


def encode_value(value: dict[str, Any]) -> bytes:
    """Canonical JSON (sorted keys, compact, UTF-8) of a JSON object; ValueError if it is not one."""
    if not isinstance(value, dict):
        raise ValueError(f"a DHT value must be a JSON object, not {type(value).__name__}")
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"DHT value is not JSON-serialisable: {exc}") from exc
    return text.encode()


def decode_value(value_bytes: bytes) -> dict[str, Any]:
    """The JSON object in ``value_bytes``; EntryRejected("malformed") otherwise."""
    try:
        value = json.loads(value_bytes, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise EntryRejected("malformed") from exc
    if not isinstance(value, dict):
        raise EntryRejected("malformed")
    return value


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def signing_message(dkey: bytes, node_id: bytes, value_bytes: bytes, seq: int, expires_at: float) -> bytes:
    """What a publisher signs: domain prefix, DHT key, subkey (node id), seq, expires_at, value."""
    assert len(dkey) == NODE_ID_BYTES and len(node_id) == NODE_ID_BYTES
    return _SIGN_DOMAIN + dkey + node_id + _SEQ_AND_EXPIRY.pack(seq, expires_at) + value_bytes


def sign_entry(
    identity: Identity, dkey: bytes, value_bytes: bytes, seq: int, expires_at: float
) -> SignedEntry:
    """Sign ``value_bytes`` under ``dkey`` as ``identity``; checks nothing else (tests craft bad ones)."""
    message = signing_message(dkey, identity.node_id, value_bytes, seq, expires_at)
    return SignedEntry(identity.public_key, value_bytes, seq, expires_at, identity.sign(message))


def encode_entry(entry: SignedEntry) -> bytes:
    """The wire form: a fixed binary header followed by the value bytes."""
    header = _HEADER.pack(_WIRE_VERSION, entry.public_key, entry.signature, entry.seq, entry.expires_at)
    return header + entry.value_bytes


def decode_and_verify_entry(dkey: bytes, blob: object, now: float) -> SignedEntry:
    """Decode an entry received for ``dkey`` and validate it completely; EntryRejected otherwise.

    The size is checked before anything is decoded, the cheap checks before the signature.
    """
    if not isinstance(blob, bytes):
        raise EntryRejected("malformed")
    if len(blob) > MAX_RECORD_BYTES:
        raise EntryRejected("oversized")
    if len(blob) < _HEADER.size or blob[0] != _WIRE_VERSION:
        raise EntryRejected("malformed")
    _, public_key, signature, seq, expires_at = _HEADER.unpack_from(blob)
    entry = SignedEntry(public_key, blob[_HEADER.size :], seq, expires_at, signature)
    _check_expiry(expires_at, now)
    message = signing_message(dkey, node_id_from_public_key(public_key), entry.value_bytes, seq, expires_at)
    if not verify_signature(public_key, signature, message):
        raise EntryRejected("bad_signature")
    decode_value(entry.value_bytes)
    return entry


def _check_expiry(expires_at: float, now: float) -> None:
    if not math.isfinite(expires_at):
        raise EntryRejected("malformed")
    if expires_at <= now:
        raise EntryRejected("expired", counted=expires_at <= now - CLOCK_SKEW_S)
    if expires_at > now + MAX_TTL_S + CLOCK_SKEW_S:
        raise EntryRejected("ttl_too_long")


def to_dht_entry(entry: SignedEntry) -> DHTEntry:
    return DHTEntry(entry.node_id_hex, decode_value(entry.value_bytes), entry.seq, entry.expires_at)


def merge_entries(entries: Iterable[SignedEntry]) -> dict[str, SignedEntry]:
    """Per publisher, the entry with the highest seq; on equal seq the one seen first."""
    merged: dict[str, SignedEntry] = {}
    for entry in entries:
        held = merged.get(entry.node_id_hex)
        if held is None or entry.seq > held.seq:
            merged[entry.node_id_hex] = entry
    return merged


def verify_answers(
    dkey: bytes, blobs: Iterable[object], now: float, on_reject: Callable[[RejectReason], None]
) -> list[SignedEntry]:
    """The valid entries among look-up answers (each distinct blob checked once); the rest reported."""
    valid: list[SignedEntry] = []
    seen: set[bytes] = set()
    for blob in blobs:
        if isinstance(blob, bytes):
            if blob in seen:
                continue
            seen.add(blob)
        try:
            valid.append(decode_and_verify_entry(dkey, blob, now))
        except EntryRejected as exc:
            if exc.counted:
                on_reject(exc.reason)
    return valid


# --- storage -----------------------------------------------------------------------------------------------


class MergeResult(Enum):
    STORED = "stored"
    UNCHANGED = "unchanged"  # the same publisher's entry with an equal seq is already held
    STALE = "stale"  # a higher seq is already held
    QUOTA = "quota"


class EntryStorage(IStorage):
    """Verified entries per DHT key: ``{dkey: {publisher node id hex: SignedEntry}}``.

    ``storage[dkey] = entry`` merges one entry (see ``merge``); ``storage[dkey]`` is the key's dictionary.
    Entries are culled at their own ``expires_at`` (wall clock); quotas bound what senders can make us hold.
    """

    def __init__(
        self,
        max_keys_per_publisher: int = MAX_KEYS_PER_PUBLISHER,
        max_total_keys: int = MAX_TOTAL_KEYS,
        max_total_entries: int = MAX_TOTAL_ENTRIES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._data: dict[bytes, dict[str, SignedEntry]] = {}
        self._touched: dict[bytes, float] = {}  # monotonic time of each key's last change
        self._keys_per_publisher: Counter[str] = Counter()
        self._total_entries = 0
        self._limits = (max_keys_per_publisher, max_total_keys, max_total_entries)
        self._clock = clock

    def merge(self, dkey: bytes, entry: SignedEntry) -> MergeResult:
        """Keep ``entry`` unless its publisher's held entry has an equal or higher seq or a quota is full."""
        self._cull_key(dkey, self._clock())
        subkey = entry.node_id_hex
        held = self._data.get(dkey, {}).get(subkey)
        if held is not None and entry.seq == held.seq:
            return MergeResult.UNCHANGED
        if held is not None and entry.seq < held.seq:
            return MergeResult.STALE
        if held is None and not self._has_room(dkey, subkey):
            self.cull()
            if not self._has_room(dkey, subkey):
                return MergeResult.QUOTA
        if held is None:
            self._keys_per_publisher[subkey] += 1
            self._total_entries += 1
        self._data.setdefault(dkey, {})[subkey] = entry
        self._touched[dkey] = time.monotonic()
        return MergeResult.STORED

    def entries(self, dkey: bytes) -> list[SignedEntry]:
        """The unexpired entries under ``dkey``."""
        self._cull_key(dkey, self._clock())
        return list(self._data.get(dkey, {}).values())

    def held_keys(self) -> list[bytes]:
        self.cull()
        return list(self._data)

    def cull(self) -> None:
        """Drop every expired entry."""
        now = self._clock()
        for dkey in list(self._data):
            self._cull_key(dkey, now)

    def _has_room(self, dkey: bytes, subkey: str) -> bool:
        per_publisher, total_keys, total_entries = self._limits
        return (
            self._keys_per_publisher[subkey] < per_publisher
            and (dkey in self._data or len(self._data) < total_keys)
            and self._total_entries < total_entries
        )

    def _cull_key(self, dkey: bytes, now: float) -> None:
        slot = self._data.get(dkey)
        if slot is None:
            return
        for subkey in [s for s, e in slot.items() if e.expires_at <= now]:
            del slot[subkey]
            self._total_entries -= 1
            self._keys_per_publisher[subkey] -= 1
            if not self._keys_per_publisher[subkey]:
                del self._keys_per_publisher[subkey]
        if not slot:
            del self._data[dkey]
            del self._touched[dkey]

    # IStorage
    def __setitem__(self, key: bytes, value: SignedEntry) -> None:
        self.merge(key, value)

    def __getitem__(self, key: bytes) -> dict[str, SignedEntry]:
        self._cull_key(key, self._clock())
        return dict(self._data[key])

    def get(self, key: bytes, default: Any = None) -> Any:
        self._cull_key(key, self._clock())
        return dict(self._data[key]) if key in self._data else default

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, SignedEntry]]:
        """Entries under keys unchanged for ``seconds_old`` seconds (nothing here republishes them)."""
        self.cull()
        cutoff = time.monotonic() - seconds_old
        return [(k, e) for k, slot in self._data.items() if self._touched[k] <= cutoff for e in slot.values()]

    def __iter__(self) -> Iterator[tuple[bytes, SignedEntry]]:
        self.cull()
        return iter([(k, e) for k, slot in self._data.items() for e in slot.values()])

    def __len__(self) -> int:
        return self._total_entries


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


def _freshest_that_fit(entries: list[SignedEntry], budget: int) -> list[bytes]:
    """Encoded entries, latest expiry first, as many as fit in ``budget`` bytes."""
    blobs = []
    for entry in sorted(entries, key=lambda e: e.expires_at, reverse=True):
        blob = encode_entry(entry)
        budget -= len(blob) + 3  # msgpack's bin16 header
        if budget < 0:
            break
        blobs.append(blob)
    return blobs


# --- protocol -----------------------------------------------------------------------------------------------


class SwarmProtocol(KademliaProtocol):
    """Kademlia's protocol with validated requests, signed dictionary values and a working hand-off."""

    def __init__(
        self,
        source_node: Node,
        storage: EntryStorage,
        ksize: int,
        wait_timeout_s: float = 5.0,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(source_node, storage, ksize)
        self._wait_timeout = wait_timeout_s  # rpcudp's per-request timeout
        self._on_reject = on_reject
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()

    def report_rejection(self, reason: RejectReason, sender: object = None) -> None:
        """Count a refused entry; log the first of each reason at warning level, the rest at debug."""
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        node = self.source_node.id.hex()
        logger.log(level, "DHT node %s refused an entry from %s: %s", node, sender, reason)
        if self._on_reject is not None:
            self._on_reject(reason)

    def rpc_ping(self, sender: tuple[str, int], nodeid: object) -> bytes:
        source = _contact(sender, nodeid)
        if source is not None:
            self.welcome_if_new(source)
        node_id: bytes = self.source_node.id
        return node_id

    def rpc_store(self, sender: tuple[str, int], nodeid: object, key: object, value: object) -> bool:
        """Store one signed entry after validating it; True when it is held (now or already)."""
        source = _contact(sender, nodeid)
        if source is None or not _is_node_id(key):
            return False
        self.welcome_if_new(source)
        try:
            entry = decode_and_verify_entry(key, value, time.time())
        except EntryRejected as exc:
            if exc.counted:
                self.report_rejection(exc.reason, sender)
            return False
        result = self.storage.merge(key, entry)
        if result is MergeResult.QUOTA:
            self.report_rejection("quota", sender)
        return result in (MergeResult.STORED, MergeResult.UNCHANGED)

    def rpc_find_node(self, sender: tuple[str, int], nodeid: object, key: object) -> list[tuple[Any, ...]]:
        source = _contact(sender, nodeid)
        if source is None or not _is_node_id(key):
            return []
        self.welcome_if_new(source)
        neighbors = self.router.find_neighbors(Node(key), exclude=source)
        return [tuple(n) for n in neighbors]

    def rpc_find_value(self, sender: tuple[str, int], nodeid: object, key: object) -> dict[str, Any]:
        """Our freshest entries under ``key`` that fit in one answer, and our closest contacts to it."""
        if not _is_node_id(key):
            return {"value": [], "nodes": []}
        nodes = self.rpc_find_node(sender, nodeid, key)
        return {
            "value": _freshest_that_fit(self.storage.entries(key), MAX_ANSWER_ENTRY_BYTES),
            "nodes": nodes,
        }

    def welcome_if_new(self, node: Node) -> None:
        """Add a new contact and hand it the signed entries it should hold (Kademlia paper §2.5).

        Unlike kademlia's version this uses the stored digests as they are (it hashed them again).
        """
        if node.id == self.source_node.id or not self.router.is_new_node(node):
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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Cancel our tasks and answer every outstanding request with a failure."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for future, timeout in list(self._outstanding.values()):
            timeout.cancel()
            if not future.done():
                future.set_result((False, None))
        self._outstanding.clear()

    # rpcudp resolves a request's future without checking that its caller is still waiting.
    def _accept_response(self, msg_id: bytes, data: Any, address: tuple[str, int]) -> None:
        if not self._drop_if_abandoned(msg_id):
            super()._accept_response(msg_id, data, address)

    def _timeout(self, msg_id: bytes) -> None:
        if not self._drop_if_abandoned(msg_id):
            super()._timeout(msg_id)

    def _drop_if_abandoned(self, msg_id: bytes) -> bool:
        pending = self._outstanding.get(msg_id)
        if pending is None or not pending[0].done():
            return False
        pending[1].cancel()
        del self._outstanding[msg_id]
        return True


# --- crawls and server --------------------------------------------------------------------------------------


class _NodeCrawl(NodeSpiderCrawl):
    """kademlia's node crawl, reading contacts defensively."""

    async def _nodes_found(self, responses: dict[bytes, tuple[bool, Any]]) -> list[Node]:
        dead = [peer for peer, (ok, _) in responses.items() if not ok]
        for ok, answer in responses.values():
            if ok:
                self.nearest.push(_parse_contacts(answer))
        self.nearest.remove(dead)
        if self.nearest.have_contacted_all():
            return list(self.nearest)
        found: list[Node] = await self.find()
        return found

    def partial(self) -> list[Node]:
        return list(self.nearest)


class _EntryCrawl(SpiderCrawl):
    """Asks every one of the k closest nodes to a key for its entries and keeps all answers (unverified)."""

    def __init__(
        self, protocol: SwarmProtocol, node: Node, peers: list[Node], ksize: int, alpha: int
    ) -> None:
        super().__init__(protocol, node, peers, ksize, alpha)
        self.blobs: list[object] = []

    async def find(self) -> list[object]:
        found: list[object] = await self._find(self.protocol.call_find_value)
        return found

    async def _nodes_found(self, responses: dict[bytes, tuple[bool, Any]]) -> list[object]:
        dead = [peer for peer, (ok, _) in responses.items() if not ok]
        for ok, answer in responses.values():
            if ok:
                blobs, contacts = _parse_value_answer(answer)
                self.blobs.extend(blobs)
                self.nearest.push(contacts)
        self.nearest.remove(dead)
        if self.nearest.have_contacted_all():
            return self.blobs
        return await self.find()

    def partial(self) -> list[object]:
        return self.blobs


def _disabled(name: str) -> NoReturn:
    raise NotImplementedError(f"kademlia's {name} is disabled in swarmnode: use SwarmDHT")


class _SwarmServer(Server):
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
            nearest = self.protocol.router.find_neighbors(target, self.alpha)
            crawls.append(self._crawl(_NodeCrawl(self.protocol, target, nearest, self.ksize, self.alpha)))
        await asyncio.gather(*crawls)

    async def bootstrap(self, addrs: list[tuple[str, int]]) -> list[Node]:
        gathered = await asyncio.gather(*(self.bootstrap_node(addr) for addr in addrs))
        nodes = [node for node in gathered if node is not None]
        return await self._crawl(_NodeCrawl(self.protocol, self.node, nodes, self.ksize, self.alpha))

    async def bootstrap_node(self, addr: tuple[str, int]) -> Node | None:
        ok, node_id = await self.protocol.ping(addr, self.node.id)
        return Node(node_id, addr[0], addr[1]) if ok and _is_node_id(node_id) else None

    async def closest_nodes(self, dkey: bytes) -> list[Node] | None:
        """The k closest live nodes to ``dkey``; None when no peer is known at all."""
        target = Node(dkey)
        nearest = self.protocol.router.find_neighbors(target)
        if not nearest:
            return None
        nodes: list[Node] = await self._crawl(
            _NodeCrawl(self.protocol, target, nearest, self.ksize, self.alpha)
        )
        return nodes

    async def lookup(self, dkey: bytes) -> list[object]:
        """Every entry blob the k closest nodes to ``dkey`` answer with, unverified."""
        target = Node(dkey)
        nearest = self.protocol.router.find_neighbors(target)
        if not nearest:
            return []
        blobs: list[object] = await self._crawl(
            _EntryCrawl(self.protocol, target, nearest, self.ksize, self.alpha)
        )
        return blobs

    async def store_remote(self, dkey: bytes, entry: SignedEntry) -> bool:
        """Send ``entry`` to the k closest nodes; True if one holds it, or if no peer is known yet."""
        nodes = await self.closest_nodes(dkey)
        if nodes is None:
            return True
        blob = encode_entry(entry)
        results = await asyncio.gather(*(self.protocol.call_store(n, dkey, blob) for n in nodes))
        return any(ok and answer is True for ok, answer in results)

    async def _crawl(self, crawl: _NodeCrawl | _EntryCrawl) -> Any:
        """Run a crawl for at most ``lookup_timeout_s``; on time-out, what it found so far."""
        try:
            async with asyncio.timeout(self.lookup_timeout_s):
                return await crawl.find()
        except TimeoutError:
            logger.warning("DHT node %s: crawl for %s timed out", self.node.id.hex(), crawl.node.id.hex())
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


# --- bootstrap addresses ------------------------------------------------------------------------------------


def parse_peer(peer: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError when it is not one."""
    host, sep, port_text = peer.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"DHT peer {peer!r} is not HOST:PORT")
    return host, int(port_text)


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
        self, identity: Identity, config: DHTConfig, on_reject: Callable[[str], None] | None = None
    ) -> None:
        self._identity = identity
        self._config = config
        self._on_reject = on_reject
        self._storage = EntryStorage()
        self._server: _SwarmServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._own: dict[bytes, _OwnRecord] = {}
        self._last_seq = 0
        self._wake = asyncio.Event()

    async def start(self, bootstrap: Sequence[str]) -> None:
        """Listen on the configured UDP port and join the swarm through ``bootstrap`` (``host:port``).

        Unresolvable or silent peers are skipped with a warning; with none left this node starts a swarm.
        ValueError when a peer is not ``host:port``.
        """
        for peer in bootstrap:
            parse_peer(peer)
        server = self._make_server()
        await server.listen(self._config.port, self._config.host)
        self._server = server
        self._tasks = [
            asyncio.create_task(self._maintenance_loop(), name="dht-maintenance"),
            asyncio.create_task(self._reannounce_loop(), name="dht-reannounce"),
        ]
        family = server.transport.get_extra_info("socket").family
        addrs = await resolve_peers(bootstrap, family, self._config.request_timeout_s)
        if addrs:
            await server.bootstrap(addrs)
        if bootstrap and not self.peer_count():
            logger.warning("DHT node %s reached none of its peers %s", self._identity.node_id_hex, bootstrap)
        logger.info("DHT node %s on %s:%d", self._identity.node_id_hex, self._config.host, self.port)

    def _make_server(self) -> _SwarmServer:
        node_id = self._identity.node_id
        server = _SwarmServer(
            lambda: self.protocol_class(
                server.node,
                self._storage,
                self._config.ksize,
                self._config.request_timeout_s,
                self._on_reject,
            ),
            lookup_timeout_s=_LOOKUP_TIMEOUT_FACTOR * self._config.request_timeout_s,
            ksize=self._config.ksize,
            alpha=self._config.alpha,
            node_id=node_id,
            storage=self._storage,
        )
        return server

    async def stop(self) -> None:
        """Cancel every background task and close the socket; safe to call twice."""
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
    def port(self) -> int:
        """The bound UDP port (the chosen one when configured as 0)."""
        port: int = self._running().transport.get_extra_info("sockname")[1]
        return port

    def peer_count(self) -> int:
        """Nodes in the routing table."""
        return 0 if self._server is None else self._server.peer_count()

    async def publish(self, key: str, value: dict[str, Any], ttl_s: float) -> bool:
        """Sign ``value`` under ``key`` for ``ttl_s`` seconds, store it here and on the k closest nodes.

        The record is re-announced (re-signed, higher seq, new expiry) until ``withdraw`` or ``stop``.
        True if a remote node holds it or no peer is known yet. ValueError for a bad value or TTL.
        """
        server = self._running()
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"DHT record TTL {ttl_s} s is not in (0, {MAX_TTL_S:g}]")
        value_bytes = encode_value(value)
        if _HEADER.size + len(value_bytes) > MAX_RECORD_BYTES:
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
        now = time.time()
        remote = verify_answers(dkey, blobs, now, self._report_rejection)
        merged = merge_entries([*self._storage.entries(dkey), *remote])
        return {sub: to_dht_entry(e) for sub, e in merged.items() if e.expires_at > now}

    def _report_rejection(self, reason: RejectReason) -> None:
        if self._server is not None:
            self._server.protocol.report_rejection(reason, "a look-up answer")

    def _running(self) -> _SwarmServer:
        if self._server is None:
            raise RuntimeError("SwarmDHT is not started")
        return self._server

    def _next_seq(self) -> int:
        """A seq above every one this process used; time-based so it also rises across restarts."""
        self._last_seq = min(max(time.time_ns(), self._last_seq + 1), _MAX_SEQ)
        return self._last_seq

    async def _announce(self, server: _SwarmServer, dkey: bytes) -> bool:
        record = self._own[dkey]
        interval = min(self._config.republish_interval_s or math.inf, record.ttl_s / 3)
        record.next_due = time.monotonic() + interval
        entry = sign_entry(
            self._identity, dkey, record.value_bytes, self._next_seq(), time.time() + record.ttl_s
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
