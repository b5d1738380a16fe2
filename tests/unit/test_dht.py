"""SwarmDHT in one process: several nodes on 127.0.0.1 UDP in one event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import umsgpack
from hypothesis import given, settings
from hypothesis import strategies as st
from kademlia.network import Server
from kademlia.node import Node
from kademlia.utils import digest

from swarmnode.net import dht, dht_records, kademlia_adapter
from swarmnode.net.dht import DHTConfig, SwarmDHT, parse_peer
from swarmnode.net.dht_records import (
    CLOCK_SKEW_S,
    MAX_RECORD_BYTES,
    MAX_TTL_S,
    EntryRejected,
    EntryStorage,
    MergeResult,
    SignedEntry,
    decode_and_verify_entry,
    dht_key,
    encode_entry,
    encode_value,
    merge_entries,
    sign_entry,
)
from swarmnode.net.identity import Identity
from swarmnode.net.kademlia_adapter import (
    MAX_ANSWER_ENTRY_BYTES,
    MAX_VERIFYING_PER_SOURCE,
    SwarmProtocol,
    datagram_tag,
)
from swarmnode.net.security import Security
from swarmnode.util.ratelimit import TokenBuckets

pytestmark = pytest.mark.timeout(60)

KEY = "swarmnode/run-1/snapshots"
DKEY = dht_key(KEY)
FAST = DHTConfig(request_timeout_s=0.5, republish_interval_s=3600)


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@dataclass
class Member:
    dht: SwarmDHT
    identity: Identity
    rejects: Counter[str]

    @property
    def protocol(self) -> SwarmProtocol:
        protocol: SwarmProtocol = self.dht._running().protocol
        return protocol

    @property
    def storage(self) -> EntryStorage:
        return self.dht._storage

    @property
    def contact(self) -> Node:
        return Node(self.identity.node_id, "127.0.0.1", self.dht.port)

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.dht.port

    def contacts(self) -> dict[bytes, tuple[str, int]]:
        """Every node id in the routing table, with the address it is held at."""
        buckets = self.protocol.router.buckets
        return {n.id: (n.ip, n.port) for bucket in buckets for n in bucket.get_nodes()}


async def start_member(
    bootstrap: list[str],
    config: DHTConfig = FAST,
    dht_class: type[SwarmDHT] = SwarmDHT,
    identity: Identity | None = None,
) -> Member:
    identity = identity or Identity.generate()
    rejects: Counter[str] = Counter()
    dht = dht_class(identity, config, on_reject=lambda reason: rejects.update([reason]))
    await dht.start(bootstrap)
    return Member(dht, identity, rejects)


@asynccontextmanager
async def swarm(
    n: int, config: DHTConfig = FAST, classes: dict[int, type[SwarmDHT]] | None = None
) -> AsyncIterator[list[Member]]:
    """``n`` nodes, each bootstrapped from the first; all stopped on exit."""
    members: list[Member] = []
    try:
        for i in range(n):
            bootstrap = [f"127.0.0.1:{members[0].dht.port}"] if members else []
            members.append(await start_member(bootstrap, config, (classes or {}).get(i, SwarmDHT)))
        yield members
    finally:
        for member in members:
            await member.dht.stop()


def holders(members: list[Member], dkey: bytes) -> list[Member]:
    return [m for m in members if m.storage.entries(dkey)]


def values(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {subkey: entry.value for subkey, entry in result.items()}


# --- records ---------------------------------------------------------------------------------------------


def test_entry_round_trips_through_wire_form() -> None:
    identity = Identity.generate()
    entry = sign_entry(identity, DKEY, encode_value({"b": 1, "a": [1, 2]}), 7, time.time() + 60)
    decoded = decode_and_verify_entry(DKEY, encode_entry(entry), time.time())
    assert decoded == entry
    assert decoded.node_id_hex == identity.node_id_hex
    assert entry.value_bytes == b'{"a":[1,2],"b":1}'


def test_encode_value_refuses_non_objects() -> None:
    for bad in ([1, 2], {"x": float("nan")}, {"x": object()}):
        with pytest.raises(ValueError):
            encode_value(bad)  # type: ignore[arg-type]


def forged_cases(attacker: Identity, victim: Identity) -> dict[str, tuple[str, bytes]]:
    """Name -> (expected reason, wire blob) of entries a storing node or reader must refuse."""
    now = time.time()
    value = encode_value({"addr": "10.0.0.1:50051"})

    def signed(value_bytes: bytes = value, expires_at: float = now + 60, dkey: bytes = DKEY) -> SignedEntry:
        return sign_entry(attacker, dkey, value_bytes, 5, expires_at)

    return {
        "claims_other_key": (
            "bad_signature",
            encode_entry(dataclasses.replace(signed(), public_key=victim.public_key)),
        ),
        "value_altered": (
            "bad_signature",
            encode_entry(dataclasses.replace(signed(), value_bytes=b'{"addr":"evil"}')),
        ),
        "signed_for_other_key": ("bad_signature", encode_entry(signed(dkey=dht_key("other")))),
        "oversized": ("oversized", encode_entry(signed(encode_value({"pad": "x" * MAX_RECORD_BYTES})))),
        "expired": ("expired", encode_entry(signed(expires_at=now - CLOCK_SKEW_S - 1))),
        "ttl_too_long": (
            "ttl_too_long",
            encode_entry(signed(expires_at=now + MAX_TTL_S + CLOCK_SKEW_S + 60)),
        ),
        "garbage": ("malformed", b"\x01not an entry"),
        "value_not_object": ("malformed", encode_entry(signed(b"[1,2]"))),
    }


CASES = sorted(forged_cases(Identity.generate(), Identity.generate()))


@pytest.mark.parametrize("case", CASES)
def test_decode_refuses_bad_entry(case: str) -> None:
    reason, blob = forged_cases(Identity.generate(), Identity.generate())[case]
    with pytest.raises(EntryRejected) as caught:
        decode_and_verify_entry(DKEY, blob, time.time())
    assert caught.value.reason == reason


def test_dht_reexports_the_record_names_callers_use() -> None:
    assert dht.DHTEntry is dht_records.DHTEntry


# --- storage ---------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def entry_of(identity: Identity, seq: int, expires_at: float = 2_000.0, value: str = "v") -> SignedEntry:
    return sign_entry(identity, DKEY, encode_value({"v": value}), seq, expires_at)


def test_storage_merges_per_publisher_higher_seq_wins() -> None:
    storage = EntryStorage(clock=FakeClock())
    alice, bob = Identity.generate(), Identity.generate()
    assert storage.merge(DKEY, entry_of(alice, 2, value="a2")) is MergeResult.STORED
    assert storage.merge(DKEY, entry_of(bob, 1, value="b1")) is MergeResult.STORED
    assert storage.merge(DKEY, entry_of(alice, 1, value="a1")) is MergeResult.STALE
    assert storage.merge(DKEY, entry_of(alice, 2, value="other")) is MergeResult.UNCHANGED
    assert storage.merge(DKEY, entry_of(alice, 3, value="a3")) is MergeResult.STORED
    held = {e.node_id_hex: e.value_bytes for e in storage.entries(DKEY)}
    assert held == {alice.node_id_hex: b'{"v":"a3"}', bob.node_id_hex: b'{"v":"b1"}'}
    assert len(storage) == 2


def test_storage_culls_each_entry_at_its_own_expiry() -> None:
    clock = FakeClock()
    storage = EntryStorage(clock=clock)
    alice, bob = Identity.generate(), Identity.generate()
    storage[DKEY] = entry_of(alice, 1, expires_at=1_010.0)
    storage[DKEY] = entry_of(bob, 1, expires_at=1_020.0)
    storage[DKEY] = entry_of(alice, 1, expires_at=1_010.0)  # storing again does not extend its life
    clock.now = 1_010.0
    assert [e.node_id_hex for e in storage.entries(DKEY)] == [bob.node_id_hex]
    clock.now = 1_020.0
    assert storage.get(DKEY) is None and len(storage) == 0 and storage.held_keys() == []


def test_storage_quotas_per_publisher_and_total() -> None:
    storage = EntryStorage(max_keys_per_publisher=2, max_total_keys=3, clock=FakeClock())
    alice, bob = Identity.generate(), Identity.generate()
    keys = [dht_key(f"k{i}") for i in range(4)]
    results = [storage.merge(k, sign_entry(alice, k, b"{}", 1, 2_000.0)) for k in keys[:3]]
    assert results == [MergeResult.STORED, MergeResult.STORED, MergeResult.QUOTA]
    assert storage.merge(keys[0], sign_entry(alice, keys[0], b"{}", 2, 2_000.0)) is MergeResult.STORED
    assert storage.merge(keys[2], sign_entry(bob, keys[2], b"{}", 1, 2_000.0)) is MergeResult.STORED
    assert storage.merge(keys[3], sign_entry(bob, keys[3], b"{}", 1, 2_000.0)) is MergeResult.QUOTA


class NullTransport:
    """A transport for a protocol driven by direct calls: what it sends goes nowhere."""

    def sendto(self, data: bytes, addr: Any = None) -> None:
        pass


def test_rpc_store_counts_quota_rejections() -> None:
    asyncio.run(_rpc_store_counts_quota_rejections())


async def _rpc_store_counts_quota_rejections() -> None:
    rejects: Counter[str] = Counter()
    storage = EntryStorage(max_keys_per_publisher=1)
    me = Identity.generate()
    protocol = SwarmProtocol(Node(me.node_id), storage, 20, on_reject=lambda r: rejects.update([r]))
    protocol.connection_made(NullTransport())
    alice = Identity.generate()
    sender, now = ("127.0.0.1", 9), time.time()
    blobs = [encode_entry(sign_entry(alice, dht_key(k), b"{}", 1, now + 60)) for k in ("a", "b")]
    assert protocol.rpc_store(sender, alice.node_id, dht_key("a"), blobs[0]) is True
    assert protocol.rpc_store(sender, alice.node_id, dht_key("b"), blobs[1]) is False
    assert protocol.rpc_store(sender, b"short", dht_key("a"), blobs[0]) is False
    assert rejects == Counter({"quota": 1})
    await protocol.aclose()


IDENTITIES = [Identity.generate() for _ in range(3)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=12), st.randoms())
def test_merge_keeps_highest_seq_per_publisher_in_any_order(picks: list[tuple[int, int]], rnd: Any) -> None:
    entries = [entry_of(IDENTITIES[who], seq) for who, seq in picks]
    shuffled = entries[:]
    rnd.shuffle(shuffled)
    expected: dict[str, int] = {}
    for entry in entries:
        expected[entry.node_id_hex] = max(expected.get(entry.node_id_hex, -1), entry.seq)
    storage = EntryStorage(clock=FakeClock())
    for entry in shuffled:
        storage.merge(DKEY, entry)
    assert {s: e.seq for s, e in merge_entries(shuffled).items()} == expected
    assert {e.node_id_hex: e.seq for e in storage.entries(DKEY)} == expected


def test_lookup_answer_holds_a_sample_of_the_entries_that_fit() -> None:
    asyncio.run(_lookup_answer_holds_a_sample_of_the_entries_that_fit())


async def _lookup_answer_holds_a_sample_of_the_entries_that_fit() -> None:
    """More entries than fit: each answer is a random sample that fits (so the k answers of a look-up
    cover the key), never more than a datagram holds."""
    storage = EntryStorage()
    me = Identity.generate()
    protocol = SwarmProtocol(Node(me.node_id), storage, 20)
    protocol.connection_made(NullTransport())
    now = time.time()
    for i in range(30):
        value = encode_value({"i": i, "pad": "x" * 800})
        storage.merge(DKEY, sign_entry(Identity.generate(), DKEY, value, 1, now + 100 + i))
    seen: set[float] = set()
    # ~7 of 30 entries fit an answer: 20 answers miss one entry 14% of the time, 80 answers once in 10^5
    for _ in range(80):
        answer = protocol.rpc_find_value(("127.0.0.1", 9), Identity.generate().node_id, DKEY)
        blobs = answer["value"]
        assert 0 < len(blobs) < 30
        assert sum(len(b) for b in blobs) <= MAX_ANSWER_ENTRY_BYTES
        assert len(umsgpack.packb(answer)) < 8192
        seen |= {decode_and_verify_entry(DKEY, b, now).expires_at for b in blobs}
    assert len(seen) == 30
    await protocol.aclose()


def test_parse_peer() -> None:
    assert parse_peer("node1:8468") == ("node1", 8468)
    assert parse_peer("[::1]:9") == ("::1", 9)
    for bad in ("node1", "node1:", ":80", "node1:99999", "node1:x"):
        with pytest.raises(ValueError):
            parse_peer(bad)


# --- swarms ----------------------------------------------------------------------------------------------


def test_publish_then_get_from_a_node_that_does_not_hold_it() -> None:
    async def scenario() -> None:
        async with swarm(7, dataclasses.replace(FAST, ksize=3)) as members:
            assert await members[1].dht.publish(KEY, {"addr": "a:1", "steps": 3}, ttl_s=60)
            reader = next(m for m in members if m not in holders(members, DKEY))
            result = await reader.dht.get(KEY)
            assert values(result) == {members[1].identity.node_id_hex: {"addr": "a:1", "steps": 3}}
            assert result[members[1].identity.node_id_hex].expires_at > time.time() + 50

    run(scenario())


def test_two_publishers_on_one_key_are_both_visible_to_a_third_node() -> None:
    async def scenario() -> None:
        async with swarm(7, dataclasses.replace(FAST, ksize=3)) as members:
            alice, bob = members[1], members[2]
            assert await alice.dht.publish(KEY, {"who": "alice"}, ttl_s=60)
            assert await bob.dht.publish(KEY, {"who": "bob"}, ttl_s=60)
            reader = next(m for m in members if m not in holders(members, DKEY))
            assert values(await reader.dht.get(KEY)) == {
                alice.identity.node_id_hex: {"who": "alice"},
                bob.identity.node_id_hex: {"who": "bob"},
            }

    run(scenario())


def test_republish_with_higher_seq_replaces_the_old_value_everywhere() -> None:
    async def scenario() -> None:
        async with swarm(6) as members:
            publisher, subkey = members[2], members[2].identity.node_id_hex
            await publisher.dht.publish(KEY, {"step": 1}, ttl_s=60)
            first_seq = (await members[0].dht.get(KEY))[subkey].seq
            await publisher.dht.publish(KEY, {"step": 2}, ttl_s=60)
            for member in members:
                held = {e.node_id_hex: e for e in member.storage.entries(DKEY)}
                assert held[subkey].seq > first_seq and held[subkey].value_bytes == b'{"step":2}'
                assert values(await member.dht.get(KEY)) == {subkey: {"step": 2}}

    run(scenario())


def test_restarted_publisher_replaces_its_own_old_entry() -> None:
    async def scenario() -> None:
        async with swarm(4) as members:
            identity = Identity.generate()
            first = await start_member([f"127.0.0.1:{members[0].dht.port}"], identity=identity)
            await first.dht.publish(KEY, {"life": 1}, ttl_s=60)
            await first.dht.stop()
            second = await start_member([f"127.0.0.1:{members[0].dht.port}"], identity=identity)
            try:
                await second.dht.publish(KEY, {"life": 2}, ttl_s=60)
                assert values(await members[1].dht.get(KEY)) == {identity.node_id_hex: {"life": 2}}
            finally:
                await second.dht.stop()

    run(scenario())


def test_a_node_restarted_on_a_new_port_is_known_at_its_new_address() -> None:
    async def scenario() -> None:
        async with swarm(2) as members:
            identity = Identity.generate()
            first = await start_member([f"127.0.0.1:{members[0].dht.port}"], identity=identity)
            old_port = first.dht.port
            await first.dht.stop()
            second = await start_member([f"127.0.0.1:{members[0].dht.port}"], identity=identity)
            try:
                assert second.dht.port != old_port
                router = members[0].protocol.router  # find_neighbors would leave the target out
                seen = [
                    n for bucket in router.buckets for n in bucket.get_nodes() if n.id == identity.node_id
                ]
                assert [n.port for n in seen] == [second.dht.port]
            finally:
                await second.dht.stop()

    run(scenario())


def test_entry_disappears_at_its_own_expiry() -> None:
    async def scenario() -> None:
        async with swarm(5) as members:
            await members[1].dht.publish(KEY, {"short": True}, ttl_s=0.5)
            members[1].dht.withdraw(KEY)  # else re-announced every ttl/3
            entry = (await members[3].dht.get(KEY))[members[1].identity.node_id_hex]

            async def gone() -> bool:
                return not await members[3].dht.get(KEY) and not holders(members, DKEY)

            await eventually(gone)
            assert time.time() >= entry.expires_at

    run(scenario())


@pytest.mark.parametrize("case", CASES)
def test_storing_node_refuses_bad_entry_and_counts_the_reason(case: str) -> None:
    async def scenario() -> None:
        async with swarm(2) as (victim, attacker):
            reason, blob = forged_cases(attacker.identity, victim.identity)[case]
            ok, stored = await attacker.protocol.call_store(victim.contact, DKEY, blob)
            assert ok and stored is False
            assert victim.rejects == Counter({reason: 1})
            assert victim.storage.entries(DKEY) == []

    run(scenario())


class LyingProtocol(SwarmProtocol):
    """Answers look-ups with crafted entries (and junk contacts) besides what it honestly holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lies: list[object] = []

    def rpc_find_value(self, sender: tuple[str, int], nodeid: object, key: object) -> dict[str, Any]:
        answer = super().rpc_find_value(sender, nodeid, key)
        junk_contacts = [[b"short", "127.0.0.1", 1], "junk", [nodeid, 5, "x"]]
        return {"value": [*self.lies, *answer["value"]], "nodes": [*answer["nodes"], *junk_contacts]}


