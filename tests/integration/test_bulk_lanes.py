"""The all-reduce's bulk lanes (swarmnode.net.bulk) on loopback: parts and averages travel on them
with the same results as over gRPC, a lane that cannot be dialled falls back to gRPC, a connection
without a pending ticket is closed, a sender whose lane breaks is left out of that part, and a signed
chunk altered on a lane is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_allreduce import (
    LOCALHOST,
    RawSender,
    allreduce,
    assert_identical,
    group,
    part,
    random_deltas,
    run,
    start_node,
    swarm,
    weighted_average,
)

from swarmnode.bench.procs import free_port
from swarmnode.net import bulk, rpc
from swarmnode.net.identity import Identity
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging import codecs, wire
from swarmnode.swarm.averaging.allreduce import butterfly_allreduce
from swarmnode.swarm.averaging.trust import AveragingTrust, SenderProof
from swarmnode.swarm.averaging.wire import GroupSpec, Member

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def fresh_dial_memory() -> Iterator[None]:
    """Each test dials its lanes afresh (a refused port is remembered for minutes, and ports recur)."""
    bulk._unreachable.clear()
    yield
    bulk._unreachable.clear()


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_parts_and_averages_on_the_lanes_equal_those_over_grpc(wire_dtype: str) -> None:
    n = 3 * 2**20 + 5  # several chunks per part, and parts of unequal length
    deltas, weights = random_deltas(4, n, seed=11), [1.0, 2.0, 3.0, 4.0]

    async def scenario(lanes: bool) -> tuple[list, list[int]]:
        async with swarm(4, lanes=lanes) as nodes:
            spec = group([x.member for x in nodes], wire_dtype, group_id=f"lanes-{lanes}")
            assert all(node.servicer.expect(spec) for node in nodes)
            results = await allreduce(nodes, spec, deltas, weights)
            return results, [node.lanes.connections if node.lanes else 0 for node in nodes]

    on_lanes, connections = run(scenario(True))
    over_grpc, none = run(scenario(False))
    assert connections == [3, 3, 3, 3]  # every other member moved its part to each reducer's lane
    assert none == [0, 0, 0, 0]
    assert_identical(on_lanes)
    assert torch.equal(on_lanes[0].averaged.delta, over_grpc[0].averaged.delta)
    assert [r.bytes_sent for r in on_lanes] == [r.bytes_sent for r in over_grpc]
    assert on_lanes[0].averaged.coverage == 1.0
    if wire_dtype == "fp32":
        assert torch.allclose(on_lanes[0].averaged.delta, weighted_average(deltas, weights), atol=1e-6)


def test_a_lane_that_cannot_be_dialled_falls_back_to_grpc() -> None:
    """Reducer 0 offers a port nothing listens on (a lane not forwarded through a NAT): its callers
    send over gRPC, the others' lanes still carry theirs, and every member agrees."""
    n = 2**20 + 3
    deltas, weights = random_deltas(3, n, seed=12), [1.0, 1.0, 2.0]

    async def scenario() -> tuple[list, list[int]]:
        async with swarm(3) as nodes:
            assert nodes[0].lanes is not None
            nodes[0].lanes.port = free_port()
            spec = group([x.member for x in nodes])
            assert all(node.servicer.expect(spec) for node in nodes)
            results = await allreduce(nodes, spec, deltas, weights)
            return results, [node.lanes.connections if node.lanes else -1 for node in nodes]

    results, connections = run(scenario())
    assert connections == [0, 2, 2]
    assert_identical(results)
    assert results[0].averaged.coverage == 1.0
    assert torch.allclose(results[0].averaged.delta, weighted_average(deltas, weights), atol=1e-6)
    assert len(bulk._unreachable) == 1  # remembered: the next round goes to gRPC at once


