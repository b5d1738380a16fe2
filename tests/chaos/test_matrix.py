"""The chaos matrix (issue "Reliability and trust"): a loopback swarm of real `swarmnode run` processes,
one fault per cell injected at a chosen point through the fault hook, never a timer.

Every cell asserts: the others keep finishing rounds, the faulted node comes back (or is ruled out for
rounds and rejoins), the global digests agree again within two rounds of its return, and every node's
ledger replays (no batch counted twice or skipped, except rounds of a dead node, trained again).
The cells marked `slow` run with `pytest -m slow tests/chaos` (see docs/operations.md "Reliability").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmnode.core.ledger import digests_by_round, read_ledger
from swarmnode.net import rpc, snapshot_client
from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot.read import read_header
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import (
    NodeProcess,
    assert_ledgers_replay,
    first_agreed_round,
    metric_value,
    newest_snapshot,
    node_status,
    scrape,
    start_swarm,
    stop_all,
    tmpfs,
    wait_for,
)

SWARM = (
    "--inner-steps",
    "30",  # long enough for a repaired node to join the round it adopted
    "--hot-every",
    "3",
    "--cold-every",
    "1",
    "--matchmaking-timeout",
    "4",
    "--allreduce-timeout",
    "6",
    "--wait-peers",
    "2",
    "--max-outer-steps",
    "200",
    "--run-id",
    "chaos",
    "--seed",
    "11",
)
SHARDS = [["--shard", str(i)] for i in range(3)]


def round_digests(nodes: list[NodeProcess]) -> dict[int, dict[str, str]]:
    """outer step -> {node: global digest after that step}, from the nodes' ledgers."""
    rounds: dict[int, dict[str, str]] = {}
    for node in nodes:
        for outer, digest in digests_by_round(read_ledger(node.data_dir)).items():
            rounds.setdefault(outer, {})[node.data_dir.name] = digest
    return rounds


def agreed_round(nodes: list[NodeProcess], after: int) -> int | None:
    return first_agreed_round(round_digests(nodes), len(nodes), after)


def survivors_round(nodes: list[NodeProcess]) -> int:
    return min(max(digests_by_round(read_ledger(n.data_dir)), default=0) for n in nodes)


def finish(nodes: list[NodeProcess], returned_at: int) -> None:
    """The digests agree within two rounds of `returned_at`; stop everyone; the ledgers replay."""
    agreed = wait_for(lambda: agreed_round(nodes, returned_at), 120, "all digests to agree again")
    assert agreed <= returned_at + 2, (
        f"agreed only at round {agreed}, the faulted node was back at {returned_at}"
    )
    stop_all(nodes)
    assert_ledgers_replay(nodes)


def kill_cell(tmp_path: Path, reaper, fault: str) -> dict:
    nodes = start_swarm(reaper, tmp_path, 3, SWARM, faults=[None, None, fault], extra=SHARDS)
    victim = nodes[2]
    assert victim.wait(180) == -signal.SIGKILL, victim.log()[-2000:]
    before = survivors_round(nodes[:2])
    wait_for(lambda: survivors_round(nodes[:2]) >= before + 1, 60, "the survivors to finish a round")
    victim.restart()
    receipt = wait_for(lambda: read_receipts(victim.data_dir)[1:], 90, "the victim's restart")[-1]
    finish(nodes, max(receipt["outer_step"], survivors_round(nodes[:2])))
    return receipt


def test_sigkill_in_the_inner_phase(tmp_path: Path, reaper) -> None:
    kill_cell(tmp_path, reaper, "kill@inner_step#25")


def write_kill_cell(tmp_path: Path, reaper, fault: str) -> tuple[dict, Path]:
    """Killed half-way through a snapshot write while the others wait for it at matchmaking (their
    timeout is long here, so the swarm does not move past its step): the half-written temporary file is
    there (the fault fired mid-write), is never listed as a snapshot and is removed at the restart.
    Returns the restart's receipt and the newest complete snapshot before it."""
    patient = ["--matchmaking-timeout", "40"]
    extra = [[*SHARDS[0], *patient], [*SHARDS[1], *patient], SHARDS[2]]
    nodes = start_swarm(reaper, tmp_path, 3, SWARM, faults=[None, None, fault], extra=extra)
    victim = nodes[2]
    assert victim.wait(180) == -signal.SIGKILL, victim.log()[-2000:]
    snapshots = victim.data_dir / "snapshots"
    partial = list(snapshots.glob(".tmp-*.part"))
    assert partial, "no half-written file: the fault did not fire mid-write"
    complete = list(iter_snapshot_files(snapshots))
    assert complete and not any(p.name.startswith(".") for p in complete)
    victim.restart()
    receipt = wait_for(lambda: read_receipts(victim.data_dir)[1:], 90, "the victim's restart")[-1]
    assert not any(p.exists() for p in partial), "the interrupted write's file outlived the restart"
    finish(nodes, max(receipt["outer_step"], survivors_round(nodes[:2])))
    return receipt, complete[0]


