"""Signed DHT records and the store that holds them (docs/design.md "The swarm"); no network here.

What it promises:

- A key (a str such as ``swarmnode/<run>/snapshots``, hashed to 160 bits with kademlia's ``digest``) holds a
  dictionary: one entry per publisher, under the publisher's node id (hex). An entry is a JSON object plus
  ``seq`` and ``expires_at``, signed with the publisher's Ed25519 key. The node id is always derived from the
  public key the entry carries, never taken from the wire, so nobody can announce for another node.
- ``decode_and_verify_entry`` validates a received entry completely, or raises ``EntryRejected`` with a
  ``DHTReject``.
- Entries merge per publisher: the higher ``seq`` wins, an equal ``seq`` keeps the entry already held.
  ``EntryStorage`` culls each entry at its own signed ``expires_at`` (kademlia's ages values by insertion
  time).

Limits: an entry is at most ``MAX_RECORD_BYTES`` (1,200) encoded, lives at most ``MAX_TTL_S``; a storing node
holds at most ``MAX_KEYS_PER_PUBLISHER`` keys per publisher, ``MAX_TOTAL_KEYS`` keys, ``MAX_TOTAL_ENTRIES``
entries. An entry that expired less than ``CLOCK_SKEW_S`` ago is rejected but not counted.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, NoReturn, TypeVar

import msgspec
from kademlia.storage import IStorage
from kademlia.utils import digest

from swarmnode.net.identity import NODE_ID_BYTES, Identity, node_id_from_public_key, verify_signature
from swarmnode.util import clock as wall_clock
from swarmnode.util.labels import DHTReject

T = TypeVar("T")

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

# Wire form of an entry: version, public key, signature, seq, expires_at, then the canonical JSON value.
_WIRE_VERSION = 1
_HEADER = struct.Struct(">B32s64sQd")
_SIGN_DOMAIN = b"swarmnode/dht-entry/v1\x00"
_SEQ_AND_EXPIRY = struct.Struct(">Qd")
MAX_VALUE_BYTES = MAX_RECORD_BYTES - _HEADER.size
"""Largest canonical JSON value that fits in one entry."""
MAX_SEQ = 2**64 - 1
"""Largest ``seq`` the wire form carries."""


class EntryRejected(ValueError):
    """An entry failed validation; ``reason`` is a ``DHTReject``.

    ``counted`` is False for an entry that expired less than ``CLOCK_SKEW_S`` ago: honest nodes send those
    when an entry expires in flight or their clocks differ a little, so they are dropped without a count.
    """

    def __init__(self, reason: DHTReject, counted: bool = True) -> None:
        super().__init__(reason)
        self.reason: DHTReject = reason
        self.counted = counted


@dataclass(frozen=True)
class DHTEntry:
    """One publisher's validated entry under a key."""

    node_id: str
    value: dict[str, Any]
    seq: int
    expires_at: float
    signed: bytes = b""
    """The entry in its signed wire form (`encode_entry`): a peer can check it without a look-up
    (`SwarmDHT.verify`); empty for entries not read from the DHT."""


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


# --- encoding, signing, validation -------------------------------------------------------------------------


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
    """The JSON object in ``value_bytes``; EntryRejected(DHTReject.MALFORMED) otherwise."""
    try:
        value = json.loads(value_bytes, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise EntryRejected(DHTReject.MALFORMED) from exc
    if not isinstance(value, dict):
        raise EntryRejected(DHTReject.MALFORMED)
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
        raise EntryRejected(DHTReject.MALFORMED)
    if len(blob) > MAX_RECORD_BYTES:
        raise EntryRejected(DHTReject.OVERSIZED)
    if len(blob) < _HEADER.size or blob[0] != _WIRE_VERSION:
        raise EntryRejected(DHTReject.MALFORMED)
    _, public_key, signature, seq, expires_at = _HEADER.unpack_from(blob)
    entry = SignedEntry(public_key, blob[_HEADER.size :], seq, expires_at, signature)
    _check_expiry(expires_at, now)
    message = signing_message(dkey, node_id_from_public_key(public_key), entry.value_bytes, seq, expires_at)
    if not verify_signature(public_key, signature, message):
        raise EntryRejected(DHTReject.BAD_SIGNATURE)
    decode_value(entry.value_bytes)
    return entry


def _check_expiry(expires_at: float, now: float) -> None:
    if not math.isfinite(expires_at):
        raise EntryRejected(DHTReject.MALFORMED)
    if expires_at <= now:
        raise EntryRejected(DHTReject.EXPIRED, counted=expires_at <= now - CLOCK_SKEW_S)
    if expires_at > now + MAX_TTL_S + CLOCK_SKEW_S:
        raise EntryRejected(DHTReject.TTL_TOO_LONG)


def to_dht_entry(entry: SignedEntry) -> DHTEntry:
    value = decode_value(entry.value_bytes)
    return DHTEntry(entry.node_id_hex, value, entry.seq, entry.expires_at, encode_entry(entry))


def merge_entries(entries: Iterable[SignedEntry]) -> dict[str, SignedEntry]:
    """Per publisher, the entry with the highest seq; on equal seq the one seen first."""
    merged: dict[str, SignedEntry] = {}
    for entry in entries:
        held = merged.get(entry.node_id_hex)
        if held is None or entry.seq > held.seq:
            merged[entry.node_id_hex] = entry
    return merged


def verify_answers(
    dkey: bytes, blobs: Iterable[object], now: float, on_reject: Callable[[DHTReject], None]
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
        clock: Callable[[], float] = wall_clock.now,
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


def decode_typed_value(kind: type[T], node_id: str, value: Any) -> T | None:
    """A typed value (a msgspec Struct whose `node` field is its publisher) from a publisher's entry
    value, or None if it does not validate: types first, then the Struct's own field checks. A peer's
    value is never trusted, and this is the one place the swarm's DHT values are decoded."""
    if not isinstance(value, dict) or "node" in value:
        return None
    try:
        return msgspec.convert({**value, "node": node_id}, kind)
    except msgspec.ValidationError:
        return None
