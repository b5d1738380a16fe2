"""Signed all-reduce messages over real gRPC servers on loopback (token-only or open swarms, where the
sender is not known from a client certificate): a signed contribution works end to end, and a captured
one replayed to another node, spliced, altered or sent again is refused."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc
import pytest
import torch
from test_allreduce import start_node

from swarmnode.core import sparse
from swarmnode.net import rpc
from swarmnode.net.identity import Identity
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging import codecs, wire
from swarmnode.swarm.averaging.allreduce import butterfly_allreduce
from swarmnode.swarm.averaging.reducer import AveragingServicer
from swarmnode.swarm.averaging.trust import AveragingTrust, SenderProof
from swarmnode.swarm.averaging.wire import GroupSpec

pytestmark = pytest.mark.timeout(120)
N = 3_000_000  # parts of 1M values: 4 MB fp32 images, 4 chunks each


async def start_members(count: int) -> tuple[list[AveragingServicer], list[Any], GroupSpec, list[str]]:
    """`count` members with their own identities and servers; the list collects every refusal."""
    rejected: list[str] = []
    nodes = []
    for identity in (Identity.generate() for _ in range(count)):
        trust = AveragingTrust(SenderProof.SIGNATURE, identity)
        nodes.append(await start_node(identity.node_id_hex, trust=trust, on_rejected=rejected.append))
    spec = GroupSpec("run", 0, "0-signed", tuple(n.member for n in nodes), "fp32", 20.0)
    return [n.servicer for n in nodes], nodes, spec, rejected


def captured_call(servicer: AveragingServicer, spec: GroupSpec, part: int, delta: torch.Tensor) -> list[Any]:
    """What member `servicer` streams to reducer `part`: its signed header and signed chunks."""
    me = spec.index_of(servicer.node_id)
    header = servicer.trust.sign_header(wire.contribution_header(spec, me, part, 1.0, N))
    image = codecs.encode(delta[slice(*spec.part_range(part, N))], "fp32")
    signatures = servicer.trust.sign_chunks(spec, part, wire.chunks(image))
    chunks = [pb.Contribution.FromString(m) for m, _ in wire.chunk_messages(image, signatures)]
    return [pb.Contribution(header=header), *chunks]


def mid_stream(code: grpc.StatusCode) -> set[grpc.StatusCode]:
    """What a caller sees of a refusal of one of its chunks while it is still writing the next ones: the
    reducer's `code`, or, when the refusal's reset of the stream overtakes its trailers, gRPC's INTERNAL
    (3 of 5 runs here); the reducer's own record of the reason is checked beside it."""
    return {code, grpc.StatusCode.INTERNAL}


async def send(address: str, messages: list[Any]) -> grpc.StatusCode:
    """Streams `messages` as one `Exchange` call; the status it ends with (OK: the reducer answered)."""
    async with rpc.open_channel(address) as channel:
        call = channel.stream_stream(
            wire.EXCHANGE_METHOD,
            request_serializer=rpc.serialize,
            response_deserializer=pb.AveragedPart.FromString,
        )()
        try:
            await call.write(messages[0])
            if wire.ADMITTED[0] in tuple(await call.initial_metadata()):
                for message in messages[1:]:
                    await call.write(message)
                await call.done_writing()
            async with asyncio.timeout(15):
                while await call.read() is not grpc.aio.EOF:
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        except asyncio.InvalidStateError:
            pass
        return await call.code()


@pytest.mark.parametrize("topk", [False, True], ids=["fp32", "topk"])
def test_a_signed_allreduce_averages_every_part(topk: bool) -> None:
    """Token-only swarms sign every chunk, of a top-k part as of any other; each member's result is the
    mean of the deltas (top-k: of the compressed deltas, which is what the wire carries)."""

    async def scenario() -> None:
        servicers, servers, spec, rejected = await start_members(3)
        try:
            n = 300_000 if topk else N
            deltas = [torch.randn(n, generator=torch.Generator().manual_seed(k)) for k in range(3)]
            if topk:
                spec = dataclasses.replace(spec, wire_dtype=sparse.wire_name(41))
                deltas = [sparse.compress(delta, 41) for delta in deltas]
            for servicer in servicers:
                servicer.expect(spec)
            results = await asyncio.gather(
                *(butterfly_allreduce(s, spec, k, deltas[k], 1.0) for k, s in enumerate(servicers))
            )
            expected = (deltas[0] + deltas[1] + deltas[2]) / 3
            for result in results:
                assert result.averaged.coverage == 1.0 and result.delivered == frozenset({0, 1, 2})
                assert torch.allclose(result.averaged.delta, expected, atol=1e-6)
            assert not rejected
        finally:
            await asyncio.gather(*(s.stop() for s in servers))

    asyncio.run(scenario())


def test_a_captured_contribution_is_refused_elsewhere_altered_spliced_or_again() -> None:
    async def scenario() -> None:
        servicers, servers, spec, rejected = await start_members(3)
        try:
            delta = torch.randn(N, generator=torch.Generator().manual_seed(0))
            for k, servicer in enumerate(servicers):
                servicer.expect(spec)
                if k:
                    servicer.begin(spec, k, torch.zeros(N), 1.0)
            to_1 = captured_call(servicers[0], spec, 1, delta)
            to_2 = captured_call(servicers[0], spec, 2, delta)
            # Member 0's call to reducer 1, replayed to reducer 2 (another node, another part).
            assert await send(spec.members[2].address, to_1) == grpc.StatusCode.INVALID_ARGUMENT
            # Its header for reducer 2 with the chunks it signed for reducer 1.
            spliced = [to_2[0], *to_1[1:]]
            assert await send(spec.members[2].address, spliced) in mid_stream(
                grpc.StatusCode.PERMISSION_DENIED
            )
            assert rejected[-1] == "bad_signature", rejected
            # Its call to reducer 1 with one chunk's bytes changed (the signature no longer matches).
            altered = list(to_1)
            changed = pb.Contribution()
            changed.CopyFrom(altered[2])
            changed.data = bytes(len(changed.data))
            altered[2] = changed
            assert await send(spec.members[1].address, altered) in mid_stream(
                grpc.StatusCode.PERMISSION_DENIED
            )
            assert rejected.count("bad_signature") == 2 and "invalid" in rejected, rejected
            # Member 2's call to reducer 1 with a chunk repeated: refused as out of order.
            from_2 = captured_call(servicers[2], spec, 1, delta)
            repeated = [*from_2[:2], from_2[1], *from_2[2:]]
            assert await send(spec.members[1].address, repeated) in mid_stream(
                grpc.StatusCode.INVALID_ARGUMENT
            )
            assert "chunk_order" in rejected, rejected
            # Member 0's captured call to reducer 1 sent again: a second call from that sender.
            assert await send(spec.members[1].address, to_1) == grpc.StatusCode.ALREADY_EXISTS
            assert "duplicate" in rejected
        finally:
            await asyncio.gather(*(s.stop() for s in servers))

    asyncio.run(scenario())
