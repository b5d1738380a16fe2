"""Recovery from a neighbour: real `swarmnode run` processes on 127.0.0.1, UDP DHT, gRPC snapshots."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from swarmnode.net import rpc, snapshot_client
from swarmnode.net.dht import DHTConfig, SwarmDHT
from swarmnode.net.identity import Identity
from swarmnode.swarm.announcements import Announcement, snapshots_key
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import metric_value, node_status, scrape, start_swarm, wait_for

ARGS = ("--inner-steps", "20", "--hot-every", "5", "--cold-every", "1", "--run-id", "rec")


def announcements(dht_port: int, run_id: str = "rec") -> dict[str, Announcement]:
    """What the swarm's DHT says about its snapshots, read by an outside client."""

    async def read() -> dict[str, Announcement]:
        client = SwarmDHT(Identity.generate(), DHTConfig())
        await client.start([f"127.0.0.1:{dht_port}"])
        try:
            entries = await client.get(snapshots_key(run_id))
        finally:
            await client.stop()
        found = {nid: Announcement.from_value(nid, e.value) for nid, e in entries.items()}
        return {nid: a for nid, a in found.items() if a is not None}

    return asyncio.run(read())


def test_killed_node_without_snapshots_recovers_from_a_neighbour(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, ARGS, faults=[None, None, "kill@inner_step#47"])
    victim = nodes[2]
    assert victim.wait(120) == -signal.SIGKILL
    victim_id = victim.info["node_id"]
    dht_port = nodes[0].info["dht_port"]
    last = wait_for(lambda: announcements(dht_port).get(victim_id), 30, "the victim's announcement")
    shutil.rmtree(victim.data_dir / "snapshots")  # the identity key stays
    victim.restart()
    receipt = wait_for(lambda: read_receipts(victim.data_dir)[1:], 90, "the restart receipt")[0]
    assert receipt["source"] == "peer"
    assert receipt["peer"] in {n.grpc_address for n in nodes[:2]}
    assert len(receipt["snapshot_id"]) == 64 and receipt["bytes"] > 0
    # The swarm's record of the victim (round metadata: how far its batches are in θ_g) is exact; its
    # own last announcement may lag it (announcements in flight at the kill are lost), never lead it.
    assert receipt["cursor_source"] in ("round_metadata", "announcement"), receipt
    cursor, announced = receipt["cursor"], last.cursor
    assert (cursor["shard"], cursor["epoch"]) == (announced["shard"], announced["epoch"])
    if receipt["cursor_source"] == "announcement":
        assert cursor == announced
    else:
        assert cursor["position"] >= announced["position"], (cursor, announced)
    assert set(receipt["stages_s"]) >= {"lookup", "fetch", "verify", "load"}
    status = wait_for(
        lambda: (s := node_status(victim))["inner_step"] > receipt["inner_step"] and s,
        60,
        "the recovered node to train on",
    )
    assert status["node_id"] == victim_id and status["outer_step"] >= receipt["outer_step"]
    assert "recovered from peer snapshot" in victim.log()


def test_corrupt_and_truncating_peers_are_refused_and_the_next_candidate_used(tmp_path: Path, reaper) -> None:
    # The honest node stops itself (SIGSTOP) early while the two bad servers train on: their snapshots
    # are fresher, so a joiner tries them first. It is woken before the joiner starts (and may repair
    # from them first: so every chunk one of them serves is corrupted, and every stream the other cut).
    # Every node here shares the host 127.0.0.1, which is what --max-serving-per-peer counts without
    # certificates; the woken honest node keeps retrying its own repair from the bad servers, so with
    # the default of one stream per host the joiner's fetch could be refused for the honest node's.
    per_host = ["--max-serving-per-peer", "4"]
    nodes = start_swarm(
        reaper,
        tmp_path,
        3,
        [*ARGS, "--wait-peers", "2"],
        faults=["stop@inner_step#15", "corrupt@serve_chunk", "truncate@serve_stream=100000"],
        extra=[(), per_host, per_host],
    )
    honest = nodes[0]
    wait_for(honest.stopped, 60, "the honest node to stop itself")

    def bad_servers_ahead() -> bool:
        """The honest node stopped in round 0 (inner step 15 of 20): both bad servers past it, one by 3."""
        found = announcements(nodes[1].info["dht_port"])  # asked of a running node: the honest one sleeps
        steps = [found[n.info["node_id"]].outer_step for n in nodes[1:] if n.info["node_id"] in found]
        return len(steps) == 2 and min(steps) >= 1 and max(steps) >= 3

    wait_for(bad_servers_ahead, 90, "both bad servers' snapshots to be fresher than the honest one's")
    honest.signal(signal.SIGCONT)
    # One whole snapshot at a time (the path under test): from many peers, the two bad servers' state
    # ranges (which these faults leave alone) would serve the joiner.
    joiner = reaper.node(
        tmp_path / "joiner",
        [*ARGS, "--recovery-peers", "1", "--peers", f"127.0.0.1:{nodes[1].info['dht_port']}"],
    ).start()
    receipt = wait_for(lambda: read_receipts(joiner.data_dir), 90, "the joiner's receipt")[0]
    assert receipt["source"] == "peer" and receipt["peer"] == honest.grpc_address, receipt
    failed = {c.split(" ", 1)[0]: c for c in receipt["failed_candidates"]}
    assert "truncated" in failed[nodes[2].grpc_address]
    # A corrupted stream is caught by the decoder as it arrives, or by the sha256 at its end.
    assert any(w in failed[nodes[1].grpc_address] for w in ("hash_mismatch", "corrupt")), failed
    text = scrape(joiner)
    refused = sum(
        metric_value(text, "swarmnode_fetch_failures_total", f'reason="{r}"')
        for r in ("hash_mismatch", "invalid")
    )
    assert refused >= 1
    assert metric_value(text, "swarmnode_fetch_failures_total", 'reason="truncated"') >= 1
    assert metric_value(text, "swarmnode_recoveries_total", 'source="peer"') == 1


