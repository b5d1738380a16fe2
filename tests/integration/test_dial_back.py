"""The dial-back probe (`swarmnode.net.dial_back`) over real gRPC on loopback: it reaches a caller
that listens, reports one that does not, dials only the caller's own observed host (never one the caller
names: the request has no host), and is bounded per caller."""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_allreduce import NoSnapshots, run

from swarmnode.bench import netbed
from swarmnode.bench.netbed import NetBed
from swarmnode.bench.procs import free_port
from swarmnode.net import dial_back, rpc, snapshot_server
from swarmnode.net.dial_back import DialBackServicer, ask_dial_back, observed_host
from swarmnode.proto.v1 import reachability_pb2 as pb

pytestmark = pytest.mark.timeout(60)
CALLER = "ab" * 20
SUBNET = 200 + os.getpid() % 50
"""The second octet of the bed's subnets (another run in parallel most likely picks another)."""


async def status_server(node_id: str) -> snapshot_server.RpcServer:
    return await snapshot_server.start_server(
        "127.0.0.1", 0, NoSnapshots(), lambda: rpc.NodeStatus(node_id, "run")
    )


async def prober(counts: Counter[str]) -> snapshot_server.RpcServer:
    servicer = DialBackServicer(on_dial=lambda result: counts.update([result]), dial_timeout_s=1.0)
    return await snapshot_server.start_server(
        "127.0.0.1",
        0,
        NoSnapshots(),
        lambda: rpc.NodeStatus("cd" * 20, "run"),
        extra_servicers=[servicer.register],
    )


def test_a_listening_caller_is_reachable_and_a_silent_port_is_not() -> None:
    counts: Counter[str] = Counter()

    async def scenario() -> list[Any]:
        caller, probe = await status_server(CALLER), await prober(counts)
        address = f"127.0.0.1:{probe.port}"
        try:
            return [
                await ask_dial_back(address, caller.port, CALLER, 5.0),
                await ask_dial_back(address, free_port(), CALLER, 5.0),
                await ask_dial_back(address, caller.port, "ef" * 20, 5.0),  # another node answers there
            ]
        finally:
            await caller.stop(0)
            await probe.stop(0)

    reached, silent, other = run(scenario())
    assert reached.reachable and reached.observed_host == "127.0.0.1"
    assert not silent.reachable and "no answer" in silent.reason
    assert not other.reachable and "another node" in other.reason
    assert counts == Counter({"reachable": 1, "unreachable": 2})


def test_dial_backs_are_bounded_per_caller_and_a_throttled_one_dials_nothing() -> None:
    counts: Counter[str] = Counter()

    async def scenario() -> list[Any]:
        caller, probe = await status_server(CALLER), await prober(counts)
        address = f"127.0.0.1:{probe.port}"
        try:
            return [await ask_dial_back(address, caller.port, CALLER, 5.0) for _ in range(5)]
        finally:
            await caller.stop(0)
            await probe.stop(0)

    answers = run(scenario())
    assert [a is not None for a in answers] == [True] * dial_back.DIAL_BACK_BURST + [False] * 2
    assert counts == Counter({"reachable": dial_back.DIAL_BACK_BURST, "throttled": 2})


class FakeContext:
    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.aborted: grpc.StatusCode | None = None

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = code
        raise RuntimeError(details)


@pytest.mark.parametrize(
    ("peer", "target"),
    [("ipv4:10.9.8.7:40312", "10.9.8.7:7000"), ("ipv6:[2001:db8::5]:40312", "[2001:db8::5]:7000")],
)
def test_the_probe_dials_only_the_callers_observed_host(
    monkeypatch: pytest.MonkeyPatch, peer: str, target: str
) -> None:
    dialled: list[str] = []

    async def fake_connect(host: str, port: int, timeout_s: float) -> None:
        dialled.append(dial_back.dial_target(host, port))

    async def fake_status(address: str, timeout_s: float, channels: Any = None) -> rpc.NodeStatus:
        dialled.append(address)
        return rpc.NodeStatus(CALLER, "run")

    monkeypatch.setattr(dial_back, "connect_once", fake_connect)
    monkeypatch.setattr(dial_back.snapshot_client, "get_status", fake_status)
    reply = asyncio.run(
        DialBackServicer().DialBack(pb.DialBackRequest(port=7000, node_id=CALLER), FakeContext(peer))
    )
    assert reply.reachable and dialled == [target, target]  # its own TCP connect, then GetStatus
    assert set(pb.DialBackRequest.DESCRIPTOR.fields_by_name) == {"port", "node_id"}  # no host to name


@pytest.mark.parametrize(
    ("peer", "port", "node_id"),
    [("unix:/tmp/sock", 7000, CALLER), ("ipv4:10.0.0.1:5", 0, CALLER), ("ipv4:10.0.0.1:5", 70000, CALLER),
     ("ipv4:10.0.0.1:5", 7000, "nope")],
)  # fmt: skip
def test_a_bad_request_is_refused_without_dialling(
    monkeypatch: pytest.MonkeyPatch, peer: str, port: int, node_id: str
) -> None:
    async def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("dialled")

    monkeypatch.setattr(dial_back, "connect_once", never)
    monkeypatch.setattr(dial_back.snapshot_client, "get_status", never)
    context = FakeContext(peer)
    request = pb.DialBackRequest(port=port, node_id=node_id)
    with pytest.raises(RuntimeError):
        asyncio.run(DialBackServicer().DialBack(request, context))
    assert context.aborted == grpc.StatusCode.INVALID_ARGUMENT


def test_observed_host_parses_grpc_peer_strings() -> None:
    assert observed_host("ipv4:192.168.1.4:5000") == "192.168.1.4"
    assert observed_host("ipv6:[::1]:5000") == "::1"
    assert observed_host("unix:/run/x.sock") is None


def connecting_to(host: str, port: int) -> list[str]:
    """This namespace's TCP sockets still sending SYNs to IPv4 HOST:PORT (state SYN_SENT in /proc/net/tcp
    and tcp6: gRPC's sockets are IPv6 ones, with the IPv4-mapped address), by local address."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in (line.split() for line in Path(table).read_text().splitlines()[1:]):
            address, remote_port = row[2].split(":")
            words = bytes.fromhex(address)  # 32-bit words, each in host (little-endian) order
            packed = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
            ip = ipaddress.ip_address(packed)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            if str(ip) == host and int(remote_port, 16) == port and row[3] == "02":
                found.append(row[1])
    return found


def test_a_dial_that_reaches_nobody_is_over_when_the_prober_answers() -> None:
    """Dialling a caller behind a router that drops every inbound connection: the answer is "no answer",
    and by then no socket of the dial is still connecting, so the router sees no SYN after it. (A gRPC
    channel's connection attempt outlived the channel's close by ~2 s, and the caller's router counted its
    SYN retries as dials of a node that had already been told it is a client.) Root only."""
    reason = netbed.unavailable()
    if reason is not None:
        pytest.skip(f"no network test bed here: {reason}")
    with NetBed() as bed:
        wan = bed.bridge(f"10.{SUBNET}.41.0/24")
        router = bed.nat_router("home", wan, f"10.{SUBNET}.41.9", f"10.{SUBNET}.42.0/24")
        answer = asyncio.run(DialBackServicer(dial_timeout_s=1.5)._dial(router.wan.address, 7000, CALLER))
        still_connecting = connecting_to(router.wan.address, 7000)
        assert "no answer" in answer and still_connecting == [], (answer, still_connecting)
        assert router.dial_attempts() >= 1  # it did dial: the router dropped and counted its SYNs
