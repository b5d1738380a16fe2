"""The top-k wire over real gRPC on loopback: each reducer relays its part's contributions and every
member aggregates them itself (swarmnode.swarm.averaging.allreduce, `_aggregate_relay`)."""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest
import torch
from test_allreduce import (
    RawSender,
    allreduce,
    assert_identical,
    group,
    part,
    random_deltas,
    refusal,
    run,
    start_node,
    swarm,
    weighted_average,
)

from swarmnode.core import sparse
from swarmnode.net import rpc
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging import allreduce as averaging
from swarmnode.swarm.averaging import codecs

pytestmark = pytest.mark.timeout(90)
K = 41
WIRE = sparse.wire_name(K)


def compressed(deltas: list[torch.Tensor]) -> list[torch.Tensor]:
    return [sparse.compress(d, K) for d in deltas]


@pytest.mark.parametrize(("size", "lanes"), [(3, True), (4, False)])
def test_every_member_holds_the_weighted_mean_of_the_compressed_deltas(size: int, lanes: bool) -> None:
    n = 50_000
    deltas = compressed(random_deltas(size, n))
    weights = [1.0 + k for k in range(size)]

    async def scenario() -> list[averaging.AllReduceResult]:
        async with swarm(size, lanes=lanes) as nodes:
            spec = group([x.member for x in nodes], WIRE)
            return await allreduce(nodes, spec, deltas, weights)

    results = run(scenario())
    assert_identical(results)
    assert results[0].averaged.coverage == 1.0
    assert all(r.delivered == frozenset(range(size)) for r in results)
    assert torch.allclose(results[0].averaged.delta, weighted_average(deltas, weights), atol=1e-6)
    spec = group(_members(size), WIRE)
    assert all(spec.part_range(k, n)[0] % sparse.CHUNK == 0 for k in range(size))  # whole chunks


def _members(size: int) -> list[averaging.wire.Member]:
    return [averaging.wire.Member(f"{i + 1:02x}", "h:1") for i in range(size)]


def test_bytes_sent_per_member_are_the_all_gathers() -> None:
    """Each member sends its parts ((N − 1)/N of its image), then as a reducer, to each of the N − 1
    callers, the N − 1 other contributions to its part, each with its weight: (N − 1) images in all."""
    n, size = 200_000, 4
    deltas = compressed(random_deltas(size, n, seed=3))

    async def scenario() -> list[averaging.AllReduceResult]:
        async with swarm(size) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes], WIRE), deltas, [1.0] * size)

    results = run(scenario())
    spec = group(_members(size), WIRE)
    for me, result in enumerate(results):
        sizes = [codecs.encoded_size(WIRE, len(range(*spec.part_range(k, n)))) for k in range(size)]
        relayed = (size - 1) * (size - 1) * (sizes[me] + 8)  # to each caller: the N − 1 others' images
        expected = sum(s for k, s in enumerate(sizes) if k != me) + relayed
        assert result.bytes_sent == expected


def test_a_member_left_out_of_a_part_has_it_carried() -> None:
    """A contribution that never arrives at reducer 0 is in nobody's part 0: every member agrees, and
    its sender's Δ is carried there (its error feedback keeps it)."""
    n = 30_000
    deltas = compressed(random_deltas(3, n, seed=5))

    async def scenario() -> list[averaging.AllReduceResult]:
        async with swarm(3) as nodes:
            spec = group([x.member for x in nodes], WIRE, timeout_s=3.0)
            for node in nodes:
                assert node.servicer.expect(spec)
            late = RawSender(spec, 2, deltas[2], 1.0)
            results = await asyncio.gather(
                allreduce(nodes[:2], spec, deltas[:2], [1.0, 1.0]),
                _sparse_send(late, nodes[1].address, 1),
            )
            return results[0]

    results = run(scenario())
    assert_identical(results)
    assert results[0].included[0] == frozenset({0, 1})
    assert results[0].included[1] == frozenset({0, 1, 2})


async def _sparse_send(sender: RawSender, address: str, k: int, image: bytes | None = None) -> None:
    """Streams a top-k part k (or `image`), and reads the reply."""
    lo, hi = sender.spec.part_range(k, sender.delta.numel())
    data = bytes(codecs.encode(sender.delta[lo:hi], WIRE)) if image is None else image
    messages = _messages(sender, k, data)
    async with rpc.open_channel(address) as channel:
        call = channel.stream_stream(
            averaging.EXCHANGE_METHOD,
            request_serializer=pb.Contribution.SerializeToString,
            response_deserializer=pb.AveragedPart.FromString,
        )()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        async for _ in call:
            pass


