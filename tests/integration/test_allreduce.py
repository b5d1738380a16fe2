"""Butterfly all-reduce over real gRPC servers on loopback (swarmnode.swarm.averaging.allreduce).

Each member has its own `snapshot_server.start_server` with the averaging service registered, in one process,
except in the kill test, whose victim is this module run as a script:
`python test_allreduce.py member NODE_ID N_ELEMENTS SEED WEIGHT` starts a server, prints its port,
reads the group spec as one JSON line on stdin and joins the all-reduce.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch

from swarmnode.net import rpc, snapshot_server
from swarmnode.net.bulk import BulkListener
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging import allreduce as averaging
from swarmnode.swarm.averaging import codecs
from swarmnode.swarm.averaging.allreduce import COLLECT_SHARE, AllReduceResult
from swarmnode.swarm.averaging.reducer import SILENT_GRACE_MIN_S, AveragingServicer
from swarmnode.swarm.averaging.trust import UNCHECKED, AveragingTrust
from swarmnode.swarm.averaging.wire import GroupSpec, Member
from swarmnode.util import faults

pytestmark = pytest.mark.timeout(90)
LOCALHOST = "127.0.0.1"
T = TypeVar("T")


class NoSnapshots:
    def list_snapshots(self) -> list:
        return []

    def find(self, snapshot_id: str | None) -> None:
        return None


@dataclass
class Node:
    servicer: AveragingServicer
    server: snapshot_server.RpcServer
    lanes: BulkListener | None = None

    async def stop(self) -> None:
        await self.server.stop(0)
        if self.lanes is not None:
            await self.lanes.close()

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.server.port}"

    @property
    def member(self) -> Member:
        return Member(self.servicer.node_id, self.address)


async def start_node(
    node_id: str,
    on_proposal: Callable[[GroupSpec, str | None], Awaitable[GroupSpec | None]] | None = None,
    *,
    trust: AveragingTrust = UNCHECKED,
    on_rejected: Callable[[str], None] | None = None,
    lanes: bool = True,
) -> Node:
    """A member as a node starts it: with bulk lanes unless `lanes` is False (every byte on gRPC)."""
    listener = BulkListener() if lanes else None
    if listener is not None:
        await listener.start(LOCALHOST)
    servicer = AveragingServicer(node_id, on_proposal, on_rejected=on_rejected, trust=trust, lanes=listener)
    server = await snapshot_server.start_server(
        LOCALHOST,
        0,
        NoSnapshots(),
        lambda: rpc.NodeStatus(node_id, "run"),
        extra_servicers=[servicer.register],
    )
    return Node(servicer, server, listener)


@asynccontextmanager
async def swarm(size: int, lanes: bool = True) -> AsyncIterator[list[Node]]:
    nodes = [await start_node(f"{i + 1:02x}", lanes=lanes) for i in range(size)]
    try:
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


def group(
    members: Sequence[Member], wire_dtype: str = "fp32", timeout_s: float = 10.0, group_id: str = "g1"
) -> GroupSpec:
    return GroupSpec("run", 7, group_id, tuple(members), wire_dtype, timeout_s)


def run(coro: Awaitable[T], timeout_s: float = 60.0) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


def random_deltas(count: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(count)]


def weighted_average(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = torch.zeros(deltas[0].numel(), dtype=torch.float64)
    for w, d in zip(weights, deltas, strict=True):
        total += w * d.double()
    return (total / sum(weights)).float()


async def allreduce(
    nodes: Sequence[Node], spec: GroupSpec, deltas: Sequence[torch.Tensor], weights: Sequence[float]
) -> list[AllReduceResult]:
    return list(
        await asyncio.gather(
            *(
                averaging.butterfly_allreduce(node.servicer, spec, i, delta, weight)
                for i, (node, delta, weight) in enumerate(zip(nodes, deltas, weights, strict=True))
            )
        )
    )


def assert_identical(results: Sequence[AllReduceResult]) -> None:
    first = results[0]
    for other in results[1:]:
        assert other.averaged.covered == first.averaged.covered
        assert other.contributors == first.contributors
        assert other.included == first.included
        assert torch.equal(other.averaged.delta, first.averaged.delta)


def part(spec: GroupSpec, k: int, n: int) -> slice:
    return slice(*spec.part_range(k, n))


# ---------------------------------------------------------------------------------------------------
# Everyone healthy


@pytest.mark.parametrize("size", [2, 3, 4])
def test_fp32_average_is_the_exact_weighted_average_on_every_member(size: int) -> None:
    n = 300_007
    deltas, weights = random_deltas(size, n), [1000.0 * (i + 1) for i in range(size)]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(size) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes]), deltas, weights)

    results = run(scenario())
    assert_identical(results)
    expected = weighted_average(deltas, weights)
    for result in results:
        assert result.averaged.covered == ((0, n),) and result.averaged.coverage == 1.0
        assert result.contributors == (size,) * size and result.averaged.group_size == size
        assert torch.allclose(result.averaged.delta, expected, rtol=0, atol=1e-6)
        # its parts to the others and their averages back: 2·(N−1)/N of Δ's bytes
        assert result.bytes_sent == pytest.approx(2 * (size - 1) / size * 4 * n, abs=8)


@pytest.mark.parametrize("cached", [True, False])
def test_a_node_opens_one_channel_per_peer_across_rounds(
    cached: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the node's channel cache, three rounds of a 3-member group open each peer's channel once
    (one connection and TLS handshake per peer, not per exchange); without it, once per exchange."""
    opened: list[str] = []
    real_open = rpc.open_channel

    def counting_open(address: str):  # type: ignore[no-untyped-def]
        opened.append(address)
        return real_open(address)

    monkeypatch.setattr(rpc, "open_channel", counting_open)
    n = 30_000
    deltas, weights = random_deltas(3, n), [1.0, 1.0, 1.0]

    async def scenario() -> None:
        async with swarm(3) as nodes:
            caches = [rpc.ChannelCache() if cached else None for _ in nodes]
            try:
                for r in range(3):
                    spec = group([x.member for x in nodes], group_id=f"g{r}")
                    await asyncio.gather(
                        *(
                            averaging.butterfly_allreduce(
                                node.servicer, spec, i, deltas[i], weights[i], cache
                            )
                            for i, (node, cache) in enumerate(zip(nodes, caches, strict=True))
                        )
                    )
            finally:
                for cache in caches:
                    if cache is not None:
                        await cache.close()

    run(scenario())
    assert len(opened) == (3 * 2 if cached else 3 * 3 * 2)  # 3 members x 2 peers (x 3 rounds)


