"""Recovery's failure semantics: a peer's fault is counted by its reason; a bug here is counted as
`internal` and logged with its traceback, never dressed up as the peer's fault; the next candidate is
tried either way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from swarmnode.bench.runner import trained_run
from swarmnode.net.rpc import PeerUnavailable
from swarmnode.swarm.announcements import Announcement
from swarmnode.swarm.recovery.many_peers import ManyPeersUnavailable
from swarmnode.swarm.recovery.restore import Recovery
from swarmnode.util.threads import TrainingThread


def announcement(node: str, outer_step: int) -> Announcement:
    return Announcement(node * 20, "127.0.0.1:9", "a" * 64, 1000, outer_step, 10, "hot", 1.0, "b" * 64)


def recover_with(fetch: Callable[[Announcement, Callable[[bytes], Awaitable[None]]], Awaitable[str]]):
    reasons: list[str] = []
    run = trained_run("tiny", 0, 64, 2)
    training = TrainingThread()
    try:
        recovery = Recovery(run, training, fetch, reasons.append)
        peers = [announcement("0a", 3), announcement("0b", 2)]
        receipt = asyncio.run(recovery.recover(peers, None, [], 0.0))
    finally:
        training.close()
    return receipt, reasons


def test_a_peer_that_is_unreachable_is_counted_by_its_reason_and_the_next_tried() -> None:
    tried: list[str] = []

    async def fetch(peer: Announcement, on_data: Callable[[bytes], Awaitable[None]]) -> str:
        tried.append(peer.node_id)
        raise PeerUnavailable("unreachable", "nobody home")

    receipt, reasons = recover_with(fetch)
    assert reasons == ["unreachable", "unreachable"] and tried == ["0a" * 20, "0b" * 20]
    assert receipt.source == "fresh" and len(receipt.failed_candidates) == 2


def test_a_bug_while_recovering_is_internal_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def fetch(peer: Announcement, on_data: Callable[[bytes], Awaitable[None]]) -> str:
        raise TypeError("a bug of ours")

    with caplog.at_level("ERROR"):
        receipt, reasons = recover_with(fetch)
    assert reasons == ["internal", "internal"]
    tracebacks = [r for r in caplog.records if r.exc_info and "failed unexpectedly" in r.getMessage()]
    assert len(tracebacks) == 2 and isinstance(tracebacks[0].exc_info[1], TypeError)  # type: ignore[index]
    assert receipt.source == "fresh"


class FailingManyPeerFetch:
    """A `ManyPeerFetch` whose peers never agree on a root."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def worth_trying(self, peers: list[Announcement], outer_step: int) -> bool:
        return sum(p.outer_step == outer_step for p in peers) >= 2

    async def fetch(self, peers: list[Announcement], outer_step: int) -> object:
        self.asked.append(outer_step)
        raise ManyPeersUnavailable("refused", "no shared root that 2 peers agree on")


def test_a_failed_recovery_from_many_peers_falls_back_to_one_peer_at_a_time() -> None:
    tried: list[str] = []

    async def fetch(peer: Announcement, on_data: Callable[[bytes], Awaitable[None]]) -> str:
        tried.append(peer.node_id)
        raise PeerUnavailable("unreachable", "nobody home")

    many = FailingManyPeerFetch()
    run = trained_run("tiny", 0, 64, 2)
    training = TrainingThread()
    reasons: list[str] = []
    try:
        recovery = Recovery(run, training, fetch, reasons.append, many=many)  # type: ignore[arg-type]
        peers = [announcement("0a", 3), announcement("0b", 3), announcement("0c", 2)]
        receipt = asyncio.run(recovery.recover(peers, None, [], 0.0))
    finally:
        training.close()
    assert many.asked == [3]  # once per outer step; step 2 has one peer: nothing to agree on
    assert tried == ["0a" * 20, "0b" * 20, "0c" * 20]  # then each candidate whole, as with K = 1
    assert reasons == ["refused", "unreachable", "unreachable", "unreachable"]
    assert receipt.failed_candidates[0].startswith("many peers at outer step 3: refused")


def test_a_shard_taken_over_resumes_at_the_furthest_committed_cursor_others_reached() -> None:
    """A node without a record of its own in the adopted lineage, on a shard others trained (it claimed a
    departed node's shard): it goes on where the lineage says that shard's batches are in the model."""
    run = trained_run("tiny", 0, 64, 2)
    training = TrainingThread()
    try:
        recovery = Recovery(run, training, fetch=None, on_failure=lambda reason: None)  # type: ignore[arg-type]
        shard = run.loader.shard
        lineage = {
            "0a" * 20: {"shard": shard, "epoch": 0, "position": 40},
            "0b" * 20: {"shard": shard, "epoch": 0, "position": 80},
            "0c" * 20: {"shard": shard + 1, "epoch": 3, "position": 200},  # another shard's
        }
        taken = recovery._own_cursor(None, lineage)
        assert taken.source == "takeover" and taken.cursor == lineage["0b" * 20]
        mine = {"shard": shard, "epoch": 0, "position": 8}
        own = recovery._own_cursor(None, {**lineage, run.identity.node_id: mine})
        assert own.source == "round_metadata" and own.cursor == mine  # its own record wins
        assert recovery._own_cursor(None, {}).source == "fresh"
    finally:
        training.close()
