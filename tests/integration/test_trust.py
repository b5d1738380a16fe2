"""Trust: a swarm token on every RPC, mutual TLS in the handshake (node certificates name their node
ids), and a secret that never leaks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swarmnode.bench.pki import make_ca, make_leaf
from swarmnode.net import rpc, snapshot_client
from swarmnode.net.identity import Identity
from swarmnode.net.security import Security
from swarmnode.proto.v1 import averaging_pb2, averaging_pb2_grpc
from swarmnode.proto.v1 import snapshot_pb2 as pb
from swarmnode.proto.v1 import snapshot_pb2_grpc as pb_grpc
from swarmtest import node_status, scrape, start_swarm, stop_all, wait_for

TOKEN = "correct-horse-battery-staple-7f3a"
ARGS = (
    "--inner-steps",
    "20",
    "--hot-every",
    "5",
    "--cold-every",
    "1",
    "--run-id",
    "trust",
    "--max-outer-steps",
    "200",
)


NODES = 2


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A swarm CA; node i's identity key (`id{i}`) and a certificate naming its node id (`node{i}`); an
    operator's client certificate (`client`); and a certificate of another CA (`foreign`)."""
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca("swarm test CA")
    files = {"ca": root / "ca.pem"}
    files["ca"].write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    names = {"client": "operator", "foreign": "operator"}
    for i in range(NODES):
        identity = Identity.load_or_create(root / f"id{i}.key")
        files[f"id{i}"] = root / f"id{i}.key"
        names[f"node{i}"] = identity.node_id_hex
    for name, common_name in names.items():
        cert, key = make_leaf(make_ca("another CA") if name == "foreign" else ca, common_name)
        (root / f"{name}.pem").write_bytes(cert)
        (root / f"{name}.key").write_bytes(key)
        files[name], files[f"{name}_key"] = root / f"{name}.pem", root / f"{name}.key"
    return files


def secure_args(pki: dict[str, Path], i: int = 0) -> list[str]:
    return [
        "--swarm-token",
        TOKEN,
        "--identity",
        str(pki[f"id{i}"]),
        "--tls-cert",
        str(pki[f"node{i}"]),
        "--tls-key",
        str(pki[f"node{i}_key"]),
        "--tls-ca",
        str(pki["ca"]),
    ]


def client(pki: dict[str, Path], token: str | None = TOKEN, cert: str | None = "client") -> Security:
    return Security.from_files(
        token, pki[cert] if cert else None, pki[f"{cert}_key"] if cert else None, pki["ca"]
    )