def test_sigkill_during_a_hot_snapshot_write(tmp_path: Path, reaper) -> None:
    receipt, previous = write_kill_cell(tmp_path, reaper, "kill@hot_snapshot_halfway#7")
    assert (receipt["source"], receipt["snapshot_id"]) == ("local", parse_snapshot_name(previous.name)[3])


@pytest.mark.slow
def test_sigkill_during_a_cold_snapshot_write(tmp_path: Path, reaper) -> None:
    """The cold snapshot follows an outer step the others took too: their snapshots of it are fresher
    than the victim's previous one, so it may resume from a peer's instead (never the partial file)."""
    receipt, previous = write_kill_cell(tmp_path, reaper, "kill@cold_snapshot_halfway#2")
    if receipt["source"] == "local":
        assert receipt["snapshot_id"] == parse_snapshot_name(previous.name)[3]
    else:
        assert receipt["source"] == "peer" and receipt["outer_step"] > parse_snapshot_name(previous.name)[1]


@pytest.mark.slow
def test_sigkill_during_an_allreduce(tmp_path: Path, reaper) -> None:
    """Killed before its first part went out: the round's averages hold none of its batches, so it must
    come back at that round's start (the lineage never recorded its end) and train the range again."""
    kill_cell(tmp_path, reaper, "kill@allreduce_send#5")
    entries = read_ledger(tmp_path / "n2")
    back = next(
        i for i, e in enumerate(entries) if e["event"] == "adopt" and entries[i - 1]["event"] == "round"
    )
    pending = entries[back - 1]  # the round whose Δ was on the wire at the kill: it never settled
    assert entries[back]["cursor"] == pending["start"], (pending, entries[back])


@pytest.mark.slow
def test_sigkill_of_a_fetcher_during_a_snapshot_fetch(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, SWARM, extra=SHARDS)
    wait_for(lambda: survivors_round(nodes) >= 2, 90, "two rounds")
    victim = nodes[2]
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    shutil.rmtree(victim.data_dir / "snapshots")
    victim.restart(faults="kill@fetch_chunk#3")  # dies with its recovery download half done
    assert victim.wait(120) == -signal.SIGKILL
    left = [p for p in (victim.data_dir / "snapshots").rglob("*") if p.is_file()]
    assert not left, f"a half download left files behind: {left}"
    victim.restart()
    receipt = wait_for(lambda: read_receipts(victim.data_dir)[1:], 120, "the victim's recovery")[-1]
    assert receipt["source"] == "peer"
    finish(nodes, max(receipt["outer_step"], survivors_round(nodes[:2])))


@pytest.mark.slow
def test_sigkill_of_a_server_during_a_snapshot_fetch(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, SWARM, extra=SHARDS)
    server = nodes[2]
    wait_for(lambda: survivors_round(nodes) >= 2, 90, "two rounds")
    # Armed only now: a peer's start-up recovery from this node must not be what trips it.
    server.signal(signal.SIGTERM)
    assert server.wait(60) == 0
    server.restart(faults="kill@serve_chunk#3").wait_ready()
    wait_for(lambda: read_receipts(server.data_dir)[1:], 60, "the server back from its own snapshot")
    address = server.grpc_address
    with pytest.raises(rpc.PeerUnavailable):  # the server dies half-way through the stream
        asyncio.run(snapshot_client.fetch_snapshot(address, tmp_path / "a.snap.zst", chunk_timeout_s=10))
    assert server.wait(30) == -signal.SIGKILL
    assert not (tmp_path / "a.snap.zst").exists()
    result = asyncio.run(snapshot_client.fetch_snapshot(nodes[0].grpc_address, tmp_path / "b.snap.zst"))
    assert result.size_bytes > 0  # the next candidate serves it
    server.restart()
    receipt = wait_for(lambda: read_receipts(server.data_dir)[2:], 120, "the server's restart")[-1]
    finish(nodes, max(receipt["outer_step"], survivors_round(nodes[:2])))


