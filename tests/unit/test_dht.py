"""SwarmDHT in one process: several nodes on 127.0.0.1 UDP in one event loop (DESIGN.md §3 "DHT records")."""

from __future__ import annotations

import asyncio
import dataclasses
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
from kademlia.node import Node
from kademlia.utils import digest

from swarmnode import dht, dht_records
from swarmnode.dht import MAX_ANSWER_ENTRY_BYTES, DHTConfig, SwarmDHT, SwarmProtocol, parse_peer
from swarmnode.dht_records import (
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
from swarmnode.identity import Identity
from swarmnode.metrics import DHT_REJECT_REASONS

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
    assert dht.REJECT_REASONS is dht_records.REJECT_REASONS
    assert set(dht.REJECT_REASONS) == set(DHT_REJECT_REASONS)  # every reason has a pre-registered label


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


def test_lookup_answer_holds_the_freshest_entries_that_fit() -> None:
    asyncio.run(_lookup_answer_holds_the_freshest_entries_that_fit())


async def _lookup_answer_holds_the_freshest_entries_that_fit() -> None:
    storage = EntryStorage()
    me = Identity.generate()
    protocol = SwarmProtocol(Node(me.node_id), storage, 20)
    protocol.connection_made(NullTransport())
    now = time.time()
    for i in range(30):
        value = encode_value({"i": i, "pad": "x" * 800})
        storage.merge(DKEY, sign_entry(Identity.generate(), DKEY, value, 1, now + 100 + i))
    answer = protocol.rpc_find_value(("127.0.0.1", 9), Identity.generate().node_id, DKEY)
    blobs = answer["value"]
    assert 0 < len(blobs) < 30
    assert sum(len(b) for b in blobs) <= MAX_ANSWER_ENTRY_BYTES
    expiries = [decode_and_verify_entry(DKEY, b, now).expires_at for b in blobs]
    assert expiries == sorted(expiries, reverse=True) and expiries[0] == now + 129
    assert len(umsgpack.packb(answer)) < 8192
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
