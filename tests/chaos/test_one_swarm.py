"""One swarm, never a fork: a client counts toward --wait-peers, a restarted first node finds its swarm
again, and a leader that stops after offering is passed over. Real `swarmnode run` processes on
loopback; faults at named points (never timers)."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from swarmnode.bench.procs import free_port
from swarmnode.core.ledger import read_ledger
from swarmtest import assert_ledgers_replay, metric_value, start_swarm, stop_all, wait_for

SWARM = (
    *("--inner-steps", "20", "--hot-every", "5", "--cold-every", "1"),
    *("--matchmaking-timeout", "4", "--allreduce-timeout", "6"),
    *("--max-outer-steps", "200", "--run-id", "one-swarm", "--seed", "5"),
)
SHARDS = [["--shard", str(i)] for i in range(3)]


def settles(node, since: float = 0.0) -> list[dict]:
    return [e for e in read_ledger(node.data_dir) if e["event"] == "settle" and e.get("ts", 0) >= since]


def rounds_of(node, size: int, since: float = 0.0) -> list[dict]:
    return [e for e in settles(node, since) if e["status"] == "applied" and e["group_size"] == size]


def test_a_swarm_with_a_client_starts_together_with_wait_peers(tmp_path: Path, reaper) -> None:
    """The client is in nobody's routing table: counted as a routing contact, the two reachable nodes
    each saw one peer and waited forever; counted as members, all three start and average as three."""
    extra = [SHARDS[0], SHARDS[1], [*SHARDS[2], "--reachable", "no"]]
    nodes = start_swarm(reaper, tmp_path, 3, [*SWARM, "--wait-peers", "2"], extra=extra)
    wait_for(lambda: all(rounds_of(n, 3) for n in nodes), 120, "a round of three")
    for node in nodes:  # each found the other two as members, none gave up waiting
        assert "2 peers of the run known" in node.log() and "--wait-peers-timeout" not in node.log()
    stop_all(nodes)
    assert_ledgers_replay(nodes)


def test_a_restarted_first_node_is_in_a_group_of_three_again_within_60_s(tmp_path: Path, reaper) -> None:
    """The node started without --peers, killed -9 and restarted with the same command and ports once
    its peers dropped it: it knocks on the contacts it kept (and they on it), and averages with them."""
    ports = ["--dht-port", str(free_port(socket.SOCK_DGRAM)), "--grpc-port", str(free_port())]
    extra = [[*SHARDS[0], *ports], SHARDS[1], SHARDS[2]]
    nodes = start_swarm(reaper, tmp_path, 3, [*SWARM, "--wait-peers", "2"], extra=extra)
    seed, others = nodes[0], nodes[1:]
    wait_for(lambda: rounds_of(seed, 3), 120, "a round of three")
    wait_for(lambda: (seed.data_dir / "contacts.json").exists(), 60, "the seed to keep its contacts")
    seed.kill()
    wait_for(
        lambda: all(metric_value(o.metrics(), "swarmnode_dht_peers") == 1 for o in others),
        120,
        "the others to drop the dead seed as a contact",
    )
    restarted = time.time()
    seed.restart()
    wait_for(lambda: rounds_of(seed, 3, since=restarted), 60, "the restarted seed in a round of three")
    stop_all(nodes)
    assert_ledgers_replay(nodes)


def test_a_leader_stopped_after_offering_is_passed_over(tmp_path: Path, reaper) -> None:
    """n0 trains fastest, so it offers first and leads; at its second round as leader it stops itself
    (SIGSTOP) after offering. The other two pass it over at its deadline and average as a pair — no
    round alone, no round held — until it is continued 30 s later and catches up. (Before, each waited
    for its proposal, held the round three times, then applied its Δ alone: a fork.)"""
    slow = "sleep@inner_step=0.03"
    nodes = start_swarm(
        reaper,
        tmp_path,
        3,
        [*SWARM, "--wait-peers", "2"],
        faults=["stop@lead_round#2", slow, slow],
        extra=SHARDS,
    )
    leader, others = nodes[0], nodes[1:]
    wait_for(leader.stopped, 120, "the leader to stop itself after offering")
    stopped_at = time.time()
    wait_for(
        lambda: all(len(rounds_of(o, 2, since=stopped_at)) >= 2 for o in others), 60, "two rounds as a pair"
    )
    time.sleep(max(0.0, stopped_at + 30 - time.time()))  # the fault itself: stopped for 30 s
    during = [e for o in others for e in settles(o, since=stopped_at)]
    assert during and {e["group_size"] for e in during} == {2}, during  # averaged as a pair, every round
    assert not [e for e in during if e["status"] in ("solo", "held")], during
    leader.signal(signal.SIGCONT)
    back = time.time()
    wait_for(lambda: rounds_of(leader, 3, since=back), 120, "the leader back in a round of three")
    stop_all(nodes)
    assert_ledgers_replay(nodes)