@pytest.mark.parametrize(("wire_dtype", "atol"), [("bf16", 0.05), ("int8", 0.08), ("int4", 1.0)])
def test_compressed_averages_agree_bitwise_and_stay_near_fp32(wire_dtype: str, atol: float) -> None:
    n, size = 200_003, 3
    deltas, weights = random_deltas(size, n, seed=1), [1.0, 2.0, 5.0]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(size) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes], wire_dtype), deltas, weights)

    results = run(scenario())
    assert_identical(results)
    error = (results[0].averaged.delta - weighted_average(deltas, weights)).abs()
    assert error.max() < atol and error.mean() < atol / 8
    assert results[0].bytes_sent == pytest.approx(2 * 2 / 3 * codecs.encoded_size(wire_dtype, n), rel=1e-3)


@pytest.mark.parametrize(
    ("weights", "expected", "contributors"),
    [
        ((1.0, 3.0), 0.75, 2),  # tokens weight the average
        ((0.0, 3.0), 1.0, 1),  # a member with no tokens contributes nothing
        ((0.0, 0.0), None, 0),  # no tokens at all: nothing is averaged
    ],
)
def test_contributions_are_weighted_by_tokens(
    weights: tuple[float, float], expected: float | None, contributors: int
) -> None:
    n = 10_000
    deltas = [torch.zeros(n), torch.ones(n)]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(2) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes]), deltas, weights)

    results = run(scenario())
    assert_identical(results)
    assert results[0].contributors == (contributors, contributors)
    if expected is None:
        assert results[0].averaged.covered == ()
    else:
        assert results[0].averaged.covered == ((0, n),)
        assert torch.equal(results[0].averaged.delta, torch.full((n,), expected))