class LyingDHT(SwarmDHT):
    protocol_class = LyingProtocol


def test_reader_drops_bad_entries_from_a_lying_node() -> None:
    async def scenario() -> None:
        async with swarm(5, classes={3: LyingDHT}) as members:
            publisher, liar, reader = members[1], members[3], members[4]
            await publisher.dht.publish(KEY, {"addr": "honest"}, ttl_s=60)
            cases = forged_cases(liar.identity, publisher.identity)
            takeover = sign_entry(liar.identity, DKEY, b'{"addr":"evil"}', 2**62, time.time() + 60)
            takeover = dataclasses.replace(takeover, public_key=publisher.identity.public_key)
            assert isinstance(liar.protocol, LyingProtocol)
            liar.protocol.lies = [blob for _, blob in cases.values()] + [encode_entry(takeover), 42]
            result = await reader.dht.get(KEY)
            assert values(result) == {publisher.identity.node_id_hex: {"addr": "honest"}}
            expected = Counter(reason for reason, _ in cases.values())
            expected.update(["bad_signature", "malformed"])  # the takeover and the 42
            assert reader.rejects == expected

    run(scenario())


def test_new_node_receives_signed_entries_by_hand_off() -> None:
    async def scenario() -> None:
        async with swarm(4) as members:
            other_key = "swarmnode/run-1/round/7"
            await members[1].dht.publish(KEY, {"a": 1}, ttl_s=60)
            await members[2].dht.publish(other_key, {"b": 2}, ttl_s=60)
            newcomer = await start_member([f"127.0.0.1:{members[0].dht.port}"])
            members.append(newcomer)  # stopped by swarm()

            async def handed_off() -> bool:
                return bool(newcomer.storage.entries(DKEY) and newcomer.storage.entries(dht_key(other_key)))

            await eventually(handed_off)
            (entry,) = newcomer.storage.entries(DKEY)
            assert entry.node_id_hex == members[1].identity.node_id_hex
            assert decode_and_verify_entry(DKEY, encode_entry(entry), time.time()) == entry
            assert not newcomer.rejects

    run(scenario())