def test_a_lane_the_reducer_does_not_take_leaves_the_part_on_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reducer's listener turns connections away (as when strangers hold all its admission
    slots): the senders get no ACK, keep their parts on gRPC, and lose nothing; nothing is remembered
    as unreachable (the next round tries the lanes again)."""
    monkeypatch.setattr(bulk, "MAX_ADMITTING", 0)
    n = 2**20 + 3
    deltas, weights = random_deltas(3, n, seed=17), [1.0, 2.0, 3.0]

    async def scenario() -> tuple[list, list[int]]:
        async with swarm(3) as nodes:
            spec = group([x.member for x in nodes], timeout_s=20.0)
            assert all(node.servicer.expect(spec) for node in nodes)
            results = await allreduce(nodes, spec, deltas, weights)
            return results, [node.lanes.connections if node.lanes else -1 for node in nodes]

    results, connections = run(scenario())
    assert connections == [0, 0, 0]
    assert_identical(results)
    assert results[0].averaged.coverage == 1.0
    assert max(r.seconds for r in results) < 5.0  # nobody waited for a lane that never came
    assert torch.allclose(results[0].averaged.delta, weighted_average(deltas, weights), atol=1e-6)
    assert bulk._unreachable == {}


def test_a_connection_without_a_pending_ticket_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "TICKET_TIMEOUT_S", 0.3)

    async def scenario() -> tuple[bytes, bytes, int]:
        listener = bulk.BulkListener()
        port = await listener.start(LOCALHOST)
        offered = listener.offer()
        assert offered is not None
        try:
            wrong = await _closed_after(port, bytes(bulk.TICKET_BYTES))
            silent = await _closed_after(port, b"")
            return wrong, silent, listener.connections
        finally:
            listener.release(*offered)
            await listener.close()

    wrong, silent, connections = run(scenario())
    assert wrong == b"" and silent == b""  # both closed by the listener, nothing sent back
    assert connections == 0


async def _closed_after(port: int, sent: bytes) -> bytes:
    """Connects, sends `sent`, and reads until the listener closes the connection (fails after 5 s)."""
    reader, writer = await asyncio.open_connection(LOCALHOST, port)
    try:
        writer.write(sent)
        await writer.drain()
        async with asyncio.timeout(5.0):
            return await reader.read()
    finally:
        writer.close()


class LaneSender(RawSender):
    """A member's sending side on a bulk lane, driven by hand: header on the call, part on the lane."""

    async def send_on_lane(
        self,
        address: str,
        k: int,
        stop_at: float = 1.0,
        alter: bool = False,
        trust: AveragingTrust | None = None,
        stall: bool = False,
    ) -> torch.Tensor | None:
        """Sends part k's image on the reducer's lane up to `stop_at`, then closes the lane (with
        `stall`: keeps it open, sends no more, and waits for the average); `alter` flips a byte of
        the first chunk after signing it. Returns the part's average if it comes."""
        image = bytearray(codecs.encode(self.delta[part(self.spec, k, self.delta.numel())], "fp32"))
        header = self.header(k)
        signatures: list[bytes] = []
        if trust is not None:
            header = trust.sign_header(header)
            signatures = trust.sign_chunks(self.spec, k, wire.chunks(memoryview(image)))
        if alter:
            image[10] ^= 0xFF
        async with rpc.open_channel(address) as channel:
            call = channel.stream_stream(
                wire.EXCHANGE_METHOD,
                request_serializer=rpc.serialize,
                response_deserializer=pb.AveragedPart.FromString,
            )()
            await call.write(pb.Contribution(header=header))
            offer = bulk.parse_offer(tuple(await call.initial_metadata()))
            assert offer is not None, "the reducer offered no lane"
            lane = await bulk.dial(LOCALHOST, *offer)
            assert lane is not None
            try:
                await call.write(wire.BULK_MARKER)
                stop = int(len(image) * stop_at)
                try:
                    for index, offset in enumerate(range(0, stop, rpc.CHUNK_BYTES)):
                        await bulk.send(lane, memoryview(image)[offset : min(offset + rpc.CHUNK_BYTES, stop)])
                        if signatures:
                            await bulk.send(lane, signatures[index])
                except OSError:  # the reducer refused the part and closed the lane
                    return None
                if stop_at < 1.0 and not stall:
                    return None
                # the answer on the lane: its header's length (4 bytes, little-endian), the header, the image
                try:
                    length = bytearray(wire.LANE_HEADER_PREFIX)
                    await bulk.receive_into(lane, memoryview(length))
                    raw = bytearray(int.from_bytes(length, "little"))
                    await bulk.receive_into(lane, memoryview(raw))
                    header = pb.AveragedHeader.FromString(bytes(raw))
                    if not header.bulk or not header.contributors:
                        return None
                    lo, hi = self.spec.part_range(k, self.delta.numel())
                    result = bytearray(codecs.encoded_size("fp32", hi - lo))
                    await bulk.receive_into(lane, memoryview(result))
                except ConnectionError:  # refused: the reducer closed the lane without an answer
                    return None
                return codecs.decode(result, "fp32", hi - lo)
            finally:
                lane.close()
                call.cancel()


