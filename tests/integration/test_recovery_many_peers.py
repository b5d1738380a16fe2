"""Recovery from many peers at once: real `swarmnode run` processes on 127.0.0.1 (docs/design.md "Recovery
from many peers").

The swarm is built by recoveries, not by matchmaking (whose timing a loaded machine upsets): a first node
trains two rounds alone and holds (a fault pauses its training thread at inner step 45; its event loop
serves on), then two more join, each recovering that state from the nodes before it and holding at its
first inner step. All three then serve one agreed state at outer step 2 — the third one lying about
every range it serves, the two honest ones taking `HONEST_RANGE_S` over each — when the joiner under
test comes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from swarmnode.net.dht import DHTConfig, SwarmDHT
from swarmnode.net.identity import Identity
from swarmnode.swarm.announcements import Announcement, snapshots_key
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import NodeProcess, metric_value, node_status, scrape, wait_for

ARGS = ("--inner-steps", "20", "--hot-every", "5", "--cold-every", "1", "--run-id", "rec")
FIRST_HOLD = "sleep@inner_step#45=240"
"""The first node: two rounds alone (outer step 2 after inner step 40), then it holds."""
JOINED_HOLD = "sleep@inner_step#1=240"
"""A node that joined: its recovered state (outer step 2) is announced, then it holds."""
HONEST_RANGE_S = "sleep@serve_range=0.2"
"""The honest nodes are slow to serve a range, so the liar's answers always arrive before an end-game
copy from an honest node could win (the joiner's node-part peer, done with its node part early on a
`tiny` state, copies ranges in flight at once) and are checked."""


def announced(dht_port: int, node_id: str) -> Announcement | None:
    """A node's snapshot announcement as an outside DHT client reads it."""

    async def read() -> Announcement | None:
        client = SwarmDHT(Identity.generate(), DHTConfig())
        await client.start([f"127.0.0.1:{dht_port}"])
        try:
            entry = (await client.get(snapshots_key("rec"))).get(node_id)
        finally:
            await client.stop()
        return Announcement.from_value(node_id, entry.value) if entry is not None else None

    return asyncio.run(read())


def held(node: NodeProcess, inner_step: int, dht_port: int) -> bool:
    status = node_status(node)
    if status["inner_step"] != inner_step:
        return False
    announcement = announced(dht_port, node.info["node_id"])
    return announcement is not None and announcement.outer_step == 2


def test_recovers_from_three_peers_when_one_serves_corrupt_ranges(tmp_path: Path, reaper) -> None:
    first = reaper.node(tmp_path / "n0", ARGS, faults=f"{FIRST_HOLD},{HONEST_RANGE_S}").start()
    dht_port = first.wait_ready()["dht_port"]
    wait_for(lambda: held(first, 45, dht_port), 180, "the first node to hold at outer step 2")
    joined = ["--peers", f"127.0.0.1:{dht_port}"]
    members = [first]
    for name, faults in (
        ("n1", f"{JOINED_HOLD},{HONEST_RANGE_S}"),
        ("n2", f"{JOINED_HOLD},corrupt@serve_range"),
    ):
        node = reaper.node(tmp_path / name, [*ARGS, *joined], faults=faults).start()
        node.wait_ready()
        wait_for(lambda n=node: held(n, 1, dht_port), 120, f"{name} to recover and hold")  # type: ignore
        members.append(node)
    liar = members[2]
    digests = {node_status(n)["global_digest"] for n in members}
    assert len(digests) == 1, digests  # one agreed state, two outer steps past the initial one

    joiner = reaper.node(tmp_path / "joiner", [*ARGS, *joined, "--recovery-peers", "3"]).start()
    receipt = wait_for(lambda: read_receipts(joiner.data_dir), 90, "the joiner's receipt")[0]
    assert receipt["source"] == "peer" and receipt["outer_step"] == 2, receipt
    assert receipt["global_digest"] == digests.pop()
    assert sorted(receipt["peers"]) == sorted(n.grpc_address for n in members), receipt
    # Every range came from the honest two; the liar's were refused and fetched from them again.
    assert receipt["ranges_per_peer"].get(liar.grpc_address, 0) == 0, receipt
    assert sum(receipt["ranges_per_peer"].values()) >= 8  # tiny: 4 shared + 4 node ranges of 1 MiB
    assert receipt["range_failures"].get("hash_mismatch", 0) >= 1, receipt
    assert receipt["peer"] != liar.grpc_address
    assert "served corrupted" in liar.log()  # the fault fired
    text = scrape(joiner)
    assert metric_value(text, "swarmnode_range_failures_total", 'reason="hash_mismatch"') >= 1
    assert metric_value(text, "swarmnode_recoveries_total", 'source="peer"') == 1
    served = sum(metric_value(scrape(n), "swarmnode_ranges_served_total", "") for n in members[:2])
    assert served >= 8