class RecordingTransport:
    """Keeps every datagram a protocol sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self.sent.append((data, addr))

    def requests(self) -> list[tuple[str, list[Any], Any]]:
        return [(*umsgpack.unpackb(data[21:]), addr) for data, addr in self.sent if data[:1] == b"\x00"]


def near(node_id: bytes, flip: int) -> bytes:
    """An id close to ``node_id``: its last byte XOR ``flip``."""
    return node_id[:-1] + bytes([node_id[-1] ^ flip])


def test_hand_off_goes_by_the_stored_key_not_its_hash() -> None:
    """kademlia's welcome_if_new hashed stored digests again; here the digest itself decides."""

    async def scenario() -> None:
        mine, theirs = dht_key("mine"), dht_key("theirs")
        storage = EntryStorage()
        publisher = Identity.generate()
        for dkey in (mine, theirs):
            storage.merge(dkey, sign_entry(publisher, dkey, b"{}", 1, time.time() + 60))
        protocol = SwarmProtocol(Node(near(mine, 1)), storage, 20)
        transport = RecordingTransport()
        protocol.connection_made(transport)
        for i, contact_id in enumerate((near(theirs, 1), near(digest(mine), 1), near(digest(mine), 2))):
            protocol.router.add_contact(Node(contact_id, "127.0.0.1", 2000 + i))
        protocol.welcome_if_new(Node(near(mine, 2), "127.0.0.1", 3000))
        await asyncio.sleep(0.01)
        assert [(name, args[1], addr) for name, args, addr in transport.requests()] == [
            ("store", mine, ("127.0.0.1", 3000))
        ]
        await protocol.aclose()

    run(scenario())


