"""The event loop of a node stays quiet and responsive under routine trouble, over real gRPC on loopback:
a call its client cancels mid-stream ends without an error log on the server (snapshot streams and
averaging exchanges alike), and a sleep fault at a point on the loop pauses only its own task."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
import torch

from swarmnode.net import rpc, snapshot_server
from swarmnode.proto.v1 import averaging_pb2 as pb_avg
from swarmnode.proto.v1 import snapshot_pb2 as pb
from swarmnode.proto.v1 import snapshot_pb2_grpc as pb_grpc
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.swarm.averaging import allreduce as averaging
from swarmnode.swarm.averaging import codecs, wire
from swarmnode.swarm.averaging.reducer import AveragingServicer
from swarmnode.swarm.averaging.wire import GroupSpec, Member
from swarmnode.util import faults

pytestmark = pytest.mark.timeout(90)
LOCALHOST = "127.0.0.1"
MiB = 1 << 20


class NoSnapshots:
    def list_snapshots(self) -> list[SnapshotInfo]:
        return []

    def find(self, snapshot_id: str | None) -> None:
        return None


class OneSnapshot:
    def __init__(self, info: SnapshotInfo) -> None:
        self.info = info

    def list_snapshots(self) -> list[SnapshotInfo]:
        return [self.info]

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        return self.info if snapshot_id in (None, self.info.snapshot_id) else None


def snapshot_file(path: Path, size: int) -> SnapshotInfo:
    path.write_bytes(hashlib.shake_256(b"cancel").digest(size))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return SnapshotInfo(digest, path, size, 1, 10, "hot", 1_700_000_000.0, "planes", "run", "n1")


def status() -> rpc.NodeStatus:
    return rpc.NodeStatus("n1", "run")


async def until_stalled(progress: Callable[[], int], least: int, timeout_s: float = 20.0) -> None:
    """Polls `progress()` until it reached `least` and stopped moving (five polls alike): the server
    is blocked writing to a client that does not read (HTTP/2 flow control)."""
    deadline = time.monotonic() + timeout_s
    seen, same = -1, 0
    while same < 5:
        assert time.monotonic() < deadline, f"the server never stalled (at {progress()})"
        await asyncio.sleep(0.02)
        now = progress()
        same = same + 1 if now == seen and now >= least else 0
        seen = now


def loud_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    gc.collect()  # an async generator or task left behind reports its failure when it is collected
    return [
        f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info
    ]


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 60.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await scenario()

    asyncio.run(bounded())


def test_a_fetch_cancelled_mid_stream_ends_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The client stops reading, the server blocks in a write, the client cancels: routine."""
    caplog.set_level(logging.INFO)
    info = snapshot_file(tmp_path / "s.snap.zst", 32 * MiB)
    chunks_read: list[int] = []

    def count(offset: int, data: bytes) -> bytes:
        chunks_read.append(offset)
        return data

    async def scenario() -> None:
        server = await snapshot_server.start_server(
            LOCALHOST, 0, OneSnapshot(info), status, max_serving=1, faults=rpc.ServeFaults(chunk_filter=count)
        )
        try:
            async with grpc.aio.insecure_channel(f"{LOCALHOST}:{server.port}") as channel:
                stub = pb_grpc.SnapshotServiceStub(channel)
                call = stub.FetchSnapshot(pb.FetchSnapshotRequest())
                assert (await call.read()).HasField("meta")
                await until_stalled(lambda: len(chunks_read), least=snapshot_server.READ_AHEAD_CHUNKS + 2)
                call.cancel()
                await admitted_again(stub)  # the server ended the cancelled stream: its slot is free
        finally:
            await server.stop(1.0)

    run(scenario)
    assert len(chunks_read) < info.size_bytes // rpc.CHUNK_BYTES  # it was cancelled mid-stream
    assert loud_records(caplog) == []


async def admitted_again(stub: pb_grpc.SnapshotServiceStub, timeout_s: float = 20.0) -> None:
    """Polls until a new stream is admitted (the only serving slot is free again)."""
    deadline = time.monotonic() + timeout_s
    while True:
        call = stub.FetchSnapshot(pb.FetchSnapshotRequest())
        try:
            await call.read()
            return
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
        finally:
            call.cancel()
        await asyncio.sleep(0.05)