def test_a_peer_of_another_run_configuration_is_never_used(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 2, ARGS, faults=["sleep@inner_step=0.1", None])
    stranger = reaper.node(
        tmp_path / "stranger", [*ARGS, "--seed", "7", "--peers", f"127.0.0.1:{nodes[0].info['dht_port']}"]
    ).start()
    stranger.wait_ready()
    dht_port = nodes[0].info["dht_port"]
    wait_for(lambda: len(announcements(dht_port)) == 3, 90, "three announcements")
    joiner = reaper.node(tmp_path / "joiner", [*ARGS, "--peers", f"127.0.0.1:{dht_port}"]).start()
    receipt = wait_for(lambda: read_receipts(joiner.data_dir), 90, "the joiner's receipt")[0]
    assert receipt["peer"] != stranger.grpc_address
    line = wait_for(
        lambda: next((ln for ln in joiner.log().splitlines() if "runs another configuration" in ln), None),
        30,
        "the joiner's line about the stranger",
    )
    assert "seed: theirs 7, ours 0" in line, line  # the setting that differs, with both values
    assert joiner.log().count("runs another configuration") == 1


def test_one_fetch_over_max_serving_is_refused_while_training_goes_on(tmp_path: Path, reaper) -> None:
    (node,) = start_swarm(
        reaper,
        tmp_path,
        1,
        [*ARGS, "--max-serving", "2", "--max-serving-per-peer", "3"],
        faults=["sleep@serve_chunk=0.5"],
    )
    wait_for(lambda: node_status(node)["snapshots"], 60, "a snapshot to serve")

    async def three_fetches() -> list[object]:
        fetches = [
            snapshot_client.fetch_snapshot(node.grpc_address, tmp_path / f"f{i}.snap.zst", chunk_timeout_s=30)
            for i in range(3)
        ]
        tasks = [asyncio.create_task(f) for f in fetches]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION, timeout=30)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return [t.exception() for t in done]

    before = node_status(node)["inner_step"]
    errors = asyncio.run(three_fetches())
    refused = [e for e in errors if isinstance(e, rpc.PeerUnavailable)]
    assert len(refused) == 1 and refused[0].reason == "refused"
    assert "RESOURCE_EXHAUSTED" in str(refused[0]) or "serving 2/2" in str(refused[0])
    wait_for(lambda: node_status(node)["inner_step"] > before + 5, 60, "training to go on")


def test_fetch_command_output_equals_the_served_file(tmp_path: Path, reaper) -> None:
    (node,) = start_swarm(reaper, tmp_path, 1, [*ARGS, "--hot-every", "1000", "--keep-cold", "1000"])
    snapshot = wait_for(lambda: node_status(node)["snapshots"], 60, "a snapshot to serve")[0]
    served = next((node.data_dir / "snapshots").glob(f"*{snapshot['snapshot_id']}.snap.zst"))
    out = tmp_path / "fetched.snap.zst"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmnode.cli",
            "fetch",
            node.grpc_address,
            "--snapshot",
            snapshot["snapshot_id"],
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert hashlib.sha256(out.read_bytes()).hexdigest() == snapshot["snapshot_id"]
    assert out.read_bytes() == served.read_bytes()
    inspect = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "inspect", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0 and snapshot["snapshot_id"] in inspect.stdout
