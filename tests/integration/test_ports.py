"""A port in use is never shared: the gRPC server binds without SO_REUSEPORT, and a `swarmnode run`
whose gRPC, DHT, metrics or bulk-lane port is taken exits 2 with one line naming the flag, found by the
start-up checks (before anything listens or is created in its data dir); the node that holds the port
goes on answering alone."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from swarmnode.net import rpc, snapshot_client, snapshot_server
from swarmnode.snapshot.format import SnapshotInfo
from swarmtest import NodeProcess, ProcessReaper

LOCALHOST = "127.0.0.1"


class NoSnapshots:
    def list_snapshots(self) -> list[SnapshotInfo]:
        return []

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        return None


def status() -> rpc.NodeStatus:
    return rpc.NodeStatus(node_id="first", run_id="run-test")


@pytest.mark.timeout(30)
def test_a_second_server_on_the_same_port_is_refused_with_eaddrinuse() -> None:
    async def scenario() -> None:
        first = await snapshot_server.start_server(LOCALHOST, 0, NoSnapshots(), status)
        try:
            with pytest.raises(OSError) as refused:
                second = await snapshot_server.start_server(LOCALHOST, first.port, NoSnapshots(), status)
                await second.stop(0)  # reached only when the port was shared: the test fails
        finally:
            await first.stop(0)
        assert refused.value.errno == errno.EADDRINUSE

    asyncio.run(asyncio.wait_for(scenario(), 20))


PORT_FLAGS = {
    "--grpc-port": "grpc_port",
    "--dht-port": "dht_port",
    "--metrics-port": "metrics_port",
    "--bulk-port": "bulk_port",
}


@pytest.mark.timeout(180)
def test_a_node_whose_port_is_taken_exits_2_naming_the_flag(tmp_path: Path, reaper: ProcessReaper) -> None:
    first = reaper.node(tmp_path / "first", ["--inner-steps", "100000"]).start()
    info = first.wait_ready()
    quiet = {"SWARMNODE_LOG_LEVEL": "WARNING"}  # what is left on stderr is the error alone
    seconds = {
        flag: reaper.node(tmp_path / key, [flag, str(info[key])], env=quiet).start()
        for flag, key in PORT_FLAGS.items()
    }
    for flag, second in seconds.items():
        assert second.wait(60) == 2, second.log()[-2000:]
        port = info[PORT_FLAGS[flag]]
        assert output_lines(second) == [
            f"swarmnode run: error: {flag}: port {port} on {LOCALHOST} is already in use"
        ]
        # found by the start-up checks: nothing listened, and the fresh data dir holds only the log
        assert [p.name for p in second.data_dir.iterdir()] == [second.log_path.name]

    async def answers() -> list[str]:  # fresh connections, any of which a second listener could take
        return [(await snapshot_client.get_status(first.grpc_address)).node_id for _ in range(8)]

    assert asyncio.run(answers()) == [info["node_id"]] * 8
    assert first.wait_nowait() is None


def output_lines(node: NodeProcess) -> list[str]:
    """A node's stdout and stderr (its log file holds both), blank lines left out."""
    return [line for line in node.log().splitlines() if line.strip()]