def test_sigstop_longer_than_a_round_then_sigcont(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, SWARM, faults=[None, None, "stop@inner_step#25"], extra=SHARDS)
    sleeper = nodes[2]
    wait_for(lambda: sleeper.stopped(), 90, "the node to stop itself")
    before = survivors_round(nodes[:2])
    wait_for(lambda: survivors_round(nodes[:2]) >= before + 2, 90, "two rounds without it")
    sleeper.signal(signal.SIGCONT)
    back = survivors_round(nodes[:2])
    wait_for(lambda: node_status(sleeper)["outer_step"] >= back, 90, "the sleeper to catch up")
    assert node_status(sleeper)["repairs"] >= 1
    finish(nodes, survivors_round(nodes[:2]))  # the round the others were in when it was back


@pytest.mark.slow
def test_a_full_disk_is_survived(tmp_path: Path, reaper) -> None:
    victim_dir = tmp_path / "n2"
    (victim_dir / "snapshots").mkdir(parents=True)
    with tmpfs(victim_dir / "snapshots", "12m"):
        nodes = start_swarm(reaper, tmp_path, 3, SWARM, extra=SHARDS)
        victim = nodes[2]
        wait_for(
            lambda: (
                metric_value(scrape(victim), "swarmnode_snapshot_failures_total", 'reason="disk_full"') >= 2
            ),
            120,
            "the disk to fill up",
        )
        assert victim.log().count("snapshot write failed (disk_full)") == 1
        start = survivors_round(nodes)
        wait_for(lambda: survivors_round(nodes) >= start + 2, 90, "two more rounds on a full disk")
        finish(nodes, start)


def test_a_clock_skewed_by_minutes(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, SWARM, faults=[None, None, "skew@clock=-150"], extra=SHARDS)
    wait_for(lambda: survivors_round(nodes) >= 3, 120, "three rounds with a skewed clock")
    created = {
        n.data_dir.name: read_header(newest_snapshot(n.data_dir)).metadata["created_at"] for n in nodes
    }
    lag = min(created["n0"], created["n1"]) - created["n2"]  # the skewed node signs by its own clock
    assert 120 < lag < 180, f"the skew did not apply: created_at {created}"
    groups = [e["group_size"] for e in read_ledger(nodes[2].data_dir) if e["event"] == "settle"]
    assert 3 in groups, f"the skewed node never averaged with the others: {groups}"
    finish(nodes, 1)


@pytest.mark.slow
def test_a_network_partition_of_one_node(tmp_path: Path, reaper) -> None:
    with veth_namespace() as (host_ip, ns_ip, namespace, link):
        host_args = [*SWARM, "--host", host_ip]
        debug = {"SWARMNODE_LOG_DEBUG": "swarmnode.swarm.averaging.matchmaking"}
        seed = reaper.node(tmp_path / "n0", [*host_args, *SHARDS[0]], env=debug).start()
        peers = ["--peers", f"{host_ip}:{seed.wait_ready()['dht_port']}"]
        second = reaper.node(tmp_path / "n1", [*host_args, *SHARDS[1], *peers], env=debug).start()
        isolated = reaper.node(
            tmp_path / "n2",
            [*SWARM, "--host", ns_ip, *SHARDS[2], *peers],
            env=debug,
            prefix=["ip", "netns", "exec", namespace],
        ).start()
        nodes = [seed, second, isolated]
        for node in nodes:
            node.wait_ready()
        wait_for(lambda: survivors_round(nodes) >= 2, 90, "two rounds of all three")
        subprocess.run(["ip", "link", "set", link, "down"], check=True)  # the partition
        cut_at = survivors_round(nodes[:2])
        wait_for(lambda: survivors_round(nodes[:2]) >= cut_at + 2, 90, "two rounds of the majority side")
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        wait_for(lambda: node_status(isolated)["repairs"] >= 1, 90, "the isolated node to repair itself")
        finish(nodes, survivors_round(nodes[:2]))  # it is back once it has repaired itself


@contextlib.contextmanager
def veth_namespace() -> Iterator[tuple[str, str, str, str]]:
    """A network namespace joined to the host by a veth pair (host 10.231.N.1, namespace 10.231.N.2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a partition needs root and iproute2 (ip netns)")
    n = os.getpid() % 250
    namespace, host_if, ns_if = f"snchaos{n}", f"snh{n}", f"snn{n}"
    host_ip, ns_ip = f"10.231.{n}.1", f"10.231.{n}.2"
    steps = [
        ["ip", "netns", "add", namespace],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", namespace],
        ["ip", "addr", "add", f"{host_ip}/24", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", namespace, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_if],
        ["ip", "netns", "exec", namespace, "ip", "link", "set", ns_if, "up"],
    ]
    try:
        for step in steps:
            if subprocess.run(step, capture_output=True).returncode != 0:
                pytest.skip(f"network namespaces unavailable here ({' '.join(step)} failed)")
        yield host_ip, ns_ip, namespace, host_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
