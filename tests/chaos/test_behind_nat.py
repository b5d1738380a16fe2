"""A volunteer behind NAT (docs/design.md "Behind NAT"), on real network namespaces
(`swarmnode.bench.netbed`): three reachable nodes on a bridge, and a fourth in a namespace behind a router
that masquerades it (`iptables -t nat ... MASQUERADE`) and drops every connection from outside, counting
each one.

The node behind NAT finds out by the dial-back probe that it cannot be reached, joins as a client,
averages in every round (coverage 1, its contributions in every part, identical digests), never
reduces or leads, and nobody dials it (zero refused dials at the router after its probe; it is in
nobody's routing table); after a SIGKILL and the loss of its snapshots it recovers from a reachable peer
and averages again. Root only; skips cleanly otherwise.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmnode.bench import netbed
from swarmnode.bench.netbed import Namespace, NetBed, Router
from swarmnode.core.ledger import digests_by_round, read_ledger
from swarmnode.snapshot.format import iter_snapshot_files
from swarmnode.snapshot.read import read_snapshot
from swarmnode.swarm.averaging import codecs
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import (
    NodeProcess,
    assert_ledgers_replay,
    cold_metadata,
    metric_value,
    node_status,
    scrape,
    stop_all,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NET = 200 + os.getpid() % 50
WAN, ROUTER_WAN, LAN, HOME = f"10.{NET}.11.0/24", f"10.{NET}.11.9", f"10.{NET}.12.0/24", f"10.{NET}.12.2"
HOST = f"10.{NET}.11.1"  # the root namespace's address on the WAN bridge: the reachable nodes bind it
SWARM = (
    *("--inner-steps", "30", "--hot-every", "10", "--cold-every", "1", "--keep-cold", "60"),
    *("--matchmaking-timeout", "4", "--allreduce-timeout", "8", "--max-outer-steps", "200"),
    *("--wire-dtype", "fp32", "--run-id", "nat", "--seed", "5"),
)
DEBUG = {"SWARMNODE_LOG_DEBUG": "swarmnode.swarm.averaging.matchmaking"}


@pytest.fixture
def home(reaper) -> Iterator[tuple[NetBed, Router, Namespace]]:
    """The bed; the test's nodes (some run inside its namespaces) are killed before it is taken down."""
    reason = netbed.unavailable()
    if reason is not None:
        pytest.skip(f"no network test bed here: {reason}")
    with NetBed() as bed:
        wan = bed.bridge(WAN)
        router = bed.nat_router("home", wan, ROUTER_WAN, LAN)
        laptop = bed.namespace("laptop")
        bed.attach(laptop, router.lan, HOME)
        bed.route_to(router)  # a dial of the laptop's own address from here reaches the router: counted
        try:
            yield bed, router, laptop
        finally:
            reaper.kill_all()


def cold_rounds(node: NodeProcess) -> dict[int, dict[str, Any]]:
    """outer step -> `last_round` of the node's cold snapshot right after it."""
    return {outer: metadata["last_round"] for outer, metadata in cold_metadata(node).items()}


def delta_length(node: NodeProcess) -> int:
    """The length of the flat pseudo-gradient: the global params' element count."""
    path = next(p for p in iter_snapshot_files(node.data_dir / "snapshots"))
    tensors = read_snapshot(path).tensors
    return sum(t.numel() for name, t in tensors.items() if name.startswith("global/"))


def metrics_inside(ns: Namespace, node: NodeProcess) -> str:
    """The node's metrics, read from inside the laptop's namespace (a call from outside would be a dial)."""
    code = f"from swarmnode.bench.procs import scrape; print(scrape({node.metrics_url!r}))"
    return ns.run([sys.executable, "-c", code], check=False).stdout  # "" until it serves


def wait_for_client_mode(laptop: Namespace, client: NodeProcess, router: Router) -> None:
    """The client's probe found it unreachable: the prober's dial-back was refused at the router (the
    fault fired); then the router's count starts from 0, so any later dial to the client is one too many.
    A prober's dial is over when it answers (`dial_back.connect_once`): none of its SYN retries can reach
    the router after the client counted the answer."""
    metrics = wait_for(
        lambda: (
            (m := metrics_inside(laptop, client))
            and metric_value(m, "swarmnode_reachability_probes_total", 'reason="unreachable"') >= 1
            and m
        ),
        90,
        "the client's dial-back probe",
        interval_s=0.5,
    )
    assert metric_value(metrics, "swarmnode_reachable") == 0
    assert node_status(client, prefix=laptop.prefix)["reachability"] == "client"
    assert router.dial_attempts() >= 1
    router.zero_counters()