async def call_everything(address: str) -> dict[str, grpc.StatusCode]:
    """Every RPC of a node, with whatever credentials `rpc.configure_client` set: name -> status code."""
    codes: dict[str, grpc.StatusCode] = {}

    async def attempt(name: str, call) -> None:
        try:
            await call
            codes[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            codes[name] = exc.code()

    async with rpc.open_channel(address) as channel:
        snapshots = pb_grpc.SnapshotServiceStub(channel)
        await attempt("GetStatus", snapshots.GetStatus(pb.GetStatusRequest(), timeout=10))
        await attempt("ListSnapshots", snapshots.ListSnapshots(pb.ListSnapshotsRequest(), timeout=10))
        stream = snapshots.FetchSnapshot(pb.FetchSnapshotRequest(snapshot_id="latest"), timeout=10)
        await attempt("FetchSnapshot", stream.read())
        health = health_pb2_grpc.HealthStub(channel)
        await attempt("Health", health.Check(health_pb2.HealthCheckRequest(), timeout=10))
        averaging = averaging_pb2_grpc.AveragingServiceStub(channel)
        await attempt("Propose", averaging.Propose(averaging_pb2.GroupProposal(), timeout=10))
    return codes


def test_token_and_client_certificate_are_required_on_every_rpc(tmp_path: Path, reaper, pki) -> None:
    (node,) = start_swarm(reaper, tmp_path, 1, [*ARGS, *secure_args(pki)])
    address = f"localhost:{node.info['grpc_port']}"
    wait_for(lambda: list((tmp_path / "n0" / "snapshots").glob("*.snap.zst")), 60, "a snapshot to serve")

    rpc.configure_client(client(pki))
    try:
        allowed = asyncio.run(call_everything(address))
        ok = ("GetStatus", "ListSnapshots", "FetchSnapshot", "Health")  # the stream's credentials too
        assert all(allowed[name] == grpc.StatusCode.OK for name in ok), allowed
        assert allowed["Propose"] == grpc.StatusCode.INVALID_ARGUMENT  # reached its handler: an empty group
        for label, security, refused in (
            ("no token", client(pki, token=None), grpc.StatusCode.UNAUTHENTICATED),
            ("wrong token", client(pki, token="x"), grpc.StatusCode.UNAUTHENTICATED),
            # Refused in the TLS handshake: no handler (not even health) runs; gRPC says UNAVAILABLE.
            ("no client certificate", client(pki, cert=None), grpc.StatusCode.UNAVAILABLE),
            ("a certificate of another CA", client(pki, cert="foreign"), grpc.StatusCode.UNAVAILABLE),
        ):
            rpc.configure_client(security)
            codes = asyncio.run(call_everything(address))
            assert set(codes.values()) == {refused}, (label, codes)
        rpc.configure_client(client(pki, token=None))
        with pytest.raises(rpc.PeerUnavailable) as refused:
            asyncio.run(snapshot_client.fetch_snapshot(address, tmp_path / "x.snap.zst"))
        assert refused.value.reason == "refused" and TOKEN not in str(refused.value)
        assert not (tmp_path / "x.snap.zst").exists()
    finally:
        rpc.configure_client(Security())
    text = scrape(node)
    assert 'swarmnode_rpc_rejected_total{reason="unauthenticated"}' in text
    assert TOKEN not in text
    # The CLI names a refused handshake in one line (exit 1).
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "status", address, "--tls-ca", str(pki["ca"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "refused the TLS handshake" in out.stderr and "--tls-cert" in out.stderr, out.stderr
    stop_all([node])
    assert TOKEN not in node.log()


def test_a_node_certificate_must_name_the_nodes_own_id(tmp_path: Path, reaper, pki) -> None:
    args = [*ARGS, *secure_args(pki, 0)]
    args[args.index("--identity") + 1] = str(pki["id1"])  # node 0's certificate, node 1's key
    node = reaper.node(tmp_path / "n0", args).start()
    assert node.wait(60) == 2
    assert "--tls-cert" in node.log() and "common name" in node.log()


def test_a_tls_swarm_with_a_token_trains_together_and_keeps_a_stranger_out(
    tmp_path: Path, reaper, pki
) -> None:
    args = [
        *ARGS,
        "--host",
        "127.0.0.1",
        "--advertise-host",
        "localhost",
        "--wait-peers",
        "1",
        "--matchmaking-timeout",
        "5",
    ]
    nodes = start_swarm(reaper, tmp_path, NODES, args, extra=[secure_args(pki, i) for i in range(NODES)])
    wait_for(
        lambda: all(len(node_status_secure(n, pki)["last_group"]) == 2 for n in nodes),
        90,
        "the two TLS nodes to average together",
    )
    dht_port = nodes[0].info["dht_port"]
    stranger = reaper.node(
        tmp_path / "stranger", [*ARGS, "--peers", f"127.0.0.1:{dht_port}", "--tls-ca", str(pki["ca"])]
    ).start()
    stranger.wait_ready()
    wait_for(lambda: "no snapshot to resume from" in stranger.log(), 60, "the stranger to start alone")
    assert "recovered from peer" not in stranger.log()
    # Two more rounds of the swarm while the stranger trains: it never gets into a group.
    later = max(node_status_secure(n, pki)["outer_step"] for n in nodes) + 2
    wait_for(
        lambda: all(node_status_secure(n, pki)["outer_step"] >= later for n in nodes),
        90,
        "two more rounds of the swarm",
    )
    stranger_id = stranger.info["node_id"]
    assert all(stranger_id not in node_status_secure(n, pki)["last_group"] for n in nodes)
    assert all(len(node_status_secure(n, pki)["last_group"]) == 2 for n in nodes)
    stop_all([*nodes, stranger])
    assert all(TOKEN not in node.log() for node in [*nodes, stranger])


def node_status_secure(node, pki) -> dict:
    rpc.configure_client(client(pki))
    try:
        status = asyncio.run(snapshot_client.get_status(f"localhost:{node.info['grpc_port']}"))
    finally:
        rpc.configure_client(Security())
    return {"last_group": status.last_group, "outer_step": status.outer_step}


def test_status_command_takes_the_token_from_the_environment(
    tmp_path: Path, reaper, pki, monkeypatch
) -> None:
    (node,) = start_swarm(reaper, tmp_path, 1, [*ARGS, "--swarm-token", TOKEN])
    monkeypatch.setenv("SWARMNODE_SWARM_TOKEN", TOKEN)
    assert node_status(node)["node_id"] == node.info["node_id"]
    monkeypatch.setenv("SWARMNODE_SWARM_TOKEN", "wrong")
    with pytest.raises(AssertionError, match="refused"):
        node_status(node)