async def with_a_client_sender(
    timeout_s: float, deltas: list[torch.Tensor], weights: list[float], sends: Any
) -> tuple[GroupSpec, list, torch.Tensor | None]:
    """Two nodes average with member 2, a hand-driven client member (it reduces nothing) whose two
    sends `sends(sender, nodes)` gives; returns the group, the nodes' results and the first send's."""
    async with swarm(2) as nodes:
        members = [nodes[0].member, nodes[1].member, Member("03", "", reachable=False)]
        spec = group(members, timeout_s=timeout_s)
        assert all(node.servicer.expect(spec) for node in nodes)
        sender = LaneSender(spec, 2, deltas[2], weights[2])
        results, part0, _ = await asyncio.gather(
            allreduce(nodes, spec, deltas[:2], weights[:2]), *sends(sender, nodes)
        )
        return spec, results, part0


def test_a_sender_whose_lane_breaks_is_left_out_of_that_part_at_once() -> None:
    """Member 2 (hand-driven, a client member: it reduces nothing) delivers part 0 whole on reducer
    0's lane and closes reducer 1's lane half-way: reducer 1 stops waiting for it then, not at its
    collect deadline, and everyone agrees."""
    n, timeout_s = 3 * 2**20, 8.0
    deltas, weights = random_deltas(3, n, seed=13), [1.0, 2.0, 3.0]

    spec, results, part0 = run(
        with_a_client_sender(
            timeout_s,
            deltas,
            weights,
            lambda sender, nodes: (
                sender.send_on_lane(nodes[0].address, 0),
                sender.send_on_lane(nodes[1].address, 1, stop_at=0.5),
            ),
        )
    )
    assert max(r.seconds for r in results) < timeout_s / 4  # member 2's broken lane ended the wait
    assert_identical(results)
    assert results[0].included == (frozenset({0, 1, 2}), frozenset({0, 1}), frozenset())
    got = results[0].averaged.delta
    p0, p1 = part(spec, 0, n), part(spec, 1, n)
    assert torch.allclose(got[p0], weighted_average(deltas, weights)[p0], atol=1e-6)
    assert torch.allclose(got[p1], weighted_average(deltas[:2], weights[:2])[p1], atol=1e-6)
    assert part0 is not None and torch.equal(part0, got[p0])  # its average came back on the lane


def test_a_signed_chunk_altered_on_a_lane_is_refused() -> None:
    """Signed members (a token-only swarm): a whole signed all-reduce runs on the lanes; a chunk whose
    bytes changed after signing is refused as a bad signature and left out of the part."""
    n = 3 * 2**20
    identities = [Identity.generate() for _ in range(3)]
    trusts = [AveragingTrust(SenderProof.SIGNATURE, identity) for identity in identities]
    deltas, weights = random_deltas(3, n, seed=14), [1.0, 1.0, 1.0]

    async def scenario() -> tuple[list, list[str], list[int]]:
        rejected: list[str] = []
        nodes = [
            await start_node(identity.node_id_hex, trust=trust, on_rejected=rejected.append)
            for identity, trust in zip(identities, trusts, strict=True)
        ]
        try:
            spec = GroupSpec("run", 0, "signed-lanes", tuple(x.member for x in nodes), "fp32", 5.0)
            assert all(node.servicer.expect(spec) for node in nodes)
            signed = await allreduce(nodes, spec, deltas, weights)
            connections = [node.lanes.connections if node.lanes else 0 for node in nodes]
            spec = GroupSpec("run", 1, "altered-lanes", spec.members, "fp32", 3.0)
            assert all(node.servicer.expect(spec) for node in nodes[:2])
            forger = LaneSender(spec, 2, deltas[2], 1.0)
            results, _ = await asyncio.gather(
                allreduce(nodes[:2], spec, deltas[:2], weights[:2]),
                forger.send_on_lane(nodes[0].address, 0, alter=True, trust=trusts[2]),
            )
            return [signed, results], rejected, connections
        finally:
            for node in nodes:
                await node.stop()

    (signed, altered), rejected, connections = run(scenario())
    assert connections == [2, 2, 2]
    assert_identical(signed)
    assert torch.allclose(signed[0].averaged.delta, weighted_average(deltas, weights), atol=1e-6)
    assert rejected == ["bad_signature"]
    assert 2 not in altered[0].included[0]
    assert_identical(altered)


def test_parse_offer_takes_only_a_port_and_a_whole_ticket() -> None:
    ticket = bytes(range(16))
    assert bulk.parse_offer((bulk.offer_metadata(4242, ticket),)) == (4242, ticket)
    assert bulk.parse_offer((("swarmnode-admitted", "1"), bulk.offer_metadata(1, ticket))) == (1, ticket)
    for bad in ("4242", "0." + ticket.hex(), "70000." + ticket.hex(), "42." + ticket.hex()[:-2], "42.zz" * 8):
        assert bulk.parse_offer(((bulk.METADATA_KEY, bad),)) is None
    assert bulk.parse_offer(()) is None