def test_bootstrap_resolves_host_names_and_skips_unresolvable_ones() -> None:
    async def scenario() -> None:
        async with swarm(1) as (first,):
            peers = [f"localhost:{first.dht.port}", "no-such-host.invalid:8468"]
            second = await start_member(peers)
            try:
                assert second.dht.peer_count() == 1 and first.dht.peer_count() == 1
                await first.dht.publish(KEY, {"x": 1}, ttl_s=60)
                assert values(await second.dht.get(KEY)) == {first.identity.node_id_hex: {"x": 1}}
            finally:
                await second.dht.stop()

    run(scenario())


class SpyProtocol(SwarmProtocol):
    """Records the publisher of every entry this node sends in a store request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    async def call_store(self, node_to_ask: Node, key: bytes, value: bytes) -> Any:
        self.sent.append(decode_and_verify_entry(key, value, time.time()).node_id_hex)
        return await super().call_store(node_to_ask, key, value)


class SpyDHT(SwarmDHT):
    protocol_class = SpyProtocol


def test_node_never_republishes_another_nodes_entry() -> None:
    async def scenario() -> None:
        config = dataclasses.replace(FAST, republish_interval_s=0.1)
        async with swarm(4, config, classes=dict.fromkeys(range(4), SpyDHT)) as members:
            publisher, others = members[0], members[1:]
            await publisher.dht.publish(KEY, {"alive": True}, ttl_s=1.0)

            async def reannounced_three_times() -> bool:
                assert isinstance(publisher.protocol, SpyProtocol)
                return len(publisher.protocol.sent) >= 4 * len(others)

            await eventually(reannounced_three_times)
            await publisher.dht.stop()
            await eventually(lambda: _nobody_has(others))
            assert all(isinstance(m.protocol, SpyProtocol) and not m.protocol.sent for m in others)

    run(scenario())


async def _nobody_has(members: list[Member]) -> bool:
    for member in members:
        if await member.dht.get(KEY):
            return False
    return True


def test_publish_refuses_bad_input() -> None:
    async def scenario() -> None:
        async with swarm(1) as (node,):
            with pytest.raises(ValueError):
                await node.dht.publish(KEY, {"pad": "x" * MAX_RECORD_BYTES}, ttl_s=60)
            with pytest.raises(ValueError):
                await node.dht.publish(KEY, {"x": 1}, ttl_s=MAX_TTL_S + 1)
            assert await node.dht.publish(KEY, {"x": 1}, ttl_s=60)  # no peers yet: stored locally

    run(scenario())


def test_stop_leaves_no_task_behind() -> None:
    async def scenario() -> None:
        before = asyncio.all_tasks()
        async with swarm(3) as members:
            await members[0].dht.publish(KEY, {"x": 1}, ttl_s=60)
            assert asyncio.all_tasks() > before
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == before

    run(scenario())


def test_entry_that_just_expired_is_dropped_without_a_count() -> None:
    identity, now = Identity.generate(), time.time()
    blob = encode_entry(sign_entry(identity, DKEY, b"{}", 1, now - 1))
    with pytest.raises(EntryRejected) as caught:
        decode_and_verify_entry(DKEY, blob, now)
    assert caught.value.reason == "expired" and not caught.value.counted


def test_cancelled_lookup_leaves_no_error_behind() -> None:
    async def scenario() -> None:
        errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        async with swarm(3) as (reader, silent, _):
            await silent.dht.stop()  # still in the reader's routing table: its requests go unanswered
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.dht.get(KEY), 0.05)

            async def requests_settled() -> bool:
                return not reader.protocol._outstanding

            await eventually(requests_settled)
        assert errors == []

    run(scenario())


# --- forged contacts, floods and token swarms -----------------------------------------------------------


class Forger(asyncio.DatagramProtocol):
    """A raw rpcudp peer on 127.0.0.1 that sends requests in any node id's name and records what comes
    back. It answers nothing unless ``answer_as`` is set: then pings with that id, other requests with an
    empty node list. With ``key`` it tags what it sends and strips the tags of what it receives, as a
    token swarm's node does."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key
        self.answer_as: bytes | None = None
        self.transport: Any = None
        self.requests: list[tuple[str, list[Any], tuple[str, int], bytes]] = []  # name, args, sender, msg id
        self.answers: Counter[tuple[str, int]] = Counter()  # answers received, per sender
        self.answered: list[bytes] = []  # msg ids of the requests answered

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.key is not None:
            data, tag = data[: -kademlia_adapter.TAG_BYTES], data[-kademlia_adapter.TAG_BYTES :]
            assert tag == datagram_tag(self.key, data), "a datagram with a bad tag"
        kind, msg_id, body = data[:1], data[1:21], umsgpack.unpackb(data[21:])
        if kind == b"\x01":
            self.answers[addr] += 1
            self.answered.append(msg_id)
        elif kind == b"\x00":
            self.requests.append((body[0], body[1], addr, msg_id))
            if self.answer_as is not None:
                self.answer(self.requests[-1], self.answer_as if body[0] == "ping" else [])

    def answer(self, request: tuple[str, list[Any], tuple[str, int], bytes], value: object) -> None:
        _, _, addr, msg_id = request
        self.send_raw(b"\x01" + msg_id + umsgpack.packb(value), addr)

    def send_raw(self, datagram: bytes, addr: tuple[str, int]) -> None:
        tag = b"" if self.key is None else datagram_tag(self.key, datagram)
        self.transport.sendto(datagram + tag, addr)

    def ping(self, addr: tuple[str, int], node_id: bytes) -> bytes:
        """Send a ping in ``node_id``'s name; its msg id."""
        msg_id = os.urandom(20)
        self.send_raw(b"\x00" + msg_id + umsgpack.packb(["ping", [node_id]]), addr)
        return msg_id

    def pinged_by(self, addr: tuple[str, int]) -> int:
        """Pings (verification pings) received from ``addr``."""
        return sum(1 for name, _, sender, _ in self.requests if name == "ping" and sender == addr)

    @property
    def port(self) -> int:
        port: int = self.transport.get_extra_info("sockname")[1]
        return port


