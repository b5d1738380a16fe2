"""Snapshot serving and fetching over real gRPC sockets on loopback (swarmnode.net: rpc, snapshot_server,
snapshot_client).

Run as a script (`python test_rpc_snapshots.py serve DIR`), this module is also the server that the
cross-process test starts: it serves every file in DIR and prints its port.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from swarmnode.cli import commands
from swarmnode.net import rpc
from swarmnode.net import snapshot_client as rpc_client
from swarmnode.net import snapshot_server as rpc_server
from swarmnode.proto.v1 import snapshot_pb2 as pb
from swarmnode.proto.v1 import snapshot_pb2_grpc as pb_grpc
from swarmnode.snapshot.format import SnapshotInfo

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20
LOCALHOST = "127.0.0.1"


class ListCatalog:
    """A fixed set of snapshots: the newest is the one with the highest (outer, inner) step."""

    def __init__(self, infos: list[SnapshotInfo]) -> None:
        self.infos = infos

    def list_snapshots(self) -> list[SnapshotInfo]:
        return list(self.infos)

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        if snapshot_id is None:
            return max(self.infos, key=lambda i: (i.outer_step, i.inner_step), default=None)
        return next((i for i in self.infos if i.snapshot_id == snapshot_id), None)


def write_snapshot(directory: Path, size: int, outer_step: int = 1, seed: int = 0) -> SnapshotInfo:
    """A file of `size` pseudo-random bytes, described as a snapshot whose id is its sha256."""
    data = hashlib.shake_256(f"{seed}-{size}".encode()).digest(size) if size < 64 * MiB else os.urandom(size)
    path = directory / f"s{outer_step}-{seed}.snap.zst"
    path.write_bytes(data)
    return info_for(path, outer_step)


def info_for(path: Path, outer_step: int = 1) -> SnapshotInfo:
    return SnapshotInfo(
        snapshot_id=hashlib.sha256(path.read_bytes()).hexdigest(),
        path=path,
        size_bytes=path.stat().st_size,
        outer_step=outer_step,
        inner_step=10 * outer_step,
        kind="cold" if outer_step % 2 else "hot",
        created_at=1_700_000_000.0 + outer_step,
        layout="planes",
        run_id="run-test",
        node_id="node-a",
    )


def node_status() -> rpc.NodeStatus:
    return rpc.NodeStatus(node_id="node-a", run_id="run-test", phase="inner", outer_step=3, inner_step=42)


@asynccontextmanager
async def serving(infos: list[SnapshotInfo], **kwargs) -> AsyncIterator[tuple[rpc_server.RpcServer, str]]:
    server = await rpc_server.start_server(LOCALHOST, 0, ListCatalog(infos), node_status, **kwargs)
    try:
        yield server, f"{LOCALHOST}:{server.port}"
    finally:
        await server.stop(0)


def run(coro_fn: Callable[[], object], timeout_s: float = 45.0) -> None:
    """Runs one async scenario on a fresh event loop, bounded in time."""

    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await coro_fn()  # type: ignore[misc]

    asyncio.run(bounded())


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".part"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


# --- round trips -------------------------------------------------------------------------------------


def test_lists_and_fetches_newest_snapshot_byte_identical(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    old, new = write_snapshot(src, 3 * MiB + 17, outer_step=1), write_snapshot(src, 9 * MiB + 5, outer_step=2)
    served: list[str] = []
    received: list[int] = []

    async def scenario() -> None:
        async with serving([old, new], on_served=served.append) as (_, address):
            listed = await rpc_client.list_snapshots(address)
            assert [m.snapshot_id for m in listed] == [new.snapshot_id, old.snapshot_id]
            assert listed[0] == rpc.SnapshotMeta.from_info(new)
            result = await rpc_client.fetch_snapshot(address, dst / "got.snap.zst", on_bytes=received.append)
        assert (result.snapshot_id, result.size_bytes, result.resumes) == (new.snapshot_id, new.size_bytes, 0)
        assert result.metadata == rpc.SnapshotMeta.from_info(new)

    run(scenario)
    assert (dst / "got.snap.zst").read_bytes() == new.path.read_bytes()
    assert sum(received) == new.size_bytes and max(received) <= rpc.CHUNK_BYTES
    assert served == [new.snapshot_id]
    assert leftovers(dst) == []


def test_fetches_a_snapshot_by_id_and_expected_hash(tmp_path: Path) -> None:
    old, new = write_snapshot(tmp_path, MiB, outer_step=1), write_snapshot(tmp_path, 2 * MiB, outer_step=2)

    async def scenario() -> None:
        async with serving([old, new]) as (_, address):
            await rpc_client.fetch_snapshot(address, tmp_path / "a", snapshot_id=old.snapshot_id)
            await rpc_client.fetch_snapshot(address, tmp_path / "b", expected_sha256=old.snapshot_id)

    run(scenario)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == old.path.read_bytes()


def test_empty_snapshot_round_trips(tmp_path: Path) -> None:
    empty = write_snapshot(tmp_path, 0)

    async def scenario() -> None:
        async with serving([empty]) as (_, address):
            result = await rpc_client.fetch_snapshot(address, tmp_path / "got")
        assert result.size_bytes == 0

    run(scenario)
    assert (tmp_path / "got").read_bytes() == b""


@given(offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=300))
def test_pre_encoded_chunks_parse_as_the_generated_message(offset: int, data: bytes) -> None:
    parsed = pb.FetchSnapshotChunk.FromString(rpc.encode_data_chunk(offset, data))
    assert parsed == pb.FetchSnapshotChunk(offset=offset, data=data)


def test_the_generated_stub_reads_the_served_stream(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 2 * MiB + 9)

    async def scenario() -> list[pb.FetchSnapshotChunk]:
        async with serving([snap]) as (_, address), grpc.aio.insecure_channel(address) as channel:
            stream = pb_grpc.SnapshotServiceStub(channel).FetchSnapshot(pb.FetchSnapshotRequest(offset=5))
            return [msg async for msg in stream]

    messages = asyncio.run(scenario())
    assert rpc.SnapshotMeta.from_info(snap) == rpc.meta_from_pb(messages[0].meta)
    assert [m.offset for m in messages] == [5, 5, 5 + MiB, 5 + 2 * MiB]
    assert b"".join(m.data for m in messages) == snap.path.read_bytes()[5:]


# --- broken, corrupt and truncated streams --------------------------------------------------------------


def test_resumes_from_offset_after_stream_is_cut_once(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 6 * MiB + 3)
    faults = rpc.ServeFaults(cut_at_offset=2 * MiB + 1000, cut_streams=1)

    async def scenario() -> None:
        async with serving([snap], faults=faults) as (_, address):
            result = await rpc_client.fetch_snapshot(address, tmp_path / "got")
        assert result.resumes == 1

    run(scenario)
    assert (tmp_path / "got").read_bytes() == snap.path.read_bytes()


def test_resumes_on_a_new_server_after_the_connection_drops(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 5 * MiB)
    reached, release = threading.Event(), threading.Event()

    def hold_at_3mib(offset: int, data: bytes) -> bytes:
        if offset == 3 * MiB and not release.is_set():
            reached.set()
            release.wait(20)
        return data

    async def scenario() -> None:
        first = await rpc_server.start_server(
            LOCALHOST, 0, ListCatalog([snap]), node_status, faults=rpc.ServeFaults(chunk_filter=hold_at_3mib)
        )
        address = f"{LOCALHOST}:{first.port}"
        fetch = asyncio.create_task(rpc_client.fetch_snapshot(address, tmp_path / "got", max_resumes=5))
        assert await asyncio.to_thread(reached.wait, 20)
        await first.stop(0)  # the stream breaks with 3 MiB or less delivered
        release.set()
        second = await rpc_server.start_server(LOCALHOST, first.port, ListCatalog([snap]), node_status)
        try:
            result = await fetch
        finally:
            await second.stop(0)
        assert result.resumes >= 1

    run(scenario)
    assert (tmp_path / "got").read_bytes() == snap.path.read_bytes()
    assert leftovers(tmp_path) == []


def test_corrupted_bytes_are_refused_as_hash_mismatch_and_leave_no_file(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 4 * MiB)

    def flip_a_byte(offset: int, data: bytes) -> bytes:
        return data if offset != MiB else bytes([data[0] ^ 0xFF]) + data[1:]

    async def scenario() -> None:
        async with serving([snap], faults=rpc.ServeFaults(chunk_filter=flip_a_byte)) as (_, address):
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got")
        assert failure.value.reason == "hash_mismatch"

    run(scenario)
    assert not (tmp_path / "got").exists()
    assert leftovers(tmp_path) == []


def test_a_peer_that_always_stops_short_is_reported_truncated(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 4 * MiB)

    async def scenario() -> None:
        async with serving([snap], faults=rpc.ServeFaults(cut_at_offset=3 * MiB)) as (_, address):
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got", max_resumes=2)
        assert failure.value.reason == "truncated"

    run(scenario)
    assert not (tmp_path / "got").exists()
    assert leftovers(tmp_path) == []


def test_a_stalled_stream_is_cut_after_the_chunk_timeout(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 3 * MiB)
    release = threading.Event()

    def stall(offset: int, data: bytes) -> bytes:
        if offset == MiB:
            release.wait(20)
        return data

    async def scenario() -> None:
        async with serving([snap], faults=rpc.ServeFaults(chunk_filter=stall)) as (_, address):
            started = time.monotonic()
            try:
                with pytest.raises(rpc.SnapshotUnavailable) as failure:
                    await rpc_client.fetch_snapshot(address, tmp_path / "got", chunk_timeout_s=0.5)
            finally:
                release.set()
        assert failure.value.reason == "timeout"
        assert time.monotonic() - started < 5

    run(scenario)
    assert leftovers(tmp_path) == [] and not (tmp_path / "got").exists()


def test_a_snapshot_file_that_shrank_on_disk_ends_the_stream_cleanly(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 3 * MiB)
    with open(snap.path, "r+b") as f:
        f.truncate(MiB)

    async def scenario() -> None:
        async with serving([snap]) as (_, address):
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got", max_resumes=1)
            assert len(await rpc_client.list_snapshots(address)) == 1  # the server carries on
        assert failure.value.reason == "truncated"

    run(scenario)
    assert leftovers(tmp_path) == []


def test_a_snapshot_deleted_mid_stream_is_still_served_whole(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 4 * MiB)
    content = snap.path.read_bytes()

    def delete_at_2mib(offset: int, data: bytes) -> bytes:
        if offset == 2 * MiB:
            snap.path.unlink()
        return data

    async def scenario() -> None:
        async with serving([snap], faults=rpc.ServeFaults(chunk_filter=delete_at_2mib)) as (_, address):
            await rpc_client.fetch_snapshot(address, tmp_path / "got")

    run(scenario)
    assert not snap.path.exists() and (tmp_path / "got").read_bytes() == content


def test_a_cancelled_fetch_leaves_no_file(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 3 * MiB)
    reached, release = threading.Event(), threading.Event()

    def hold_at_2mib(offset: int, data: bytes) -> bytes:
        if offset == 2 * MiB:
            reached.set()
            release.wait(20)
        return data

    async def scenario() -> None:
        async with serving([snap], faults=rpc.ServeFaults(chunk_filter=hold_at_2mib)) as (_, address):
            fetch = asyncio.create_task(rpc_client.fetch_snapshot(address, tmp_path / "got"))
            assert await asyncio.to_thread(reached.wait, 20)
            fetch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await fetch
            release.set()

    try:
        run(scenario)
    finally:
        release.set()
    assert leftovers(tmp_path) == [] and not (tmp_path / "got").exists()


def test_a_snapshot_deleted_from_disk_is_refused_not_found(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, MiB)
    snap.path.unlink()

    async def scenario() -> None:
        async with serving([snap]) as (_, address):
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got")
        assert failure.value.reason == "refused" and "no longer on disk" in failure.value.detail

    run(scenario)
    assert leftovers(tmp_path) == []


# --- refusals ---------------------------------------------------------------------------------------


def test_stream_beyond_max_serving_is_refused_while_others_complete(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 3 * MiB)
    both_open, gate = threading.Event(), threading.Event()
    opened: list[int] = []
    lock = threading.Lock()

    def hold_first_chunk(offset: int, data: bytes) -> bytes:
        if offset == 0:
            with lock:
                opened.append(offset)
                if len(opened) == 2:
                    both_open.set()
            gate.wait(20)
        return data

    async def scenario() -> None:
        faults = rpc.ServeFaults(chunk_filter=hold_first_chunk)
        async with serving([snap], max_serving=2, faults=faults) as (_, address):
            slow = [
                asyncio.create_task(rpc_client.fetch_snapshot(address, tmp_path / f"got{i}"))
                for i in range(2)
            ]
            assert await asyncio.to_thread(both_open.wait, 20)
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got3")
            gate.set()
            results = await asyncio.gather(*slow)
        assert failure.value.reason == "refused" and "serving 2/2" in failure.value.detail
        assert [r.snapshot_id for r in results] == [snap.snapshot_id] * 2

    try:
        run(scenario)
    finally:
        gate.set()
    for name in ("got0", "got1"):
        assert (tmp_path / name).read_bytes() == snap.path.read_bytes()
    assert not (tmp_path / "got3").exists() and leftovers(tmp_path) == []


def test_one_host_gets_at_most_max_serving_per_peer_streams(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 3 * MiB)
    first_open, gate = threading.Event(), threading.Event()

    def hold_first_chunk(offset: int, data: bytes) -> bytes:
        if offset == 0:
            first_open.set()
            gate.wait(20)
        return data

    async def scenario() -> None:
        faults = rpc.ServeFaults(chunk_filter=hold_first_chunk)
        async with serving([snap], max_serving=4, max_serving_per_peer=1, faults=faults) as (_, address):
            slow = asyncio.create_task(rpc_client.fetch_snapshot(address, tmp_path / "got0"))
            assert await asyncio.to_thread(first_open.wait, 20)
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got1")
            gate.set()
            await slow
        assert failure.value.reason == "refused" and "to your address" in failure.value.detail

    try:
        run(scenario)
    finally:
        gate.set()
    assert (tmp_path / "got0").read_bytes() == snap.path.read_bytes() and not (tmp_path / "got1").exists()


def test_a_reader_that_stops_reading_loses_its_slot_after_the_idle_bound(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 64 * MiB)  # far more than the HTTP/2 windows and socket buffers hold
    limits = rpc_server.StreamLimits(idle_s=0.5)
    stalls: list[str] = []

    async def scenario() -> None:
        stalled = asyncio.Event()

        def on_stalled(reason: str) -> None:
            stalls.append(reason)
            stalled.set()

        async with (
            serving([snap], max_serving_per_peer=1, limits=limits, on_stalled=on_stalled) as (_, address),
            grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 2 * MiB)]) as ch,
        ):
            call = pb_grpc.SnapshotServiceStub(ch).FetchSnapshot(pb.FetchSnapshotRequest())
            assert (await call.read()).HasField("meta")  # and then it reads nothing for a while
            opened = time.monotonic()
            with pytest.raises(rpc.SnapshotUnavailable) as busy:  # the stalled stream holds the host's slot
                await rpc_client.fetch_snapshot(address, tmp_path / "early")
            async with asyncio.timeout(10):
                await stalled.wait()
            held_s = time.monotonic() - opened
            result = await rpc_client.fetch_snapshot(address, tmp_path / "got")
            with pytest.raises(grpc.aio.AioRpcError) as ended:  # what it was sent, then the status
                while await call.read() is not grpc.aio.EOF:
                    pass
        assert busy.value.reason == "refused" and "to your address" in busy.value.detail
        assert limits.idle_s <= held_s < 5, held_s
        assert result.snapshot_id == snap.snapshot_id
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    run(scenario)
    assert stalls == ["idle"]
    assert (tmp_path / "got").read_bytes() == snap.path.read_bytes()


def test_a_reader_below_the_minimum_rate_is_cut_when_its_time_is_up(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 64 * MiB)
    limits = rpc_server.StreamLimits(idle_s=30, min_s=1.0, min_rate_bytes_s=64 * MiB)  # 64 MiB in 2 s
    stalls: list[str] = []

    async def scenario() -> None:
        async with (
            serving([snap], limits=limits, on_stalled=stalls.append) as (_, address),
            grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 2 * MiB)]) as ch,
        ):
            call = pb_grpc.SnapshotServiceStub(ch).FetchSnapshot(pb.FetchSnapshotRequest())
            started, received = time.monotonic(), 0
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    received += len(msg.data)
                    await asyncio.sleep(0.1)  # a slow link: ~10 MiB/s, never idle for long
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert received < snap.size_bytes and time.monotonic() - started < 10

    run(scenario)
    assert stalls == ["slow"]


def test_unknown_id_and_bad_offset_get_not_found_and_invalid_argument(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, MiB)

    async def first_message_code(address: str, request: pb.FetchSnapshotRequest) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await pb_grpc.SnapshotServiceStub(channel).FetchSnapshot(request).read()
        return error.value.code()

    async def scenario() -> None:
        async with serving([snap]) as (_, address):
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got", snapshot_id="ab" * 32)
            unknown = await first_message_code(address, pb.FetchSnapshotRequest(snapshot_id="ab" * 32))
            past_end = await first_message_code(
                address, pb.FetchSnapshotRequest(snapshot_id=snap.snapshot_id, offset=MiB + 1)
            )
        assert failure.value.reason == "refused"
        assert (unknown, past_end) == (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)

    run(scenario)
    assert leftovers(tmp_path) == []


def test_oversized_snapshot_is_refused_before_download(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, 2 * MiB)
    received: list[int] = []

    async def scenario() -> None:
        async with serving([snap]) as (_, address):
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(
                    address, tmp_path / "got", max_bytes=MiB, on_bytes=received.append
                )
        assert failure.value.reason == "too_large"

    run(scenario)
    assert received == [] and leftovers(tmp_path) == []


def test_a_peer_offering_another_snapshot_than_expected_is_refused(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path, MiB)
    other = hashlib.sha256(b"something else").hexdigest()

    class LyingCatalog(ListCatalog):
        def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
            return snap

    async def scenario() -> None:
        server = await rpc_server.start_server(LOCALHOST, 0, LyingCatalog([snap]), node_status)
        try:
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(
                    f"{LOCALHOST}:{server.port}", tmp_path / "got", expected_sha256=other
                )
        finally:
            await server.stop(0)
        assert failure.value.reason == "hash_mismatch"

    run(scenario)
    assert leftovers(tmp_path) == []


def test_unreachable_peer_fails_fast(tmp_path: Path) -> None:
    address = f"{LOCALHOST}:{free_port()}"

    async def scenario() -> None:
        started = time.monotonic()
        with pytest.raises(rpc.SnapshotUnavailable) as fetch_failure:
            await rpc_client.fetch_snapshot(address, tmp_path / "got")
        with pytest.raises(rpc.PeerUnavailable) as status_failure:
            await rpc_client.get_status(address)
        assert time.monotonic() - started < 5
        assert fetch_failure.value.reason == status_failure.value.reason == "unreachable"

    run(scenario)
    assert list(tmp_path.iterdir()) == []


def test_a_peer_that_accepts_tcp_but_never_speaks_grpc_is_unreachable(tmp_path: Path) -> None:
    async def scenario() -> None:
        with socket.socket() as silent:  # the kernel completes the TCP handshake; nobody answers
            silent.bind((LOCALHOST, 0))
            silent.listen()
            address = f"{LOCALHOST}:{silent.getsockname()[1]}"
            with pytest.raises(rpc.SnapshotUnavailable) as failure:
                await rpc_client.fetch_snapshot(address, tmp_path / "got", chunk_timeout_s=0.5)
        assert failure.value.reason == "unreachable"

    run(scenario)
    assert list(tmp_path.iterdir()) == []


def test_malformed_address_or_id_is_a_value_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="HOST:PORT"):
            await rpc_client.fetch_snapshot("localhost", tmp_path / "got")
        with pytest.raises(ValueError, match="sha256"):
            await rpc_client.fetch_snapshot(f"{LOCALHOST}:1", tmp_path / "got", snapshot_id="xyz")

    run(scenario)
    assert list(tmp_path.iterdir()) == []


# --- status and health ------------------------------------------------------------------------------


def test_status_round_trips_with_served_snapshots_and_health_is_serving(tmp_path: Path) -> None:
    snaps = [write_snapshot(tmp_path, 1000, outer_step=1), write_snapshot(tmp_path, 2000, outer_step=2)]
    full = rpc.NodeStatus(
        node_id="node-a",
        run_id="run-test",
        phase="outer",
        uptime_s=12.5,
        outer_step=7,
        inner_step=3500,
        last_loss=2.25,
        tokens_per_s=1234.5,
        cursor=rpc.CursorStatus(shard=3, epoch=1, position=40960),
        peers=4,
        global_digest="ab" * 16,
        last_group=("node-b", "node-a"),
        last_coverage=0.75,
        last_allreduce_s=1.5,
        repairs=2,
    )

    async def health(address: str, service: str) -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        return reply.status

    async def scenario() -> None:
        server = await rpc_server.start_server(LOCALHOST, 0, ListCatalog(snaps), lambda: full)
        address = f"{LOCALHOST}:{server.port}"
        try:
            status = await rpc_client.get_status(address)
            assert await health(address, "") == health_pb2.HealthCheckResponse.SERVING
            assert await health(address, rpc.SNAPSHOT_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)
        served = tuple(rpc.SnapshotMeta.from_info(i) for i in reversed(snaps))
        assert status == rpc.NodeStatus(**{**full.__dict__, "snapshots": served})

    run(scenario)


def test_status_without_optional_fields_round_trips_as_none(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving([]) as (_, address):
            status = await rpc_client.get_status(address)
        assert status == node_status()

    run(scenario)


def test_extra_servicers_answer_on_the_same_server() -> None:
    async def ping(request: bytes, context: object) -> bytes:
        return b"pong:" + request

    def register_ping(server: grpc.aio.Server) -> str:
        handler = grpc.unary_unary_rpc_method_handler(ping)  # raw bytes in and out
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Ping", {"Ping": handler}),)
        )
        return "test.Ping"

    async def scenario() -> None:
        async with (
            serving([], extra_servicers=[register_ping]) as (_, address),
            grpc.aio.insecure_channel(address) as channel,
        ):
            reply = await channel.unary_unary("/test.Ping/Ping")(b"hi", timeout=5)
        assert reply == b"pong:hi"

    run(scenario)


def test_stock_tools_see_every_service_by_reflection_and_health() -> None:
    """grpcurl-style discovery: reflection lists the API without the .proto files, and the health
    service reports the averaging service as well as the snapshot service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from swarmnode.swarm.averaging.reducer import AveragingServicer

    found: dict[str, object] = {}

    def reflect(address: str) -> None:  # the reflection client is synchronous: off the server's loop
        with grpc.insecure_channel(address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            found["services"] = set(database.get_services())
            proto = database.FindFileContainingSymbol("swarmnode.v1.AveragingService")
            found["methods"] = {m.name for m in proto.service[0].method}

    async def scenario() -> None:
        averaging = AveragingServicer("0a")
        async with serving([], extra_servicers=[averaging.register]) as (_, address):
            await asyncio.to_thread(reflect, address)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                found["health"] = [
                    (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
                    for name in ("swarmnode.v1.SnapshotService", "swarmnode.v1.AveragingService")
                ]

    run(scenario)
    services, answers, methods = found["services"], found["health"], found["methods"]
    assert {
        "swarmnode.v1.SnapshotService",
        "swarmnode.v1.AveragingService",
        "grpc.health.v1.Health",
    } <= services
    assert answers == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert methods == {"Propose", "Exchange", "AwaitGroup"}


# --- CLI helpers -------------------------------------------------------------------------------------


def test_fetch_and_status_commands_print_and_return_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = write_snapshot(tmp_path, MiB + 1)
    with served_in_thread([snap]) as address:
        assert commands.fetch_command(address, "latest", tmp_path / "got") == 0
        assert snap.snapshot_id in capsys.readouterr().out
        assert commands.status_command(address, as_json=True) == 0
        assert '"node_id": "node-a"' in capsys.readouterr().out
        assert commands.status_command(address, as_json=False) == 0
        assert "outer 3 inner 42" in capsys.readouterr().out
    assert (tmp_path / "got").read_bytes() == snap.path.read_bytes()
    assert commands.status_command(f"{LOCALHOST}:{free_port()}", as_json=False) == 1
    assert commands.fetch_command("no-port", None, tmp_path / "x") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unreachable" in err[0] and "HOST:PORT" in err[1]


class served_in_thread:
    """A server on its own event loop in a thread, for the sync CLI helpers (which call asyncio.run)."""

    def __init__(self, infos: list[SnapshotInfo]) -> None:
        self._infos = infos
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self.address = ""

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with serving(self._infos) as (_, self.address):
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> str:
        self._thread.start()
        assert self._ready.wait(20)
        return self.address

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)


# --- a server in another OS process -----------------------------------------------------------------


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes started by a test; killed and reaped whatever the test's outcome."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(10)


def test_fetches_from_a_server_in_another_process(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    snap = write_snapshot(served, 12 * MiB + 7)
    proc = subprocess.Popen(
        [sys.executable, __file__, "serve", str(served)], stdout=subprocess.PIPE, text=True
    )
    children.append(proc)
    assert proc.stdout is not None
    port = int(proc.stdout.readline().strip())

    async def scenario() -> None:
        address = f"{LOCALHOST}:{port}"
        assert [m.snapshot_id for m in await rpc_client.list_snapshots(address)] == [snap.snapshot_id]
        result = await rpc_client.fetch_snapshot(address, tmp_path / "got", expected_sha256=snap.snapshot_id)
        assert result.size_bytes == snap.size_bytes

    run(scenario)
    assert (tmp_path / "got").read_bytes() == snap.path.read_bytes()


async def serve_directory(directory: Path) -> None:
    """Serves every file in `directory` until killed; prints the port on its own line first."""
    infos = [info_for(p, outer_step=n) for n, p in enumerate(sorted(directory.iterdir()), start=1)]
    server = await rpc_server.start_server(LOCALHOST, 0, ListCatalog(infos), node_status)
    print(server.port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    asyncio.run(serve_directory(Path(sys.argv[2])))
