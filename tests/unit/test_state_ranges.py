"""Range lists (hash list, root, bounds), the many-peer range fetcher with fake peers, and how a
recovering node agrees on a root from its peers' manifests."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch

from swarmnode.net.identity import Identity
from swarmnode.net.state_ranges import RangeManifest
from swarmnode.snapshot.ranges import (
    MAX_RANGE_BYTES,
    MIN_RANGE_BYTES,
    RAW,
    RangeError,
    RangeList,
    decode_range,
    encode_range,
    node_layout,
    shared_layout,
)
from swarmnode.swarm.announcements import Announcement
from swarmnode.swarm.recovery.many_peers import ManyPeerFetch, ManyPeersUnavailable
from swarmnode.swarm.recovery.range_fetch import RangeFetcher, RangeFetchFailed, RangeJob
from swarmnode.swarm.recovery import many_peers, range_source
from swarmnode.util.errors import PeerFault
from swarmnode.util.labels import FetchFailure

RANGE = MIN_RANGE_BYTES


def test_root_is_recomputed_from_the_hash_list_and_binds_every_range() -> None:
    data = os.urandom(RANGE * 3 + 100)
    ranges = RangeList.of(data, RANGE)
    assert len(ranges) == 4 and ranges.span(3) == (RANGE * 3, RANGE * 3 + 100)
    again = RangeList.from_wire(len(data), RANGE, ranges.packed)
    assert again.root == ranges.root
    lied = bytearray(ranges.packed)
    lied[40] ^= 1
    assert RangeList.from_wire(len(data), RANGE, bytes(lied)).root != ranges.root
    assert RangeList.of(data[:-1], RANGE).root != ranges.root  # sizes are in the root too


def test_a_corrupt_or_short_range_is_rejected() -> None:
    data = os.urandom(RANGE * 2)
    ranges = RangeList.of(data, RANGE)
    ranges.check(1, data[RANGE:])
    with pytest.raises(RangeError, match="hash"):
        ranges.check(1, b"\x00" + data[RANGE + 1 :])
    with pytest.raises(RangeError, match="bytes"):
        ranges.check(0, data[: RANGE - 1])
    with pytest.raises(RangeError):
        ranges.span(2)


@pytest.mark.parametrize(
    ("total", "range_bytes", "count"),
    [
        (10, MIN_RANGE_BYTES - 1, 1),  # range size out of bounds
        (10, MAX_RANGE_BYTES + 1, 1),
        (RANGE * 2, RANGE, 3),  # a hash list that does not fit the size
        (RANGE * 2, RANGE, 1),
        (RANGE << 20, RANGE, 0),  # more ranges than a reader accepts
    ],
)
def test_bounds_are_checked_before_anything_is_allocated(total: int, range_bytes: int, count: int) -> None:
    with pytest.raises(RangeError):
        RangeList.from_wire(total, range_bytes, b"\x00" * 32 * count)
    with pytest.raises(RangeError):
        RangeList.from_wire(total, RANGE, b"\x00" * 31)


def test_layouts_split_the_state_into_shared_and_node_parts() -> None:
    f32 = torch.float32
    template = {
        "model/w": (f32, (2, 3)),
        "inner/w/exp_avg": (f32, (2, 3)),
        "inner/w/exp_avg_sq": (f32, (2, 3)),
        "global/w": (f32, (2, 3)),
        "global/b": (f32, (3,)),
        "outer_momentum/w": (f32, (2, 3)),
        "outer_momentum/b": (f32, (3,)),
        "rng/torch": (torch.uint8, (8,)),
    }
    shared = shared_layout(template)
    assert [n for n, _ in shared.tensors] == ["global/w", "global/b", "outer_momentum/w", "outer_momentum/b"]
    assert shared.total_bytes == 4 * 18
    assert [n for n, _ in node_layout(template).tensors] == ["inner/w/exp_avg", "inner/w/exp_avg_sq"]


# ----- the fetcher -----


class FakePeer:
    """Serves blobs by root; `corrupt`: flips a byte of every range; `delay_s`: answers late; `dead`:
    never reachable."""

    def __init__(self, name: str, blobs: dict[str, bytes], ranges: dict[str, RangeList], **how: object):
        self.name, self.blobs, self.ranges = name, blobs, ranges
        self.corrupt = bool(how.get("corrupt"))
        self.delay_s = float(how.get("delay_s", 0.0))  # type: ignore[arg-type]
        self.dead = bool(how.get("dead"))
        self.compress = bool(how.get("compress"))
        self.asked = 0

    async def fetch(self, root: str, index: int, timeout_s: float) -> tuple[str, bytes]:
        self.asked += 1
        if self.dead:
            raise PeerFault(FetchFailure.UNREACHABLE, f"{self.name} is down")
        await asyncio.sleep(self.delay_s)
        start, stop = self.ranges[root].span(index)
        data = self.blobs[root][start:stop]
        if self.corrupt:
            return RAW, bytes([data[0] ^ 0xFF]) + data[1:]
        return encode_range(data) if self.compress else (RAW, data)


def blob(n_ranges: int) -> tuple[bytes, RangeList]:
    data = os.urandom(RANGE * n_ranges)
    return data, RangeList.of(data, RANGE)


def fetch_all(peers: list[FakePeer], jobs: list[RangeJob], **kw: object) -> tuple[dict, object]:
    got: dict[tuple[str, int], bytes] = {}

    def deliver(job: RangeJob, data: bytes) -> None:
        assert job.key not in got, "delivered twice"
        got[job.key] = data

    report = asyncio.run(RangeFetcher(peers, jobs, deliver, **kw).run())  # type: ignore[arg-type]
    return got, report


def test_ranges_come_from_the_honest_peers_when_one_lies_one_is_slow_and_one_is_dead() -> None:
    shared, shared_ranges = blob(24)
    node, node_ranges = blob(4)
    blobs = {shared_ranges.root: shared, node_ranges.root: node}
    lists = {shared_ranges.root: shared_ranges, node_ranges.root: node_ranges}
    honest = FakePeer("honest", blobs, lists)
    other = FakePeer("other", blobs, lists, compress=True)
    liar = FakePeer("liar", blobs, lists, corrupt=True)
    slow = FakePeer("slow", blobs, lists, delay_s=3.0)
    dead = FakePeer("dead", blobs, lists, dead=True)
    jobs = [RangeJob(shared_ranges, i) for i in range(len(shared_ranges))]
    jobs += [RangeJob(node_ranges, i, pinned="honest") for i in range(len(node_ranges))]
    failures: list[str] = []
    got, report = fetch_all([liar, slow, dead, honest, other], jobs, on_failure=failures.append)
    assembled = b"".join(got[(shared_ranges.root, i)] for i in range(len(shared_ranges)))
    assert hashlib.sha256(assembled).digest() == hashlib.sha256(shared).digest()
    assert all(got[(node_ranges.root, i)] == node[i * RANGE : (i + 1) * RANGE] for i in range(4))
    assert set(report.dropped) >= {"liar", "dead"}  # type: ignore[attr-defined]
    assert report.ranges_per_peer["liar"] == 0 and report.ranges_per_peer["dead"] == 0  # type: ignore
    assert report.failures["hash_mismatch"] >= 1 and report.failures["unreachable"] >= 2  # type: ignore
    assert "hash_mismatch" in failures
    # The slow peer's ranges were fetched again by a fast one: nobody waited for all of them.
    assert report.ranges_per_peer["slow"] <= 2, report  # type: ignore[attr-defined]


def test_the_work_of_a_peer_that_dies_is_reassigned() -> None:
    shared, ranges = blob(12)
    blobs, lists = {ranges.root: shared}, {ranges.root: ranges}
    a, b = FakePeer("a", blobs, lists), FakePeer("b", blobs, lists)

    async def dies_after_two(root: str, index: int, timeout_s: float) -> tuple[str, bytes]:
        a.asked += 1
        if a.asked > 2:
            raise PeerFault(FetchFailure.UNREACHABLE, "gone")
        return await FakePeer.fetch(b, root, index, timeout_s)

    a.fetch = dies_after_two  # type: ignore[method-assign]
    got, report = fetch_all([a, b], [RangeJob(ranges, i) for i in range(12)])
    assert len(got) == 12 and report.dropped == ["a"]  # type: ignore[attr-defined]
    assert report.ranges_per_peer["b"] >= 10  # type: ignore[attr-defined]


def test_a_range_already_won_is_never_fetched_again_while_a_pinned_part_goes_on() -> None:
    """The end game copies a range still in flight; once one copy won, the loser being cancelled must not
    make it look in flight to the other peers (they copied it back and forth, hundreds of times, for as
    long as the node part kept the fetch open, filling the receiver's link with waste)."""
    shared, shared_ranges = blob(8)
    node, node_ranges = blob(24)
    blobs = {shared_ranges.root: shared, node_ranges.root: node}
    lists = {shared_ranges.root: shared_ranges, node_ranges.root: node_ranges}
    a, b = FakePeer("a", blobs, lists, delay_s=0.001), FakePeer("b", blobs, lists, delay_s=0.001)
    pinned = FakePeer("pinned", blobs, lists, delay_s=0.01)
    jobs = [RangeJob(node_ranges, i, pinned="pinned") for i in range(24)]
    jobs += [RangeJob(shared_ranges, i) for i in range(8)]
    got, report = fetch_all([pinned, a, b], jobs)
    assert len(got) == 32
    # Each shared range at most twice (the end game's one copy), whatever the node part's length.
    assert a.asked + b.asked <= 2 * 8, (a.asked, b.asked)
    assert report.duplicates <= 4, report  # type: ignore[attr-defined]


def test_a_pinned_range_whose_peer_lies_fails_the_fetch() -> None:
    node, ranges = blob(3)
    blobs, lists = {ranges.root: node}, {ranges.root: ranges}
    liar, honest = FakePeer("liar", blobs, lists, corrupt=True), FakePeer("honest", blobs, lists)
    jobs = [RangeJob(ranges, i, pinned="liar") for i in range(3)]
    with pytest.raises(RangeFetchFailed, match="no peer left"):
        fetch_all([liar, honest], jobs)
    assert honest.asked == 0


def test_only_liars_fail_the_fetch() -> None:
    shared, ranges = blob(4)
    blobs, lists = {ranges.root: shared}, {ranges.root: ranges}
    liars = [FakePeer(f"liar{i}", blobs, lists, corrupt=True) for i in range(3)]
    with pytest.raises(RangeFetchFailed):
        fetch_all(liars, [RangeJob(ranges, i) for i in range(4)])  # type: ignore[arg-type]


def test_a_range_travels_as_compressed_byte_planes_and_decodes_only_to_its_size() -> None:
    values = torch.randn(RANGE // 4) * 0.02
    data = values.numpy().tobytes()
    encoding, sent = encode_range(data)
    assert encoding != RAW and len(sent) < len(data)
    assert decode_range(encoding, sent, len(data)) == data
    with pytest.raises(RangeError):
        decode_range(encoding, sent, len(data) - 4)  # its frame declares another size
    with pytest.raises(RangeError):
        decode_range(encoding, b"not zstd", len(data))
    with pytest.raises(RangeError):
        decode_range("gzip", sent, len(data))
    assert encode_range(os.urandom(RANGE))[0] == RAW  # noise: sent as it is


# ----- agreeing on a root -----

TEMPLATE = {
    name: (torch.float32, (RANGE // 4,))
    for name in ("inner/w/exp_avg", "inner/w/exp_avg_sq", "global/w", "outer_momentum/w")
}


PEERS = [Identity.generate() for _ in range(5)]
"""Peer i's identity: its announcement's node id derives from it and it signs its manifests."""


def manifest_of(shared: bytes, signer: int | None = None) -> RangeManifest:
    """A manifest with this shared part (signed by peer `signer`'s identity; None: unsigned)."""
    node = RangeList.of(os.urandom(2 * RANGE), RANGE)
    manifest = RangeManifest(2, "c" * 64, RangeList.of(shared, RANGE), node, "{}")
    return manifest if signer is None else manifest.signed(PEERS[signer])


def test_the_root_most_peers_hand_in_is_trusted_and_a_silent_peer_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    honest, lie = os.urandom(2 * RANGE), os.urandom(2 * RANGE)
    answers = {"a": manifest_of(honest, 1), "b": manifest_of(honest, 2), "c": manifest_of(lie, 3)}

    async def get_range_manifest(address: str, outer_step: int, *args: object) -> RangeManifest:
        if address.startswith("10.0.0.4"):
            await asyncio.sleep(3600)  # a silent peer
        return answers[{"10.0.0.1:1": "a", "10.0.0.2:1": "b", "10.0.0.3:1": "c"}[address]]

    monkeypatch.setattr(many_peers.state_ranges, "get_range_manifest", get_range_manifest)
    monkeypatch.setattr(many_peers, "AGREEMENT_GRACE_S", 0.2)
    peers = [announcement(i, f"10.0.0.{i}:1") for i in (1, 2, 3, 4)]
    fetch = ManyPeerFetch(TEMPLATE, "b" * 64, max_peers=4)
    agreeing = asyncio.run(asyncio.wait_for(fetch._agreeing(peers, 2), 10))
    assert [p.address for p, _ in agreeing] == ["10.0.0.1:1", "10.0.0.2:1"]
    assert {m.shared.root for _, m in agreeing} == {RangeList.of(honest, RANGE).root}


def test_without_two_peers_agreeing_there_is_no_root(monkeypatch: pytest.MonkeyPatch) -> None:
    async def get_range_manifest(address: str, outer_step: int, *args: object) -> RangeManifest:
        return manifest_of(os.urandom(2 * RANGE), int(address[7]))  # every peer a different state

    monkeypatch.setattr(many_peers.state_ranges, "get_range_manifest", get_range_manifest)
    peers = [announcement(i, f"10.0.0.{i}:1") for i in (1, 2, 3)]
    fetch = ManyPeerFetch(TEMPLATE, "b" * 64, max_peers=3)
    with pytest.raises(ManyPeersUnavailable, match="agree"):
        asyncio.run(fetch._agreeing(peers, 2))


def test_a_manifest_whose_sizes_do_not_fit_this_model_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = os.urandom(3 * RANGE)  # this model's shared part is 2 ranges

    async def get_range_manifest(address: str, outer_step: int, *args: object) -> RangeManifest:
        return manifest_of(shared, int(address[7]))

    monkeypatch.setattr(many_peers.state_ranges, "get_range_manifest", get_range_manifest)
    failures: list[str] = []
    fetch = ManyPeerFetch(TEMPLATE, "b" * 64, max_peers=3, on_range_failure=failures.append)
    with pytest.raises(ManyPeersUnavailable):
        asyncio.run(fetch._agreeing([announcement(i, f"10.0.0.{i}:1") for i in (1, 2)], 2))
    assert failures == ["invalid", "invalid"]


def announcement(index: int, address: str) -> Announcement:
    node = PEERS[index].node_id_hex
    return Announcement(node, address, "a" * 64, 1000, 2, 10, "cold", 1.0, "b" * 64)


def test_a_manifest_is_taken_only_from_the_node_whose_announcement_led_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node part and metadata are one peer's word: a manifest unsigned, signed by another node
    (one on the path, or a peer answering for another) or altered after signing is not counted."""
    shared = os.urandom(2 * RANGE)
    honest = manifest_of(shared, 1)
    altered = replace(manifest_of(shared, 3), metadata_json='{"outer_step": 99}')
    answers = {1: honest, 2: manifest_of(shared, 4), 3: altered, 4: manifest_of(shared)}

    async def get_range_manifest(address: str, outer_step: int, *args: object) -> RangeManifest:
        return answers[int(address[7])]

    monkeypatch.setattr(many_peers.state_ranges, "get_range_manifest", get_range_manifest)
    failures: list[str] = []
    fetch = ManyPeerFetch(TEMPLATE, "b" * 64, max_peers=4, on_range_failure=failures.append)
    with pytest.raises(ManyPeersUnavailable, match="agree"):  # only peer 1's counts: no two agree
        asyncio.run(fetch._agreeing([announcement(i, f"10.0.0.{i}:1") for i in (1, 2, 3, 4)], 2))
    assert failures == ["invalid", "invalid", "invalid"]
    assert honest.signed_by(PEERS[1].node_id_hex) and not honest.signed_by(PEERS[2].node_id_hex)


def test_a_blob_is_cut_into_ranges_straight_from_its_tensors() -> None:
    f32 = torch.float32
    sizes = {"global/a": 1000, "global/b": 3001, "outer_momentum/a": 1000, "outer_momentum/b": 3001}
    tensors = {name: torch.randn(n) for name, n in sizes.items()}
    joined = b"".join(tensors[name].numpy().tobytes() for name in sizes)
    template = {name: (f32, (n,)) for name, n in sizes.items()}
    pieces = range_source.cut_blob(dict(tensors), shared_layout(template), RANGE)
    assert b"".join(pieces) == joined and all(len(p) == RANGE for p in pieces[:-1])
    assert range_source.hashed(pieces, RANGE).root == RangeList.of(joined, RANGE).root


# ----- an open-ended fetch -----


def test_an_open_ended_fetch_takes_more_peers_and_ranges_while_it_runs_and_ends_only_when_closed() -> None:
    """Recovery's node part starts from one peer before the shared root is agreed on; the shared ranges
    and their peers join the same fetch later, and that peer still serves its pinned ranges first."""
    shared, shared_ranges = blob(8)
    node, node_ranges = blob(6)
    blobs = {shared_ranges.root: shared, node_ranges.root: node}
    lists = {shared_ranges.root: shared_ranges, node_ranges.root: node_ranges}
    pinned, a, b = (FakePeer(n, blobs, lists, delay_s=0.002) for n in ("pinned", "a", "b"))
    order: list[tuple[str, int]] = []
    fetch_of_pinned = pinned.fetch

    async def logged(root: str, index: int, timeout_s: float) -> tuple[str, bytes]:
        order.append((root, index))
        return await fetch_of_pinned(root, index, timeout_s)

    pinned.fetch = logged  # type: ignore[method-assign]
    got: dict[tuple[str, int], bytes] = {}
    two_in = asyncio.Event()

    def deliver(job: RangeJob, data: bytes) -> None:
        assert job.key not in got, "delivered twice"
        got[job.key] = data
        if len(got) == 2:
            two_in.set()

    async def main() -> None:
        node_jobs = [RangeJob(node_ranges, i, pinned="pinned") for i in range(6)]
        fetcher = RangeFetcher([pinned], node_jobs[:2], deliver, open_ended=True)
        run = asyncio.create_task(fetcher.run())
        await asyncio.wait_for(two_in.wait(), 10)
        # A closed fetch started only now, of the same two ranges, runs from start to end while the
        # open-ended one has every range it was given: that one had as long to end, and must not have.
        control = FakePeer("control", blobs, lists)
        closed = RangeFetcher([control], [RangeJob(node_ranges, i) for i in range(2)], lambda job, data: None)
        await asyncio.wait_for(closed.run(), 10)
        assert not run.done()  # every range given so far is in, but more may come
        await fetcher.extend([pinned, a, b], node_jobs[2:] + [RangeJob(shared_ranges, i) for i in range(8)])
        await fetcher.close()
        await asyncio.wait_for(run, 10)

    asyncio.run(main())
    assert len(got) == 14
    assert b"".join(got[(shared_ranges.root, i)] for i in range(8)) == shared
    assert b"".join(got[(node_ranges.root, i)] for i in range(6)) == node
    # The pinned peer took a shared range only once its last pinned one was asked for.
    last_pinned = max(i for i, (root, _) in enumerate(order) if root == node_ranges.root)
    assert all(root == node_ranges.root for root, _ in order[:last_pinned])
    assert a.asked + b.asked + len(order) <= 14 + 2 * 3  # at most the end game's copies beyond each once


def test_an_open_ended_fetch_fails_at_once_when_its_pinned_peer_lies() -> None:
    node, ranges = blob(3)
    blobs, lists = {ranges.root: node}, {ranges.root: ranges}
    liar = FakePeer("liar", blobs, lists, corrupt=True)
    jobs = [RangeJob(ranges, i, pinned="liar") for i in range(3)]
    fetcher = RangeFetcher([liar], jobs, lambda job, data: None, open_ended=True)
    with pytest.raises(RangeFetchFailed, match="no peer left"):
        asyncio.run(asyncio.wait_for(fetcher.run(), 10))  # not left waiting for a `close`


# ----- the node part first -----

WIDE = {name: (torch.float32, (3 * RANGE // 4,)) for name in TEMPLATE}
"""Shared part and node part of 6 ranges each."""


def metadata_json(signer: int, global_digest: str, inner_step: int) -> str:
    cursor = {"shard": 0, "epoch": 0, "position": 0}
    return json.dumps(
        {
            **{"run_id": "r", "node_id": PEERS[signer].node_id_hex, "run_digest": "b" * 64},
            **{"corpus_digest": "d" * 64, "model": "tiny", "outer_step": 2, "inner_step": inner_step},
            **{"round_step": 0, "round_tokens": 0, "tokens": 0, "last_loss": None, "heldout_loss": None},
            **{"cursor": cursor, "committed_cursor": cursor, "swarm_cursors": {}, "last_round": None},
            **{"global_digest": global_digest, "optimizer": {"adam_step": 9, "schedule_step": 9}},
            **{"created_at": 1.0, "kind": "cold", "layout": "planes"},
        }
    )


class RangeServer:
    """A fake peer at outer step 2 serving `shared` and a node part of its own. Its manifest waits for
    `manifest_gate` (a snapshot still being read) and can be of another shared state; `dies_after`:
    it stops answering range requests after that many."""

    def __init__(self, signer: int, shared: bytes, inner_step: int, **how: object) -> None:
        self.address, self.signer = f"10.0.0.{signer}:1", signer
        self.node = os.urandom(6 * RANGE)
        self.shared = shared
        digest = hashlib.sha256(shared[: 3 * RANGE]).hexdigest()
        manifest = RangeManifest(
            2,
            "c" * 64,
            RangeList.of(shared, RANGE),
            RangeList.of(self.node, RANGE),
            metadata_json(signer, digest, inner_step),
        )
        self.manifest = manifest.signed(PEERS[signer])
        self.announcement = Announcement(
            PEERS[signer].node_id_hex, self.address, "c" * 64, 1000, 2, inner_step, "cold", 1.0, "b" * 64
        )
        self.manifest_gate: asyncio.Event | None = how.get("manifest_gate")  # type: ignore[assignment]
        self.dies_after = int(how.get("dies_after", 1 << 30))  # type: ignore[call-overload]
        self.manifest_asked_at: float | None = None
        self.asks: list[tuple[str, int]] = []
        self.node_served = asyncio.Event()
        self.active = 0

    async def get_manifest(self) -> RangeManifest:
        self.manifest_asked_at = time.monotonic()
        if self.manifest_gate is not None:
            await self.manifest_gate.wait()
        return self.manifest

    async def fetch(self, root: str, index: int) -> tuple[str, bytes]:
        self.asks.append((root, index))
        if len(self.asks) > self.dies_after:
            raise PeerFault(FetchFailure.UNREACHABLE, f"{self.address} is down")
        self.active += 1
        try:
            await asyncio.sleep(0.002)
        finally:
            self.active -= 1
        data = self.node if root == self.manifest.node.root else self.shared
        start, stop = RangeList.of(data, RANGE).span(index)
        if root == self.manifest.node.root:
            self.node_served.set()
        return RAW, data[start:stop]


def serve(monkeypatch: pytest.MonkeyPatch, servers: list[RangeServer]) -> None:
    by_address = {s.address: s for s in servers}

    async def get_range_manifest(address: str, outer_step: int, *args: object) -> RangeManifest:
        return await by_address[address].get_manifest()

    async def fetch_range(address: str, root: str, index: int, *args: object) -> tuple[str, bytes]:
        return await by_address[address].fetch(root, index)

    monkeypatch.setattr(many_peers.state_ranges, "get_range_manifest", get_range_manifest)
    monkeypatch.setattr(many_peers.state_ranges, "fetch_range", fetch_range)


def node_bytes(state: many_peers.RangedState) -> bytes:
    tensors = state.loaded.tensors
    return tensors["inner/w/exp_avg"].numpy().tobytes() + tensors["inner/w/exp_avg_sq"].numpy().tobytes()


def test_the_node_part_starts_before_the_slower_peers_manifests_are_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node part from one peer is the long pole: the freshest peer is asked for its manifest first
    and its node ranges go out before the others have even answered (they answer here only once one
    of its node ranges was served: without the head start the fetch would never begin)."""
    shared = os.urandom(6 * RANGE)

    async def main() -> tuple[RangeServer, list[RangeServer], many_peers.RangedState]:
        head = RangeServer(1, shared, inner_step=12)
        others = [RangeServer(i, shared, inner_step=10, manifest_gate=head.node_served) for i in (2, 3)]
        serve(monkeypatch, [head, *others])
        fetch = ManyPeerFetch(WIDE, "b" * 64, max_peers=3)
        state = await asyncio.wait_for(fetch.fetch([s.announcement for s in (*others, head)], 2), 20)
        return head, others, state

    head, others, state = asyncio.run(main())
    assert state.node_peer.address == head.address and node_bytes(state) == head.node
    assert state.loaded.tensors["global/w"].numpy().tobytes() == shared[: 3 * RANGE]
    assert state.stages_s["node_part_start"] < state.stages_s["manifests"]
    assert head.manifest_asked_at is not None
    assert all(
        o.manifest_asked_at is not None and o.manifest_asked_at >= head.manifest_asked_at for o in others
    )
    # Nothing fetched twice beyond the end game: each node range once, from its peer alone.
    asks = Counter(key for s in (head, *others) for key in s.asks)
    assert all(asks[(head.manifest.node.root, i)] == 1 for i in range(6))
    assert not any(root == o.manifest.node.root for o in others for root, _ in o.asks)
    shared_root = head.manifest.shared.root
    assert sum(asks[(shared_root, i)] for i in range(6)) <= 6 + 2 * 3


def test_the_others_are_asked_after_the_head_start_when_the_freshest_peer_is_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = os.urandom(6 * RANGE)
    monkeypatch.setattr(many_peers, "HEAD_START_S", 0.05)

    async def main() -> tuple[RangeServer, list[RangeServer], many_peers.RangedState]:
        others = [RangeServer(2, shared, inner_step=11), RangeServer(3, shared, inner_step=10)]
        head = RangeServer(1, shared, inner_step=12, manifest_gate=asyncio.Event())  # never answers
        serve(monkeypatch, [head, *others])
        monkeypatch.setattr(many_peers, "AGREEMENT_GRACE_S", 0.05)
        fetch = ManyPeerFetch(WIDE, "b" * 64, max_peers=3)
        state = await asyncio.wait_for(fetch.fetch([s.announcement for s in (head, *others)], 2), 20)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # its manifest is not waited for any more
        return head, others, state

    head, others, state = asyncio.run(main())
    assert head.manifest_asked_at is not None
    assert all(
        o.manifest_asked_at is not None and o.manifest_asked_at >= head.manifest_asked_at + 0.04
        for o in others
    )
    assert state.node_peer.address == others[0].address and node_bytes(state) == others[0].node
    assert state.loaded.tensors["global/w"].numpy().tobytes() == shared[: 3 * RANGE]


def test_a_node_part_source_whose_shared_root_is_not_agreed_on_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The freshest peer's node part is fetched early, but that peer holds another shared state (stale,
    or lying): once the others agree, its fetch is cancelled and the node part comes from the freshest
    agreeing peer; the state is theirs alone."""
    agreed = os.urandom(6 * RANGE)

    async def main() -> tuple[RangeServer, list[RangeServer], many_peers.RangedState]:
        stale = RangeServer(1, os.urandom(6 * RANGE), inner_step=12)
        others = [
            RangeServer(2, agreed, inner_step=11, manifest_gate=stale.node_served),
            RangeServer(3, agreed, inner_step=10, manifest_gate=stale.node_served),
        ]
        serve(monkeypatch, [stale, *others])
        fetch = ManyPeerFetch(WIDE, "b" * 64, max_peers=3)
        try:
            state = await asyncio.wait_for(fetch.fetch([s.announcement for s in (stale, *others)], 2), 20)
        finally:
            assert asyncio.all_tasks() == {asyncio.current_task()}
        return stale, others, state

    stale, others, state = asyncio.run(main())
    assert stale.asks and stale.active == 0  # its node part was started, then cancelled
    assert all(root == stale.manifest.node.root for root, _ in stale.asks)
    assert state.node_peer.address == others[0].address and node_bytes(state) == others[0].node
    assert state.loaded.tensors["global/w"].numpy().tobytes() == agreed[: 3 * RANGE]
    assert sorted(state.peers) == sorted(o.address for o in others)


def test_a_node_part_source_that_dies_mid_way_is_replaced_and_the_shared_ranges_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = os.urandom(6 * RANGE)

    async def main() -> tuple[list[RangeServer], many_peers.RangedState]:
        servers = [RangeServer(1, shared, inner_step=12, dies_after=3)]
        servers += [RangeServer(2, shared, inner_step=11), RangeServer(3, shared, inner_step=10)]
        serve(monkeypatch, servers)
        fetch = ManyPeerFetch(WIDE, "b" * 64, max_peers=3)
        try:
            state = await asyncio.wait_for(fetch.fetch([s.announcement for s in servers], 2), 20)
        finally:
            assert asyncio.all_tasks() == {asyncio.current_task()}
        return servers, state

    servers, state = asyncio.run(main())
    assert state.node_peer.address == servers[1].address and node_bytes(state) == servers[1].node
    assert state.loaded.tensors["global/w"].numpy().tobytes() == shared[: 3 * RANGE]
    shared_root = servers[1].manifest.shared.root
    asks = Counter(key for s in servers for key in s.asks if key[0] == shared_root)
    assert sum(asks.values()) <= 6 + 2 * 3  # the shared ranges were not all fetched again


def test_no_agreement_cancels_the_node_part_already_started(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> list[RangeServer]:
        head = RangeServer(1, os.urandom(6 * RANGE), inner_step=12)
        servers = [head] + [
            RangeServer(i, os.urandom(6 * RANGE), inner_step=10, manifest_gate=head.node_served)
            for i in (2, 3)
        ]
        serve(monkeypatch, servers)
        fetch = ManyPeerFetch(WIDE, "b" * 64, max_peers=3)
        with pytest.raises(ManyPeersUnavailable, match="agree"):
            await asyncio.wait_for(fetch.fetch([s.announcement for s in servers], 2), 20)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        return servers

    servers = asyncio.run(main())
    assert servers[0].asks and servers[0].active == 0