@asynccontextmanager
async def forger(key: bytes | None = None) -> AsyncIterator[Forger]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: Forger(key), local_addr=("127.0.0.1", 0)
    )
    try:
        yield protocol
    finally:
        transport.close()


async def flood(source: Forger, targets: list[Member], count: int, batch: int = 50) -> None:
    """``count`` pings from random node ids to each target. Each batch has arrived (answered or counted as
    throttled) before the next is sent, so no socket buffer drops any of them."""
    for start in range(0, count, batch):
        for target in targets:
            for _ in range(min(batch, count - start)):
                source.ping(target.address, os.urandom(20))
        sent = min(start + batch, count)

        async def arrived(sent: int = sent) -> bool:
            return all(source.answers[t.address] + t.rejects["throttled"] >= sent for t in targets)

        await eventually(arrived)


async def verifications_settled(member: Member) -> bool:
    """No request of ``member``'s is pending and no task of its protocol is left (a verification's task
    lives until what its answer started is under way)."""
    return not member.protocol._outstanding and not member.protocol._tasks


def test_forged_pings_from_random_ids_never_enter_the_routing_table() -> None:
    async def scenario() -> None:
        async with swarm(2) as (victim, honest), forger() as source:
            await flood(source, [victim], 200)
            await eventually(lambda: verifications_settled(victim))
            assert victim.contacts() == {honest.identity.node_id: honest.address}
            assert 1 <= source.pinged_by(victim.address) <= 2 * MAX_VERIFYING_PER_SOURCE
            assert source.answers[victim.address] < 200 and victim.rejects["throttled"] > 0

    run(scenario())