def test_equal_token_counts_give_exactly_the_plain_mean() -> None:
    """(Δ₀ + Δ₁) / 2 bit for bit, whatever the token count: a single-process reference matches."""
    deltas = random_deltas(2, 100_003, seed=7)

    async def scenario() -> list[AllReduceResult]:
        async with swarm(2) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes]), deltas, [2560.0, 2560.0])

    results = run(scenario())
    assert_identical(results)
    assert torch.equal(results[0].averaged.delta, (deltas[0] + deltas[1]) / 2)


def test_a_group_of_one_is_the_identity_without_network() -> None:
    delta = torch.randn(1000)
    servicer = AveragingServicer("01")
    spec = group([Member("01", "127.0.0.1:1")])
    result = run(averaging.butterfly_allreduce(servicer, spec, 0, delta, 5.0))
    assert torch.equal(result.averaged.delta, delta) and result.averaged.coverage == 1.0
    assert result.contributors == (1,) and result.bytes_sent == 0


def test_more_members_than_values_leaves_empty_parts_harmless() -> None:
    deltas, weights = random_deltas(4, 3), [1.0, 1.0, 1.0, 1.0]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(4) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes]), deltas, weights)

    results = run(scenario())
    assert_identical(results)
    assert results[0].averaged.covered == ((0, 3),)
    assert torch.allclose(results[0].averaged.delta, weighted_average(deltas, weights), atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Proposals


def test_proposal_is_accepted_or_refused_and_carries_the_whole_group() -> None:
    seen: list[GroupSpec] = []

    async def accept(spec: GroupSpec, proposer: str | None) -> GroupSpec:
        seen.append(spec)
        return spec

    async def refuse(spec: GroupSpec, proposer: str | None) -> None:
        return None

    async def scenario() -> tuple[bool, ...]:
        yes, no = await start_node("0a", accept), await start_node("0b", refuse)
        try:
            cursor = {"shard": 3, "epoch": 1, "position": 96}
            spec = group(
                [Member("0a", yes.address, 12.5, cursor, "ab" * 32), Member("0b", no.address)], "int8", 4.5
            )
            stranger = group([Member("0c", "127.0.0.1:1"), Member("0d", "127.0.0.1:2")])
            return (
                await averaging.propose_group(yes.address, spec, 5.0),
                await averaging.propose_group(no.address, spec, 5.0),
                await averaging.propose_group(yes.address, stranger, 5.0),
                await averaging.propose_group(f"{LOCALHOST}:{free_port()}", spec, 5.0),
            )
        finally:
            await yes.stop()
            await no.stop()

    assert run(scenario()) == (True, False, False, False)
    assert len(seen) == 1 and seen[0].members[0].cursor == {"shard": 3, "epoch": 1, "position": 96}
    assert seen[0] == group(
        [
            Member(
                "0a", seen[0].members[0].address, 12.5, {"shard": 3, "epoch": 1, "position": 96}, "ab" * 32
            ),
            Member("0b", seen[0].members[1].address),
        ],
        "int8",
        4.5,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------------
# Failures


def test_a_silent_member_leaves_only_its_own_part_uncovered() -> None:
    n, timeout_s = 90_000, 3.0
    deltas, weights = random_deltas(3, n, seed=2), [1.0, 2.0, 4.0]

    async def scenario() -> tuple[list[AllReduceResult], float]:
        async with swarm(3) as nodes:
            spec = group([x.member for x in nodes], timeout_s=timeout_s)
            assert await averaging.propose_group(nodes[2].address, spec, 5.0)  # joins, then never starts
            started = time.monotonic()
            results = await allreduce(nodes[:2], spec, deltas[:2], weights[:2])
            return results, time.monotonic() - started

    results, seconds = run(scenario())
    assert seconds < timeout_s + 1.0
    assert_identical(results)
    assert results[0].contributors == (2, 2, 0)
    assert results[0].averaged.covered == ((0, 2 * n // 3),)
    expected = weighted_average(deltas[:2], weights[:2])
    assert torch.allclose(results[0].averaged.delta[: 2 * n // 3], expected[: 2 * n // 3], atol=1e-6)
    assert not results[0].averaged.delta[2 * n // 3 :].any()


def test_a_member_that_accepts_and_never_calls_costs_a_grace_not_the_budget() -> None:
    """Member 2 accepts the group and never starts (a no-show): the others stop waiting for it once
    they are in and `silent_grace` has passed, not at the collect deadline of a 60 s budget; neither
    waits for its part's answer after that."""
    n, timeout_s = 90_000, 60.0
    deltas, weights = random_deltas(3, n, seed=12), [1.0, 2.0, 4.0]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(3) as nodes:
            spec = group([x.member for x in nodes], timeout_s=timeout_s)
            assert await averaging.propose_group(nodes[2].address, spec, 5.0)
            return await allreduce(nodes[:2], spec, deltas[:2], weights[:2])

    results = run(scenario())
    assert_identical(results)
    assert results[0].contributors == (2, 2, 0)
    # Ended by the grace (about a second here), nowhere near the collect deadline (42 s).
    assert all(r.seconds < 0.25 * COLLECT_SHARE * timeout_s for r in results), [r.seconds for r in results]


def test_a_member_that_calls_late_within_the_grace_is_averaged() -> None:
    """Member 2 (hand-driven) calls the reducers a quarter of the grace after the others began: it is still
    averaged into both their parts (its own part, which it never reduces, is not covered)."""
    n, timeout_s = 90_000, 3.0
    deltas, weights = random_deltas(3, n, seed=13), [1.0, 2.0, 3.0]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(3) as nodes:
            spec = group([x.member for x in nodes], timeout_s=timeout_s)
            assert all(node.servicer.expect(spec) for node in nodes)
            late = RawSender(spec, 2, deltas[2], weights[2])

            async def after_a_while(k: int) -> torch.Tensor | None:
                await asyncio.sleep(SILENT_GRACE_MIN_S / 4)  # the lateness under test
                return await late.send(nodes[k].address, k)

            results, *_ = await asyncio.gather(
                allreduce(nodes[:2], spec, deltas[:2], weights[:2]), after_a_while(0), after_a_while(1)
            )
            return results

    results = run(scenario())
    assert_identical(results)
    assert results[0].contributors == (3, 3, 0)
    spec = group([Member("01", "h:1"), Member("02", "h:1"), Member("03", "h:1")])
    got, p0 = results[0].averaged.delta, part(spec, 0, n)
    assert torch.allclose(got[p0], weighted_average(deltas, weights)[p0], atol=1e-6)


def test_an_unreachable_member_ends_waiting_at_once() -> None:
    n, timeout_s = 90_000, 20.0
    deltas, weights = random_deltas(3, n, seed=3), [1.0, 1.0, 1.0]

    async def scenario() -> tuple[list[AllReduceResult], float]:
        async with swarm(2) as nodes:
            dead = Member("0f", f"{LOCALHOST}:{free_port()}")
            spec = group([nodes[0].member, nodes[1].member, dead], timeout_s=timeout_s)
            started = time.monotonic()
            results = await allreduce(nodes, spec, deltas[:2], weights[:2])
            return results, time.monotonic() - started

    results, seconds = run(scenario())
    assert seconds < 3.0
    assert_identical(results)
    assert results[0].contributors == (2, 2, 0)


def test_a_sender_whose_stream_breaks_is_left_out_of_that_part() -> None:
    """Member 2 is a hand-driven client: it delivers part 0 whole, breaks off half-way through part 1,
    and its own server never starts the all-reduce."""
    n, timeout_s = 3 * 2**20, 3.0
    deltas, weights = random_deltas(3, n, seed=4), [1.0, 2.0, 3.0]

    async def scenario() -> tuple[list[AllReduceResult], torch.Tensor | None]:
        async with swarm(3) as nodes:
            spec = group([x.member for x in nodes], timeout_s=timeout_s)
            assert all(node.servicer.expect(spec) for node in nodes)
            breaker = RawSender(spec, 2, deltas[2], weights[2])
            members = allreduce(nodes[:2], spec, deltas[:2], weights[:2])
            results, part0, _ = await asyncio.gather(
                members, breaker.send(nodes[0].address, 0), breaker.send(nodes[1].address, 1, stop_at=0.5)
            )
            return results, part0

    results, part0 = run(scenario())
    assert_identical(results)
    assert results[0].contributors == (3, 2, 0)
    assert results[0].included == (frozenset({0, 1, 2}), frozenset({0, 1}), frozenset())
    assert results[0].delivered == {0, 1}  # member 2's batches are not wholly in the outer step
    spec = group([Member("01", "h:1"), Member("02", "h:1"), Member("03", "h:1")])
    got = results[0].averaged.delta
    p0, p1 = part(spec, 0, n), part(spec, 1, n)
    assert torch.allclose(got[p0], weighted_average(deltas, weights)[p0], atol=1e-6)
    assert torch.allclose(got[p1], weighted_average(deltas[:2], weights[:2])[p1], atol=1e-6)
    assert part0 is not None and torch.equal(part0, got[p0])  # the whole sender got its part's average


def test_a_late_sender_is_left_out_but_still_gets_the_average() -> None:
    """Member 2 (hand-driven) delivers part 1 whole but stalls half-way through part 0: reducer 0
    averages without it at its collect deadline and answers it all the same."""
    n, timeout_s = 3 * 2**20, 2.0
    deltas, weights = random_deltas(3, n, seed=6), [1.0, 2.0, 3.0]

    async def scenario() -> tuple[list[AllReduceResult], torch.Tensor | None, float]:
        async with swarm(3) as nodes:
            spec = group([x.member for x in nodes], timeout_s=timeout_s)
            assert all(node.servicer.expect(spec) for node in nodes)
            late = RawSender(spec, 2, deltas[2], weights[2])
            started = time.monotonic()
            results, part0, _ = await asyncio.gather(
                allreduce(nodes[:2], spec, deltas[:2], weights[:2]),
                late.send(nodes[0].address, 0, stop_at=0.5, stall=True),
                late.send(nodes[1].address, 1),
            )
            return results, part0, time.monotonic() - started

    results, part0, seconds = run(scenario())
    assert seconds < timeout_s + 1.0
    assert_identical(results)
    assert results[0].contributors == (2, 3, 0)
    assert results[0].delivered == {0, 1}
    assert all(r.averaged.carried == () for r in results)  # the survivors' own Δs are in every part
    spec = group([Member("01", "h:1"), Member("02", "h:1"), Member("03", "h:1")])
    got = results[0].averaged.delta
    p0, p1 = part(spec, 0, n), part(spec, 1, n)
    assert torch.allclose(got[p0], weighted_average(deltas[:2], weights[:2])[p0], atol=1e-6)
    assert torch.allclose(got[p1], weighted_average(deltas, weights)[p1], atol=1e-6)
    assert part0 is not None and torch.equal(part0, got[p0])


class RawSender:
    """A member's sending side driven by hand through the wire protocol."""

    def __init__(self, spec: GroupSpec, me: int, delta: torch.Tensor, weight: float) -> None:
        self.spec, self.me, self.delta, self.weight = spec, me, delta, weight

    def header(self, k: int, **changes: object) -> pb.ContributionHeader:
        n = self.delta.numel()
        lo, hi = self.spec.part_range(k, n)
        fields: dict[str, Any] = dict(
            group_id=self.spec.group_id,
            run_id=self.spec.run_id,
            round=self.spec.round,
            sender=self.me,
            node_id=self.spec.members[self.me].node_id,
            part=k,
            weight=self.weight,
            wire_dtype=self.spec.wire_dtype,
            total_elements=n,
            part_elements=hi - lo,
        )
        return pb.ContributionHeader(**{**fields, **changes})

    async def send(
        self,
        address: str,
        k: int,
        stop_at: float = 1.0,
        messages: Sequence[object] | None = None,
        stall: bool = False,
    ) -> torch.Tensor | None:
        """Streams part k up to the fraction `stop_at`, then breaks the call (or with `stall`, keeps it
        open without sending more); returns the averaged part if the reducer sends it back."""
        image = codecs.encode(self.delta[slice(*self.spec.part_range(k, self.delta.numel()))], "fp32")
        if messages is None:
            stop = int(len(image) * stop_at)
            messages = [pb.Contribution(header=self.header(k))] + [
                pb.Contribution(offset=o, data=bytes(image[o : min(o + rpc.CHUNK_BYTES, stop)]))
                for o in range(0, stop, rpc.CHUNK_BYTES)
            ]
        async with rpc.open_channel(address) as channel:
            call = channel.stream_stream(
                averaging.EXCHANGE_METHOD,
                request_serializer=pb.Contribution.SerializeToString,
                response_deserializer=pb.AveragedPart.FromString,
            )()
            for message in messages:
                await call.write(message)
            if stop_at < 1.0 and not stall:
                call.cancel()
                return None
            if not stall:
                await call.done_writing()
            return await self.read_result(call, k)

    async def read_result(self, call: grpc.aio.StreamStreamCall, k: int) -> torch.Tensor | None:
        replies = [reply async for reply in call]
        data = b"".join(r.data for r in replies[1:])
        lo, hi = self.spec.part_range(k, self.delta.numel())
        return codecs.decode(data, self.spec.wire_dtype, hi - lo) if replies[0].header.contributors else None


def test_malformed_calls_are_refused_and_the_node_carries_on() -> None:
    n = 5000

    async def scenario() -> tuple[list[grpc.StatusCode | None], list[AllReduceResult]]:
        async with swarm(2) as nodes:
            spec = group([x.member for x in nodes], timeout_s=5.0)
            assert nodes[0].servicer.expect(spec)
            raw = RawSender(spec, 1, torch.ones(n), 1.0)
            head = pb.Contribution
            codes = [
                await refusal(raw, nodes[0].address, m)
                for m in [
                    [head(header=raw.header(0, group_id="nope"))],
                    [head(offset=0, data=b"1234")],
                    [head(header=raw.header(0, part=1))],
                    [head(header=raw.header(0, sender=0, node_id="01"))],
                    [head(header=raw.header(0, weight=float("nan")))],
                    [head(header=raw.header(0, wire_dtype="fp64"))],
                ]
            ]
            deltas = random_deltas(2, n)
            results = await allreduce(nodes, spec, deltas, [1.0, 1.0])
            return codes, results

    codes, results = run(scenario())
    assert codes == [grpc.StatusCode.FAILED_PRECONDITION] + [grpc.StatusCode.INVALID_ARGUMENT] * 5
    assert results[0].averaged.coverage == 1.0
    assert_identical(results)


def test_a_contribution_heavier_than_its_member_offered_is_refused_and_left_out() -> None:
    """A member that offered 2,560 tokens for the round (the group says so) and then calls with a
    weight of 1e6 is refused and counted; the reducer averages without it. The call carries the header
    alone: the weight is refused there, and grpc.aio reports a refusal that crosses a data write still
    in flight as INTERNAL, not the reducer's code (grpc/grpc#36066), which the sender's own retry rule
    allows for (`allreduce.FIRST_CONNECT_RETRY_S`)."""
    n = 5000

    async def scenario() -> tuple[grpc.StatusCode | None, AllReduceResult, list[str], GroupSpec]:
        rejected: list[str] = []
        nodes = [await start_node(f"{i + 1:02x}", on_rejected=rejected.append) for i in range(2)]
        try:
            spec = group([dataclasses.replace(x.member, weight=2560.0) for x in nodes], timeout_s=2.0)
            assert nodes[0].servicer.expect(spec)
            runner = asyncio.create_task(
                averaging.butterfly_allreduce(nodes[0].servicer, spec, 0, torch.ones(n), 2560.0)
            )
            heavy = RawSender(spec, 1, torch.full((n,), -4.0), 1e6)
            code = await refusal(heavy, nodes[0].address, [pb.Contribution(header=heavy.header(0))])
            return code, await runner, rejected, spec
        finally:
            for node in nodes:
                await node.stop()

    code, result, rejected, spec = run(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and rejected == ["over_weight"]
    assert result.contributors[0] == 1  # its own part: only itself
    assert torch.equal(result.averaged.delta[part(spec, 0, n)], torch.ones(n)[part(spec, 0, n)])


def test_misplaced_oversized_or_repeated_parts_are_refused() -> None:
    n = 5000
    cases: list[Callable[[RawSender], list[pb.Contribution]]] = [
        lambda raw: [pb.Contribution(header=raw.header(0)), pb.Contribution(offset=4, data=b"\0" * 8)],
        lambda raw: [pb.Contribution(header=raw.header(0)), pb.Contribution(offset=0, data=b"\0" * 4 * n)],
        lambda raw: [pb.Contribution(header=raw.header(0, total_elements=n + 2))],
    ]

    async def scenario() -> list[grpc.StatusCode | None]:
        async with swarm(2) as nodes:
            codes: list[grpc.StatusCode | None] = []
            for i, case in enumerate(cases):
                spec = group([x.member for x in nodes], timeout_s=1.0, group_id=f"g{i}")
                raw = RawSender(spec, 1, torch.ones(n), 1.0)
                assert nodes[0].servicer.expect(spec)
                runner = asyncio.create_task(
                    averaging.butterfly_allreduce(nodes[0].servicer, spec, 0, torch.ones(n), 1.0)
                )
                codes.append(await refusal(raw, nodes[0].address, case(raw)))
                if i == 0:  # the same sender again
                    codes.append(
                        await refusal(raw, nodes[0].address, [pb.Contribution(header=raw.header(0))])
                    )
                result = await runner
                assert result.contributors == (1, 0)  # node 1 never started; node 0 averaged itself
            return codes

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert run(scenario()) == [invalid, grpc.StatusCode.ALREADY_EXISTS, invalid, invalid]


async def refusal(
    sender: RawSender, address: str, messages: Sequence[object] | None
) -> grpc.StatusCode | None:
    """The status the reducer ended the call with (None if it answered); `messages` None: a whole part."""
    try:
        await sender.send(address, 0, messages=messages)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


# ---------------------------------------------------------------------------------------------------
# A member process killed in the middle of the all-reduce


def test_a_member_killed_while_sending_leaves_survivors_in_agreement(tmp_path: Path) -> None:
    n, timeout_s = 2_000_003, 20.0
    deltas, weights = random_deltas(3, n, seed=5), [1.0, 2.0, 3.0]
    env = {**os.environ, "SWARMNODE_FAULTS": "kill@allreduce_send#2", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "victim.log", "wb") as log:
        victim = subprocess.Popen(
            [sys.executable, __file__, "member", "03", str(n), "5", str(weights[2])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            start_new_session=True,
        )
    try:
        port = int(read_line(victim, 30.0))

        async def scenario() -> tuple[list[AllReduceResult], float]:
            async with swarm(2) as nodes:
                spec = group(
                    [nodes[0].member, nodes[1].member, Member("03", f"{LOCALHOST}:{port}")],
                    timeout_s=timeout_s,
                )
                for node in nodes:
                    assert node.servicer.expect(spec)
                assert victim.stdin is not None
                victim.stdin.write(spec.to_json() + "\n")
                victim.stdin.flush()
                # It must be calling before the survivors begin: one that comes a grace after they are
                # in is given up as silent (a busy machine can take that long to start it), and it would
                # not die sending. (It may die before its second call is made: one is enough.)
                await called_by(nodes, spec, 2)
                started = time.monotonic()
                results = await allreduce(nodes, spec, deltas[:2], weights[:2])
                return results, time.monotonic() - started

        results, seconds = run(scenario())
        assert victim.wait(10) == -signal.SIGKILL, (tmp_path / "victim.log").read_text()
    finally:
        victim.kill()
        victim.wait(10)
    assert seconds < timeout_s / 2
    assert_identical(results)
    assert results[0].averaged.coverage < 1 and results[0].contributors[2] == 0
    spec = group([Member("01", "h:1"), Member("02", "h:1"), Member("03", "h:1")])
    for k in (0, 1):  # each survivor's part averages either all three or just the survivors
        got = results[0].averaged.delta[part(spec, k, n)]
        candidates = {3: weighted_average(deltas, weights), 2: weighted_average(deltas[:2], weights[:2])}
        assert torch.allclose(got, candidates[results[0].contributors[k]][part(spec, k, n)], atol=1e-6)


async def called_by(nodes: Sequence[Node], spec: GroupSpec, sender: int, timeout_s: float = 60.0) -> None:
    """Waits until a call of member `sender` reached one of the nodes (held there until its all-reduce
    begins)."""
    async with asyncio.timeout(timeout_s):
        while not any(sender in node.servicer._rounds[spec.group_id].seen for node in nodes):
            await asyncio.sleep(0.01)


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The child's next stdout line, or an AssertionError after the deadline (or if it exits)."""
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.append(proc.stdout.readline() if proc.stdout else ""), daemon=True
    )
    reader.start()
    reader.join(timeout_s)
    assert lines and lines[0].strip(), f"child printed nothing in {timeout_s} s (exit {proc.poll()})"
    return lines[0]


def member_main(node_id: str, n: int, seed: int, weight: float) -> None:
    """The victim: serve, print the port, read the group, join the all-reduce (and die in it)."""
    faults.configure(os.environ.get("SWARMNODE_FAULTS"))
    delta = random_deltas(3, n, seed)[2]

    async def serve() -> None:
        node = await start_node(node_id)
        print(node.server.port, flush=True)
        spec = GroupSpec.from_json(await asyncio.to_thread(sys.stdin.readline))
        node.servicer.expect(spec)
        await averaging.butterfly_allreduce(node.servicer, spec, spec.index_of(node_id), delta, weight)
        await node.stop()

    asyncio.run(serve())


if __name__ == "__main__":
    if sys.argv[1:2] == ["member"]:
        member_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))


def test_a_screened_contribution_is_known_to_every_member_as_delivered() -> None:
    """A member whose Δ the norm screen left out delivered it: every member learns that from the
    reducers' answers (so it is no no-show), and its Δ is in no part."""
    deltas, weights = random_deltas(3, 30_000), [1.0, 1.0, 1.0]
    deltas[2] = deltas[2] * 1000

    async def scenario() -> list[AllReduceResult]:
        async with swarm(3) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes]), deltas, weights)

    results = run(scenario())
    for result in results:
        assert result.screened == {2}
        assert all(members == {0, 1} for members in result.included)
    assert torch.allclose(results[0].averaged.delta, weighted_average(deltas[:2], weights[:2]), atol=1e-6)