def _broken(image: bytes, how: str, n: int) -> bytes:
    raw = bytearray(image)
    chunks, entries = sparse.chunk_count(n), sparse.entry_count(n, K)
    indices = 4 * chunks + -(-entries // 4)
    if how == "nan_scale":
        raw[0:4] = struct.pack("<f", float("nan"))
    elif how == "duplicate":  # the first two indices of chunk 0 made equal
        a = raw[indices] | ((raw[indices + 1] & 0xF) << 8)
        raw[indices + 1] = (raw[indices + 1] & 0x0F) | ((a & 0xF) << 4)
        raw[indices + 2] = a >> 4
    elif how == "out_of_range":  # the last chunk is short: an index of 4095 lies beyond it
        last = 4 * chunks + -(-entries // 4) + 3 * ((entries - 1) // 2)
        if (entries - 1) % 2 == 0:
            raw[last], raw[last + 1] = 0xFF, (raw[last + 1] & 0xF0) | 0x0F
        else:
            raw[last + 1], raw[last + 2] = (raw[last + 1] & 0x0F) | 0xF0, 0xFF
    return bytes(raw)


@pytest.mark.parametrize("how", ["nan_scale", "duplicate", "out_of_range"])
def test_a_malformed_sparse_contribution_is_refused_and_counted(how: str) -> None:
    n = 2 * 10_000 + 100  # part 0 of two: 8192 values (two whole chunks), part 1 ends short

    async def scenario() -> tuple[grpc.StatusCode | None, averaging.AllReduceResult, list[str]]:
        rejected: list[str] = []
        nodes = [await start_node(f"{i + 1:02x}", on_rejected=rejected.append) for i in range(2)]
        try:
            spec = group([x.member for x in nodes], WIRE, timeout_s=3.0)
            assert nodes[1].servicer.expect(spec)
            delta = sparse.compress(torch.randn(n), K)
            reducing = averaging.butterfly_allreduce(nodes[1].servicer, spec, 1, delta, 1.0)
            runner = asyncio.create_task(reducing)
            raw = RawSender(spec, 0, delta, 1.0)
            lo, hi = spec.part_range(1, n)
            image = _broken(bytes(codecs.encode(delta[lo:hi], WIRE)), how, hi - lo)
            code = await refusal(raw, nodes[1].address, _messages(raw, 1, image))
            return code, await runner, rejected
        finally:
            for node in nodes:
                await node.stop()

    code, result, rejected = run(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and rejected == ["bad_sparse"]
    assert result.included[1] == frozenset({1})  # its own part: only itself


def _messages(sender: RawSender, k: int, image: bytes) -> list[pb.Contribution]:
    return [pb.Contribution(header=sender.header(k, part=k))] + [
        pb.Contribution(offset=o, data=image[o : o + rpc.CHUNK_BYTES])
        for o in range(0, len(image), rpc.CHUNK_BYTES)
    ]


def test_robust_aggregation_bounds_a_flipped_scaled_member_and_keeps_honest_rounds_the_mean() -> None:
    n, size = 40_000, 4
    honest = compressed(random_deltas(size, n, seed=11))
    attacked = [*honest[:3], -7 * honest[3]]

    async def scenario(deltas: list[torch.Tensor]) -> list[averaging.AllReduceResult]:
        async with swarm(size) as nodes:
            return await allreduce(nodes, group([x.member for x in nodes], WIRE), deltas, [1.0] * size)

    clean = run(scenario(honest))
    assert_identical(clean)
    assert torch.allclose(clean[0].averaged.delta, weighted_average(honest, [1.0] * size), atol=1e-6)
    bad = run(scenario(attacked))
    assert_identical(bad)
    mean_honest = weighted_average(honest[:3], [1.0] * 3)
    pull = (bad[0].averaged.delta - mean_honest).norm()
    naive = (weighted_average(attacked, [1.0] * size) - mean_honest).norm()
    assert pull < 0.5 * naive  # its pull is clipped to about the honest norms' scale
    assert (bad[0].averaged.delta.dot(mean_honest)) > 0  # the round still descends


def test_part_ranges_are_whole_chunks_only_with_topk() -> None:
    n = 100_003
    spec = group(_members(3), WIRE)
    ranges = [spec.part_range(k, n) for k in range(3)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(lo % sparse.CHUNK == 0 for lo, _ in ranges)
    assert group(_members(3)).part_range(1, n) == (n // 3, 2 * n // 3)
    assert part(spec, 2, n) == slice(*ranges[2])
