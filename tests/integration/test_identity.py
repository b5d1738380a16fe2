"""One identity, one process: a second node started with another's identity key is refused loudly
(one line, exit 2), and the node it copied keeps its place in the swarm."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

from swarmnode.core.ledger import read_ledger
from swarmnode.core.training import RunIdentity
from swarmnode.net import rpc, snapshot_server
from swarmnode.net.dht import DHTEntry
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.swarm.membership import DuplicateIdentity, Membership
from swarmtest import NodeProcess, start_swarm, stop_all, wait_for

ARGS = (
    "--inner-steps",
    "10",
    "--hot-every",
    "5",
    "--cold-every",
    "1",
    "--run-id",
    "ident",
    "--max-outer-steps",
    "200",
)


def settled(node: NodeProcess) -> int:
    return sum(1 for e in read_ledger(node.data_dir) if e["event"] == "settle")


def assert_refused(twin: NodeProcess, original: NodeProcess) -> None:
    assert twin.wait(90) == 2, twin.log()[-3000:]
    lines = [line for line in twin.log().splitlines() if "--identity" in line]
    assert len(lines) == 1, lines
    assert original.info["node_id"] in lines[0] and "already run" in lines[0], lines[0]


def test_a_twin_bootstrapping_from_the_node_it_copied_is_refused(tmp_path: Path, reaper) -> None:
    """Two nodes, the second with the first's key and the first as its only DHT peer: the first's
    answer to the bootstrap ping carries the twin's own id."""
    original, other = start_swarm(reaper, tmp_path, 2, [*ARGS, "--wait-peers", "1"])
    wait_for(lambda: settled(original) >= 1, 90, "a round")
    peers = ["--peers", f"127.0.0.1:{original.info['dht_port']}"]
    key = ["--identity", str(original.data_dir / "identity.key")]
    twin = reaper.node(tmp_path / "twin", [*ARGS, *key, *peers]).start()
    assert_refused(twin, original)
    stop_all([original, other])


def test_a_node_started_with_a_running_nodes_identity_is_refused(tmp_path: Path, reaper) -> None:
    original, other = start_swarm(reaper, tmp_path, 2, [*ARGS, "--wait-peers", "1"])
    wait_for(lambda: settled(original) >= 2, 90, "two rounds")
    key = tmp_path / "copied.key"
    shutil.copy(original.data_dir / "identity.key", key)
    peers = ["--peers", f"127.0.0.1:{other.info['dht_port']}"]
    twin = reaper.node(tmp_path / "twin", [*ARGS, "--identity", str(key), *peers]).start()
    assert_refused(twin, original)
    before = settled(original)
    wait_for(lambda: settled(original) >= before + 2, 90, "the original to go on averaging")
    stop_all([original, other])


class OneKeyDHT:
    """A DHT whose only record under both keys is this node's own id at `address`."""

    def __init__(self, node_id: str, address: str) -> None:
        self.node_id, self.address = node_id, address
        self.published: list[str] = []

    async def get(self, key: str) -> dict[str, DHTEntry]:
        value = {
            "addr": self.address,
            "id": "0" * 64,
            "size": 1,
            "o": 1,
            "i": 1,
            "kind": "hot",
            "t": 1.0,
            "run": "0" * 64,
            "cur": None,
        }
        return {self.node_id: DHTEntry(self.node_id, value, 1, 1e12)}

    async def publish(self, key: str, value: dict, ttl_s: float) -> bool:
        self.published.append(key)
        return True

    def peer_count(self) -> int:
        return 1

    def twin_addresses(self) -> list[str]:
        return []


def running_twin(node_id: str, uptime_s: float, mine_s: float) -> tuple[list[DuplicateIdentity], OneKeyDHT]:
    """A running node whose own-id entry names a live twin (a real gRPC status server) up `uptime_s`."""
    told: list[DuplicateIdentity] = []

    async def scenario() -> OneKeyDHT:
        status = rpc.NodeStatus(node_id=node_id, run_id="ident", uptime_s=uptime_s)
        server = await snapshot_server.start_server("127.0.0.1", 0, EmptyCatalog(), lambda: status)
        try:
            dht = OneKeyDHT(node_id, f"127.0.0.1:{server.port}")
            run = RunIdentity("ident", node_id, "0" * 64, "0" * 64, "tiny")
            membership = Membership(
                dht, "ident", run, "127.0.0.1:1", threading.Event(), 1.0, lambda: mine_s, told.append
            )
            await membership.announcements()  # a round's read of the swarm: it sees its id elsewhere
            probe = membership._probe_task
            assert probe is not None
            await asyncio.wait_for(probe, 10)
            if told:  # the duplicate announces nothing more: the entry is the other node's
                info = SnapshotInfo("0" * 64, Path("x"), 1, 1, 1, "hot", 1.0, "plain", "r", node_id)
                membership.announce(info)
                await asyncio.sleep(0)
            return dht
        finally:
            await server.stop(0)

    return told, asyncio.run(scenario())


def test_of_two_running_nodes_with_one_identity_only_the_younger_is_told_to_go() -> None:
    node_id = "cd" * 20
    told, dht = running_twin(node_id, uptime_s=500.0, mine_s=20.0)
    assert len(told) == 1 and "--identity" in str(told[0]) and node_id in str(told[0])
    assert dht.published == []
    told, _ = running_twin(node_id, uptime_s=20.0, mine_s=500.0)
    assert told == []


class EmptyCatalog:
    def list_snapshots(self) -> list[SnapshotInfo]:
        return []

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        return None