def test_an_exchange_cancelled_while_its_result_streams_ends_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Member 1 (driven by hand) sends its part to reducer 0, reads the result's header, stops reading
    and cancels while the reducer is blocked writing the result."""
    caplog.set_level(logging.INFO)
    n = 8 * MiB  # part 0: 16 MiB of fp32, far more than the flow-control windows hold

    async def scenario() -> None:
        servicer = AveragingServicer("01")
        server = await snapshot_server.start_server(
            LOCALHOST, 0, NoSnapshots(), status, extra_servicers=[servicer.register]
        )
        try:
            members = (Member("01", f"{LOCALHOST}:{server.port}"), Member("02", f"{LOCALHOST}:1"))
            spec = GroupSpec("run", 7, "g1", members, "fp32", 30.0)
            rnd = servicer.begin(spec, 0, torch.zeros(n), 1.0)
            # Without BDP probing the client's flow-control window stays small: with it, a busy
            # machine can grow the window past the whole 16 MiB result before the cancel.
            options = [*rpc.CLIENT_OPTIONS, ("grpc.http2.bdp_probe", 0)]
            async with grpc.aio.insecure_channel(members[0].address, options=options) as channel:
                call = channel.stream_stream(
                    averaging.EXCHANGE_METHOD,
                    request_serializer=rpc.serialize,
                    response_deserializer=pb_avg.AveragedPart.FromString,
                )()
                await call.write(pb_avg.Contribution(header=wire.contribution_header(spec, 1, 0, 1.0, n)))
                assert tuple(await call.initial_metadata()) == wire.ADMITTED
                for message, _ in wire.chunk_messages(codecs.encode(torch.ones(n // 2), "fp32")):
                    await call.write(message)
                await call.done_writing()
                await rnd.contributions_in(asyncio.get_running_loop().time() + 20)
                averaged = await rnd.reduce("fp32")
                assert averaged.included == (0, 1), averaged.included  # member 1's part arrived in time
                rnd.publish(averaged)
                assert (await call.read()).HasField("header")
                await until_stalled(lambda: rnd.result_bytes, least=rpc.CHUNK_BYTES)
                call.cancel()
                await asyncio.wait_for(rnd.delivered(), 20)  # the reducer's call ended
            assert rnd.result_bytes < 4 * (n // 2)  # it was cancelled mid-stream
            servicer.end(rnd)
        finally:
            await server.stop(1.0)

    run(scenario)
    assert loud_records(caplog) == []


def test_a_sleep_fault_in_an_allreduce_leaves_the_loop_serving() -> None:
    """`sleep@allreduce_send` pauses each member's all-reduce for 1 s while the loop goes on: a task
    ticking every 10 ms never waits long (a blocking sleep would stall it for a second per member)."""
    n = 10_000
    faults.configure("sleep@allreduce_send=1.0")

    async def scenario() -> tuple[float, float, list[averaging.AllReduceResult]]:
        servicers = [AveragingServicer(f"0{i + 1}") for i in range(2)]
        servers = [
            await snapshot_server.start_server(
                LOCALHOST, 0, NoSnapshots(), status, extra_servicers=[s.register]
            )
            for s in servicers
        ]
        gaps = [0.0]

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticking = asyncio.create_task(ticker())
        try:
            members = tuple(
                Member(s.node_id, f"{LOCALHOST}:{srv.port}")
                for s, srv in zip(servicers, servers, strict=True)
            )
            spec = GroupSpec("run", 7, "g1", members, "fp32", 10.0)
            started = time.monotonic()
            results = await asyncio.gather(
                *(
                    averaging.butterfly_allreduce(s, spec, i, torch.full((n,), float(i)), 1.0)
                    for i, s in enumerate(servicers)
                )
            )
            return time.monotonic() - started, max(gaps), list(results)
        finally:
            ticking.cancel()
            for srv in servers:
                await srv.stop(0)

    try:
        took, longest_gap, results = asyncio.run(scenario())
    finally:
        faults.configure(None)
    assert took >= 1.0  # the fault did fire
    assert longest_gap < 0.5, longest_gap
    assert all(r.averaged.coverage == 1.0 for r in results)
    assert torch.equal(results[0].averaged.delta, torch.full((n,), 0.5))
