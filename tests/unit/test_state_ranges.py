"""Range lists (hash list, root, bounds), the many-peer range fetcher with fake peers, and how a
recovering node agrees on a root from its peers' manifests."""

from __future__ import annotations

import asyncio
import hashlib
import os
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
from swarmnode.swarm import many_peers, range_source
from swarmnode.swarm.announcements import Announcement
from swarmnode.swarm.many_peers import ManyPeerFetch, ManyPeersUnavailable
from swarmnode.swarm.range_fetch import RangeFetcher, RangeFetchFailed, RangeJob
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