def test_a_forger_that_answers_for_its_id_gets_in_only_after_verification() -> None:
    async def scenario() -> None:
        async with swarm(1) as (victim,), forger() as source:
            forged_id = Identity.generate().node_id
            source.ping(victim.address, forged_id)

            async def verification_sent() -> bool:
                return source.answers[victim.address] == 1 and source.pinged_by(victim.address) == 1

            await eventually(verification_sent)
            assert forged_id not in victim.contacts()  # answered, but not a contact on its word
            (verification,) = source.requests
            source.answer(verification, forged_id)

            async def admitted() -> bool:
                return victim.contacts().get(forged_id) == ("127.0.0.1", source.port)

            await eventually(admitted)

    run(scenario())


def test_a_known_id_writing_from_a_new_address_moves_only_once_it_answers_there() -> None:
    async def scenario() -> None:
        async with swarm(2) as (victim, honest), forger() as source:
            source.ping(victim.address, honest.identity.node_id)  # claims the honest node's id elsewhere

            async def verification_sent() -> bool:
                return source.pinged_by(victim.address) == 1

            await eventually(verification_sent)
            await eventually(lambda: verifications_settled(victim))  # the forger never answered it
            assert victim.contacts() == {honest.identity.node_id: honest.address}

    run(scenario())


def test_a_live_nodes_id_claimed_at_another_address_stays_with_the_live_node() -> None:
    async def scenario() -> None:
        async with swarm(2) as (victim, honest), forger() as source:
            source.answer_as = honest.identity.node_id  # answers the verification ping with that id too
            source.ping(victim.address, honest.identity.node_id)

            async def verified_there() -> bool:
                return source.pinged_by(victim.address) == 1

            await eventually(verified_there)
            await eventually(lambda: verifications_settled(victim))  # and the old address asked again
            assert victim.contacts() == {honest.identity.node_id: honest.address}

    run(scenario())