def test_a_released_ticket_closes_the_connection_that_presented_it() -> None:
    async def scenario() -> bytes:
        listener = bulk.BulkListener()
        port = await listener.start(LOCALHOST)
        offered = listener.offer()
        assert offered is not None
        lane = await bulk.dial(LOCALHOST, port, offered[0])
        assert lane is not None
        try:
            async with asyncio.timeout(5.0):
                await offered[1]
            listener.release(*offered)
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(5.0):
                return await loop.sock_recv(lane, 1)
        finally:
            lane.close()
            await listener.close()

    assert run(scenario()) == b""


def test_the_average_lands_in_the_callers_buffer_round_after_round() -> None:
    """`out`: each member's average is written into its own buffer, the same one every round, with the
    same values as into fresh memory; the reducers' receive buffers come back and are reused."""
    n = 2 * 2**20 + 1
    deltas, weights = random_deltas(3, n, seed=15), [1.0, 2.0, 3.0]

    async def scenario() -> tuple[list, list, list[torch.Tensor], list[int]]:
        async with swarm(3) as nodes:
            outs = [torch.full((n,), float("nan")) for _ in nodes]
            rounds = []
            for r in range(2):
                spec = group([x.member for x in nodes], "bf16", group_id=f"out-{r}")
                assert all(node.servicer.expect(spec) for node in nodes)
                rounds.append(
                    await asyncio.gather(
                        *(
                            butterfly_allreduce(node.servicer, spec, i, deltas[i], weights[i], out=outs[i])
                            for i, node in enumerate(nodes)
                        )
                    )
                )
            spec = group([x.member for x in nodes], "bf16", group_id="fresh")
            assert all(node.servicer.expect(spec) for node in nodes)
            fresh = await allreduce(nodes, spec, deltas, weights)
            return rounds, fresh, outs, [node.servicer.spares.held for node in nodes]

    rounds, fresh, outs, held = run(scenario())
    for results in rounds:
        assert_identical(results)
        for result, out in zip(results, outs, strict=True):
            assert result.averaged.delta.data_ptr() == out.data_ptr()
            assert torch.equal(result.averaged.delta, fresh[0].averaged.delta)
    assert all(count > 0 for count in held)  # the rounds' buffers came back


def test_out_must_be_a_separate_fp32_buffer_of_the_same_size() -> None:
    async def scenario() -> list[str]:
        async with swarm(2) as nodes:
            spec = group([x.member for x in nodes])
            delta = torch.zeros(10)
            errors = []
            for out in (delta, torch.zeros(9), torch.zeros(10, dtype=torch.float64)):
                with pytest.raises(ValueError) as caught:
                    await butterfly_allreduce(nodes[0].servicer, spec, 0, delta, 1.0, out=out)
                errors.append(str(caught.value))
            return errors

    errors = run(scenario())
    assert "not be the pseudo-gradient itself" in errors[0]
    assert all("shape" in error for error in errors[1:])


def test_a_late_sender_on_a_lane_is_left_out_but_still_gets_the_average() -> None:
    """Member 2 (hand-driven, a client member) delivers part 1 whole but stalls half-way through part
    0 with its lane open: reducer 0 averages without it at its collect deadline and answers it on that
    lane all the same."""
    n, timeout_s = 3 * 2**20, 2.0
    deltas, weights = random_deltas(3, n, seed=16), [1.0, 2.0, 3.0]

    spec, results, part0 = run(
        with_a_client_sender(
            timeout_s,
            deltas,
            weights,
            lambda late, nodes: (
                late.send_on_lane(nodes[0].address, 0, stop_at=0.5, stall=True),
                late.send_on_lane(nodes[1].address, 1),
            ),
        )
    )
    assert_identical(results)
    assert results[0].included == (frozenset({0, 1}), frozenset({0, 1, 2}), frozenset())
    got = results[0].averaged.delta
    p0, p1 = part(spec, 0, n), part(spec, 1, n)
    assert torch.allclose(got[p0], weighted_average(deltas[:2], weights[:2])[p0], atol=1e-6)
    assert torch.allclose(got[p1], weighted_average(deltas, weights)[p1], atol=1e-6)
    assert part0 is not None and torch.equal(part0, got[p0])
