"""Property-based fuzzing of every gRPC request and of raw DHT datagrams against a live node: it never
crashes, answers with a proper status code, and keeps training."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest
import umsgpack
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmnode.net import rpc
from swarmnode.net.dht import DHTConfig, SwarmDHT
from swarmnode.net.identity import Identity
from swarmnode.proto.v1 import averaging_pb2, reachability_pb2, snapshot_pb2
from swarmtest import ProcessReaper, node_status, start_swarm, wait_for

EXAMPLES = 40
METHODS = {
    "/swarmnode.v1.SnapshotService/ListSnapshots": "unary",
    "/swarmnode.v1.SnapshotService/GetStatus": "unary",
    "/swarmnode.v1.SnapshotService/FetchSnapshot": "server_stream",
    "/swarmnode.v1.AveragingService/Propose": "unary",
    "/swarmnode.v1.AveragingService/Exchange": "bidi",
    "/swarmnode.v1.AveragingService/AwaitGroup": "unary",
    "/swarmnode.v1.ReachabilityService/DialBack": "unary",
    "/grpc.health.v1.Health/Check": "unary",
    "/grpc.health.v1.Health/Watch": "server_stream",
}
MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
"""Every integer msgpack can encode (a larger one cannot even be sent)."""
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def live_node(tmp_path_factory):
    reaper = ProcessReaper()
    try:
        args = ("--inner-steps", "20", "--hot-every", "5", "--run-id", "fuzz", "--max-outer-steps", "1000")
        (node,) = start_swarm(reaper, tmp_path_factory.mktemp("fuzz"), 1, args)
        wait_for(lambda: node_status(node)["snapshots"], 60, "a first snapshot")
        yield node
    finally:
        reaper.kill_all()


async def send_raw(address: str, method: str, payloads: list[bytes]) -> grpc.StatusCode:
    """Send arbitrary bytes as the request message(s) of `method`; return the call's status."""
    identity = lambda b: b  # noqa: E731 - raw bytes in and out
    async with rpc.open_channel(address) as channel:
        kind = METHODS[method]
        try:
            if kind == "unary":
                call = channel.unary_unary(
                    method, request_serializer=identity, response_deserializer=identity
                )
                await call(payloads[0], timeout=10)
            elif kind == "server_stream":
                call = channel.unary_stream(
                    method, request_serializer=identity, response_deserializer=identity
                )
                stream = call(payloads[0], timeout=3)
                async for _ in stream:
                    pass
            else:
                call = channel.stream_stream(
                    method, request_serializer=identity, response_deserializer=identity
                )
                stream = call(iter(payloads), timeout=10)
                async for _ in stream:
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def assert_alive(node) -> None:
    assert node.wait_nowait() is None, node.log()[-3000:]
    assert node_status(node)["node_id"] == node.info["node_id"]


@FUZZ_SETTINGS
@given(
    method=st.sampled_from(sorted(METHODS)),
    payloads=st.lists(st.binary(max_size=2048), min_size=1, max_size=4),
)
def test_random_bytes_on_every_rpc_get_a_status_code(live_node, method: str, payloads: list[bytes]) -> None:
    code = asyncio.run(send_raw(live_node.grpc_address, method, payloads))
    assert isinstance(code, grpc.StatusCode)
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE), (method, code)


requests = st.one_of(
    st.builds(
        snapshot_pb2.FetchSnapshotRequest, snapshot_id=st.text(max_size=80), offset=st.integers(0, 2**64 - 1)
    ).map(lambda m: ("/swarmnode.v1.SnapshotService/FetchSnapshot", m)),
    st.builds(health_pb2.HealthCheckRequest, service=st.text(max_size=100)).map(
        lambda m: ("/grpc.health.v1.Health/Check", m)
    ),
    st.builds(
        averaging_pb2.GroupProposal,
        run_id=st.text(max_size=40),
        round=st.integers(0, 2**63 - 1),
        group_id=st.text(max_size=40),
        wire_dtype=st.sampled_from(["fp32", "bf16", "int8", "x", ""]),
        timeout_s=st.floats(allow_nan=True, allow_infinity=True),
    ).map(lambda m: ("/swarmnode.v1.AveragingService/Propose", m)),
    st.builds(averaging_pb2.Contribution).map(lambda m: ("/swarmnode.v1.AveragingService/Exchange", m)),
    st.builds(
        averaging_pb2.AwaitGroupRequest,
        run_id=st.text(max_size=40),
        round=st.integers(0, 2**64 - 1),
        node_id=st.text(max_size=50),
    ).map(lambda m: ("/swarmnode.v1.AveragingService/AwaitGroup", m)),
    st.builds(
        reachability_pb2.DialBackRequest, port=st.integers(0, 2**32 - 1), node_id=st.text(max_size=50)
    ).map(lambda m: ("/swarmnode.v1.ReachabilityService/DialBack", m)),
)


@FUZZ_SETTINGS
@given(request=requests)
def test_well_formed_but_hostile_requests_get_a_status_code(live_node, request) -> None:
    method, message = request
    code = asyncio.run(send_raw(live_node.grpc_address, method, [message.SerializeToString()]))
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE), (method, message, code)


datagrams = st.one_of(
    st.binary(max_size=1500),
    st.builds(
        lambda kind, msg_id, body: kind + msg_id + body,
        st.sampled_from([b"\x00", b"\x01", b"\x02"]),
        st.binary(min_size=20, max_size=20),
        st.binary(max_size=600),
    ),
    st.builds(
        lambda msg_id, name, args: b"\x00" + msg_id + umsgpack.packb([name, args]),
        st.binary(min_size=20, max_size=20),
        st.sampled_from(["ping", "store", "find_node", "find_value", "nope"]),
        st.lists(
            st.one_of(st.binary(max_size=40), MSGPACK_INTS, st.text(max_size=20), st.none()), max_size=4
        ),
    ),
)


def test_raw_dht_datagrams_never_hurt_the_node(live_node) -> None:
    @FUZZ_SETTINGS
    @given(datagram=datagrams)
    def send(datagram: bytes) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(datagram, ("127.0.0.1", live_node.info["dht_port"]))

    send()

    async def dht_peers_seen() -> int:  # its DHT still answers a newcomer after the raw datagrams
        client = SwarmDHT(Identity.generate(), DHTConfig())
        await client.start([f"127.0.0.1:{live_node.info['dht_port']}"])
        try:
            return client.peer_count()
        finally:
            await client.stop()

    assert asyncio.run(dht_peers_seen()) == 1
    assert_alive(live_node)
    assert "Traceback" not in live_node.log(), live_node.log()[-3000:]


def test_the_node_survived_the_fuzzers_and_kept_training(live_node) -> None:
    before = node_status(live_node)["inner_step"]
    wait_for(lambda: node_status(live_node)["inner_step"] > before, 60, "training to go on")
    assert_alive(live_node)
    assert "Traceback" not in live_node.log(), live_node.log()[-3000:]
    assert Path(live_node.data_dir / "node.json").exists()
