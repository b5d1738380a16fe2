"""Recovery from many peers at once: real `swarmnode run` processes on 127.0.0.1 (README "Recovery from
many peers")."""

from __future__ import annotations

from pathlib import Path

from test_swarm_recovery import announcements

from swarmnode.swarm.recovery import read_receipts
from swarmtest import metric_value, node_status, scrape, start_swarm, wait_for

ARGS = ("--inner-steps", "20", "--hot-every", "5", "--cold-every", "1", "--run-id", "rec")
HOLD = "sleep@inner_step#45=90"
"""Every member's training thread pauses in round 2 (its event loop serves on), so the swarm holds one
agreed state at outer step 2 while the joiner recovers."""
TOGETHER = ("--wait-peers", "2", "--matchmaking-timeout", "30")
"""On a loaded machine the three start seconds apart: each waits for the others before its first round."""


def test_recovers_from_three_peers_when_one_serves_corrupt_ranges(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(
        reaper,
        tmp_path,
        3,
        [*ARGS, *TOGETHER],
        faults=[HOLD, HOLD, f"{HOLD},corrupt@serve_range"],
    )
    liar = nodes[2]
    dht_port = nodes[0].info["dht_port"]

    def held_at_step_two() -> bool:
        found = announcements(dht_port)
        steps = {found[n.info["node_id"]].outer_step for n in nodes if n.info["node_id"] in found}
        return len(found) == 3 and steps == {2} and all(node_status(n)["inner_step"] == 45 for n in nodes)

    wait_for(held_at_step_two, 120, "the swarm to hold its state at outer step 2")
    digests = {node_status(n)["global_digest"] for n in nodes}
    assert len(digests) == 1, digests
    joiner = reaper.node(
        tmp_path / "joiner", [*ARGS, "--recovery-peers", "3", "--peers", f"127.0.0.1:{dht_port}"]
    ).start()
    receipt = wait_for(lambda: read_receipts(joiner.data_dir), 60, "the joiner's receipt")[0]
    assert receipt["source"] == "peer" and receipt["outer_step"] == 2, receipt
    assert receipt["global_digest"] == digests.pop()
    assert sorted(receipt["peers"]) == sorted(n.grpc_address for n in nodes), receipt
    # Every range came from the honest two; the liar's were refused and fetched from them again.
    assert receipt["ranges_per_peer"].get(liar.grpc_address, 0) == 0, receipt
    assert sum(receipt["ranges_per_peer"].values()) >= 8  # tiny: 4 shared + 4 node ranges of 1 MiB
    assert receipt["range_failures"].get("hash_mismatch", 0) >= 1, receipt
    assert receipt["peer"] != liar.grpc_address
    assert "served corrupted" in liar.log()  # the fault fired
    text = scrape(joiner)
    assert metric_value(text, "swarmnode_range_failures_total", 'reason="hash_mismatch"') >= 1
    assert metric_value(text, "swarmnode_recoveries_total", 'source="peer"') == 1
    served = sum(metric_value(scrape(n), "swarmnode_ranges_served_total", "") for n in nodes[:2])
    assert served >= 8