def averaged_in(nodes: list[NodeProcess], client: NodeProcess, outer: int) -> bool:
    """Round to `outer` averaged by all, the client included, with all of Δ and identical digests."""
    ids = {n.info["node_id"] for n in nodes}
    digests = {digests_by_round(read_ledger(n.data_dir)).get(outer) for n in nodes}
    last = cold_rounds(client).get(outer)
    return (
        last is not None
        and last["coverage"] == 1.0
        and set(last["group"]) == set(last["included"]) == ids
        and len(digests) == 1
        and None not in digests
    )


def first_round_with_client(nodes: list[NodeProcess], client: NodeProcess, after: int = -1) -> int | None:
    """The first round after `after` in a group of all the nodes to which the client contributed: a
    client that joins while the others are a round ahead is repaired and sits its first round out
    with weight 0 (nothing sent), by design."""
    ids = {n.info["node_id"] for n in nodes}
    rounds = sorted(
        o
        for o, last in cold_rounds(client).items()
        if o > after and set(last["group"]) == ids and last["bytes_sent"] > 0
    )
    return rounds[0] if rounds else None


def check_rounds(nodes: list[NodeProcess], client: NodeProcess, first: int, count: int, n: int) -> None:
    """Rounds first..first+count-1: the client averaged in each, as a member that reduces nothing: it
    sent its whole Δ (every part is a reducer's) and no result."""
    last = first + count - 1
    wait_for(
        lambda: all(last in cold_rounds(x) for x in nodes), 240, f"round {last} on every node", interval_s=0.5
    )
    for outer in range(first, last + 1):
        assert averaged_in(nodes, client, outer), (outer, cold_rounds(client).get(outer))
        assert cold_rounds(client)[outer]["bytes_sent"] == codecs.encoded_size("fp32", n)


def test_a_node_behind_nat_trains_averages_recovers_and_is_never_dialled(
    tmp_path: Path, reaper, home: tuple[NetBed, Router, Namespace]
) -> None:
    _, router, laptop = home
    public = [*SWARM, "--host", HOST, "--wait-peers", "2"]
    seed = reaper.node(tmp_path / "n0", [*public, "--shard", "0"], env=DEBUG).start()
    peers = ["--peers", f"{HOST}:{seed.wait_ready()['dht_port']}"]
    auto = ["--reachable", "auto"]  # overrides the harness's loopback default (yes)
    others = [
        reaper.node(tmp_path / f"n{i}", [*public, f"--shard={i}", *peers, *auto], env=DEBUG).start()
        for i in (1, 2)
    ]
    reachable = [seed, *others]
    for node in others:
        node.wait_ready()
    wait_for(
        lambda: all(cold_rounds(x) for x in reachable),
        180,
        "the reachable nodes' first round",
        interval_s=0.5,
    )

    client_args = [*SWARM, "--host", HOME, "--shard", "3", *peers, *auto]
    client = reaper.node(tmp_path / "nat", client_args, env=DEBUG, prefix=laptop.prefix).start()
    client.wait_ready()
    wait_for_client_mode(laptop, client, router)

    everyone = [*reachable, client]
    first = wait_for(
        lambda: first_round_with_client(everyone, client), 180, "the client in a group of 4", interval_s=0.5
    )
    n = delta_length(client)
    check_rounds(everyone, client, first, 4, n)
    for node in reachable:
        assert node_status(node)["reachability"] == "reachable"
        assert metric_value(scrape(node), "swarmnode_dht_peers") == 2  # the client is in no routing table
    assert router.dial_attempts() == 0, "a peer dialled the client"
    log = client.log()
    assert "fetched group" in log and "leading group" not in log

    client.kill()  # SIGKILL, and its snapshots are gone: it must come back from a reachable peer
    shutil.rmtree(client.data_dir / "snapshots")
    killed_at = max(cold_rounds(seed))
    client.restart().wait_ready()
    wait_for_client_mode(laptop, client, router)  # it probes again at start
    receipt = wait_for(lambda: read_receipts(client.data_dir)[1:], 120, "the client's restart")[-1]
    assert receipt["source"] == "peer" and receipt["peer"].startswith(f"{HOST}:"), receipt
    again = wait_for(
        lambda: first_round_with_client(everyone, client, max(killed_at, receipt["outer_step"])),
        180,
        "the client averaging again",
        interval_s=0.5,
    )
    check_rounds(everyone, client, again, 2, n)
    assert router.dial_attempts() == 0, "a peer dialled the client"
    stop_all([*reachable, client], timeout_s=90)
    assert client.exit_code() == 0
    assert_ledgers_replay(everyone)