def test_contacts_from_an_answer_enter_only_with_the_id_they_prove() -> None:
    """A liar's find_node answer names ids at an address that answers every request, but its pings
    only with its own id: none of the named ids becomes a contact."""

    async def scenario() -> None:
        async with swarm(2, classes={1: ForgingDHT}) as (reader, liar), forger() as source:
            source.answer_as = Identity.generate().node_id
            named = [near(DKEY, i) for i in range(1, 21)]
            assert isinstance(liar.protocol, ForgingProtocol)
            liar.protocol.forged = [(node_id, "127.0.0.1", source.port) for node_id in named]
            await reader.dht.get(KEY)  # asks the named contacts: they answer, but under another id
            await eventually(lambda: verifications_settled(reader))
            assert source.pinged_by(reader.address) >= 1  # verified: the answers named another id
            assert reader.contacts() == {liar.identity.node_id: liar.address}

    run(scenario())


class ForgingProtocol(SwarmProtocol):
    """Puts ``forged`` contacts at the head of every node list it answers with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forged: list[tuple[bytes, str, int]] = []

    def rpc_find_node(self, sender: tuple[str, int], nodeid: object, key: object) -> list[tuple[Any, ...]]:
        return [*self.forged, *super().rpc_find_node(sender, nodeid, key)]


class ForgingDHT(SwarmDHT):
    protocol_class = ForgingProtocol


def test_a_lying_answer_full_of_dead_contacts_costs_a_look_up_less_than_a_request_timeout() -> None:
    async def scenario() -> None:
        config = DHTConfig(request_timeout_s=1.0, republish_interval_s=3600)
        async with swarm(3, config, classes={1: ForgingDHT}) as (seed, liar, reader), forger() as dead:
            await seed.dht.publish(KEY, {"addr": "honest"}, ttl_s=60)

            async def knows_both() -> bool:
                return set(reader.contacts()) == {seed.identity.node_id, liar.identity.node_id}

            await eventually(knows_both)
            assert isinstance(liar.protocol, ForgingProtocol)  # 20 ids nearer the key than anyone, all dead
            liar.protocol.forged = [(near(DKEY, i), "127.0.0.1", dead.port) for i in range(1, 21)]
            started = time.monotonic()
            result = await reader.dht.get(KEY)
            elapsed = time.monotonic() - started
            assert elapsed < config.request_timeout_s, f"{elapsed:.2f} s"
            assert values(result) == {seed.identity.node_id_hex: {"addr": "honest"}}
            assert len(dead.requests) >= 20  # the look-up did ask the dead contacts

    run(scenario())


def test_a_flood_of_forged_pings_does_not_slow_honest_publish_and_get() -> None:
    async def timed(writer: Member, reader: Member, rounds: int) -> float:
        """Median seconds of a publish and a get between the two."""
        times = []
        for i in range(rounds):
            started = time.monotonic()
            assert await writer.dht.publish(KEY, {"i": i}, ttl_s=60)
            assert values(await reader.dht.get(KEY)) == {writer.identity.node_id_hex: {"i": i}}
            times.append(time.monotonic() - started)
        return statistics.median(times)

    async def scenario() -> None:
        async with swarm(2) as (writer, reader), forger() as source:
            await timed(writer, reader, 2)  # warm-up
            before = await timed(writer, reader, 9)
            await flood(source, [writer, reader], 2000)
            after = await timed(writer, reader, 9)
            for member, other in ((writer, reader), (reader, writer)):
                assert member.contacts() == {other.identity.node_id: other.address}
                # every forged ping was answered or throttled, and no honest request was throttled
                assert member.rejects["throttled"] == 2000 - source.answers[member.address] > 0
            assert after <= 5 * before, (
                f"median publish+get {before * 1e3:.1f} ms before, {after * 1e3:.1f} after"
            )

    run(scenario(), timeout_s=50)


def test_stranger_tokens_refill_at_their_rate_per_source() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(rate_per_s=10.0, burst=3, max_sources=2, clock=clock)
    assert [buckets.take("a") for _ in range(4)] == [True, True, True, False]
    assert buckets.take("b")  # another source has its own bucket
    clock.now += 0.1
    assert buckets.take("a") and not buckets.take("a")


TOKEN_KEY = Security(token="swarm-secret").dht_datagram_key()


def test_a_token_swarm_answers_only_tagged_datagrams() -> None:
    async def scenario() -> None:
        assert TOKEN_KEY is not None and Security(token="other").dht_datagram_key() != TOKEN_KEY
        config = dataclasses.replace(FAST, datagram_key=TOKEN_KEY)
        async with swarm(2, config) as (node, peer), forger() as source:
            await peer.dht.publish(KEY, {"with": "token"}, ttl_s=60)  # two token nodes work together
            assert values(await node.dht.get(KEY)) == {peer.identity.node_id_hex: {"with": "token"}}
            request = b"\x00" + os.urandom(20) + umsgpack.packb(["ping", [Identity.generate().node_id]])
            source.send_raw(request, node.address)  # a stock rpcudp ping
            source.send_raw(request + datagram_tag(b"k" * 32, request), node.address)
            source.send_raw(request + datagram_tag(TOKEN_KEY, request)[:-1] + b"?", node.address)
            source.key = TOKEN_KEY
            good = source.ping(node.address, Identity.generate().node_id)

            async def answered() -> bool:
                return bool(source.answered)

            await eventually(answered)  # datagrams arrive in order: the earlier ones got no answer
            assert source.answered == [good]
            assert node.rejects == Counter({"unauthenticated": 3})

    run(scenario())


def test_a_node_without_the_token_cannot_join_a_token_swarm() -> None:
    async def scenario() -> None:
        config = dataclasses.replace(FAST, datagram_key=TOKEN_KEY)
        async with swarm(1, config) as (node,):
            outsider = await start_member([f"127.0.0.1:{node.dht.port}"])
            try:
                assert outsider.dht.peer_count() == 0 and node.dht.peer_count() == 0
                assert node.rejects["unauthenticated"] >= 1
            finally:
                await outsider.dht.stop()

    run(scenario())


def test_a_stock_kademlia_node_bootstraps_from_a_node_without_a_token() -> None:
    async def scenario() -> None:
        async with swarm(1) as (node,):
            stock = Server()
            await stock.listen(0, interface="127.0.0.1")
            try:
                found = await stock.bootstrap([node.address])
                assert [n.id for n in found] == [node.identity.node_id]
                port = stock.transport.get_extra_info("sockname")[1]

                async def verified() -> bool:
                    return node.contacts() == {stock.node.id: ("127.0.0.1", port)}

                await eventually(verified)
                assert await stock.get("swarmnode/run-1/nothing-held") is None  # not a TypeError
            finally:
                stock.stop()

    run(scenario())


# --- finding the swarm again ----------------------------------------------------------------------------


def test_a_restarted_node_knocks_on_the_contacts_it_kept(tmp_path) -> None:
    """A node started without bootstrap peers (a swarm's first node) that restarts: its routing table is
    empty and nobody bootstraps from it any more, but it kept its contacts in its file."""

    async def scenario() -> None:
        contacts_file = tmp_path / "contacts.json"
        kept = dataclasses.replace(FAST, contacts_file=contacts_file)
        identity = Identity.generate()
        seed = await start_member([], kept, identity=identity)
        peer = await start_member([f"127.0.0.1:{seed.dht.port}"])
        try:
            await eventually(lambda: _saved(contacts_file, f"127.0.0.1:{peer.dht.port}"), 10)
            port = seed.dht.port
            await seed.dht.stop()
            again = await start_member([], dataclasses.replace(kept, port=port), identity=identity)
            try:
                assert peer.identity.node_id in again.contacts(), "the restart did not knock on its contacts"
            finally:
                await again.dht.stop()
        finally:
            await peer.dht.stop()

    run(scenario())


async def _saved(path, contact: str) -> bool:
    return path.exists() and contact in dht.load_contacts(path)


def test_a_bootstrap_peer_that_restarted_knowing_nobody_is_knocked_on_again(monkeypatch) -> None:
    """The swarm's first node died (its peers dropped it as a contact) and came back at its address with
    an empty table and no contacts file: the nodes that bootstrapped from it find it again."""
    monkeypatch.setattr(dht, "REJOIN_INTERVAL_S", 0.1)
    monkeypatch.setattr(dht, "REKNOCK_INTERVAL_S", 0.3)

    async def scenario() -> None:
        identity = Identity.generate()
        seed = await start_member([], identity=identity)
        port = seed.dht.port
        others = [await start_member([f"127.0.0.1:{port}"]) for _ in range(2)]
        try:
            await eventually(lambda: _knows(others[0], others[1]), 10)
            await seed.dht.stop()
            for other in others:  # as after its requests to the dead node timed out
                other.protocol.router.remove_contact(Node(identity.node_id, "127.0.0.1", port))
            again = await start_member([], dataclasses.replace(FAST, port=port), identity=identity)
            try:
                assert again.dht.peer_count() == 0
                await eventually(lambda: _knows(again, others[0]), 10)
            finally:
                await again.dht.stop()
        finally:
            for other in others:
                await other.dht.stop()

    run(scenario(), timeout_s=40)


async def _knows(member: Member, other: Member) -> bool:
    return other.identity.node_id in member.contacts()


def test_an_entry_passed_on_by_a_peer_verifies_only_as_its_publisher_signed_it_under_its_key() -> None:
    """`SwarmDHT.verify` is how a member checks the offers a proposal carries: the publisher's entry
    verifies as read; altered, moved to another key, or expired, it does not."""
    publisher, reader = Identity.generate(), SwarmDHT(Identity.generate(), DHTConfig())
    value_bytes = dht_records.encode_value({"o": 4, "w": 10.0})
    signed = dht_records.sign_entry(publisher, dht_records.dht_key("k"), value_bytes, 7, time.time() + 60)
    blob = dht_records.encode_entry(signed)
    entry = reader.verify("k", blob)
    assert entry is not None and entry.node_id == publisher.node_id.hex() and entry.value["w"] == 10.0
    assert entry.signed == blob and dht_records.to_dht_entry(signed).signed == blob
    assert reader.verify("k", blob.replace(b"10.0", b"99.0")) is None
    assert reader.verify("other", blob) is None
    old = dht_records.sign_entry(publisher, dht_records.dht_key("k"), value_bytes, 7, time.time() - 600)
    assert reader.verify("k", dht_records.encode_entry(old)) is None
