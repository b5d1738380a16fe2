"""Chaos cell: a flood of forged Kademlia pings against a running swarm (docs/design.md "The swarm", DHT).

A three-node loopback swarm of real `swarmnode run` processes measures its round rate from the nodes'
ledgers; then one UDP socket sends 2,000 pings from random node ids to every node's DHT port and never
answers anything. Forged contacts must not enter the routing tables, so the swarm keeps its round rate.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import umsgpack

from swarmnode.core.ledger import read_ledger
from swarmtest import NodeProcess, metric_value, scrape, start_swarm, stop_all, wait_for

SWARM = (
    "--inner-steps",
    "10",
    "--hot-every",
    "5",
    "--cold-every",
    "5",
    "--matchmaking-timeout",
    "4",
    "--allreduce-timeout",
    "6",
    "--wait-peers",
    "2",
    "--max-outer-steps",
    "1000",
    "--run-id",
    "flood",
    "--seed",
    "5",
)
SHARDS = [["--shard", str(i)] for i in range(3)]
FLOOD = 2000
"""Forged pings sent to each node."""
BATCH = 100
"""Pings sent to each node before the flooder waits for them to arrive (none lost in a socket buffer)."""
ROUNDS = 20
"""Rounds per measured window."""
MIN_RATE_RATIO = 0.8
"""The rate of rounds during and after the flood, as a share of the rate before it, at least."""


def applied_rounds(nodes: list[NodeProcess]) -> int:
    """Rounds every node has settled as applied (averaged in a group), from their ledgers."""
    counts = [
        sum(1 for e in read_ledger(n.data_dir) if e["event"] == "settle" and e["status"] == "applied")
        for n in nodes
    ]
    return min(counts)


def throttled(node: NodeProcess) -> float:
    return metric_value(scrape(node), "swarmnode_dht_rejected_records_total", 'reason="throttled"')


def dht_peers(node: NodeProcess) -> float:
    return metric_value(scrape(node), "swarmnode_dht_peers")


class Flooder:
    """One UDP socket that sends rpcudp pings from random node ids and never answers anything; a thread
    reads what comes back (so no answer is lost in a full socket buffer) and counts the answers."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)  # how soon the reader notices `close`
        self.answers: Counter[int] = Counter()  # ping answers received, per DHT port
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="flood-reader", daemon=True)
        self._reader.start()

    def ping(self, port: int) -> None:
        body = umsgpack.packb(["ping", [os.urandom(20)]])
        self.sock.sendto(b"\x00" + os.urandom(20) + body, ("127.0.0.1", port))

    def _read(self) -> None:
        """Count answers; the nodes' requests (verification pings, hand-offs) are read and ignored."""
        while not self._closed.is_set():
            try:
                data, (_, port) = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            if data[:1] == b"\x01":
                self.answers[port] += 1

    def flood(self, nodes: list[NodeProcess], count: int) -> None:
        """`count` pings to each node, in batches; each batch answered or counted as throttled by every
        node before the next is sent."""
        ports = {node: node.info["dht_port"] for node in nodes}
        for sent in range(BATCH, count + BATCH, BATCH):
            for port in ports.values():
                for _ in range(BATCH):
                    self.ping(port)

            def arrived(sent: int = sent) -> bool:
                return all(self.answers[port] + throttled(node) >= sent for node, port in ports.items())

            wait_for(arrived, 60, f"{sent} forged pings to arrive at every node")

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self.sock.close()


@pytest.mark.slow
def test_a_flood_of_forged_pings_does_not_slow_the_swarms_rounds(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, SWARM, extra=SHARDS)
    wait_for(lambda: applied_rounds(nodes) >= 3, 180, "the swarm to average three rounds")
    start, started = applied_rounds(nodes), time.monotonic()
    wait_for(lambda: applied_rounds(nodes) >= start + ROUNDS, 300, f"{ROUNDS} rounds before the flood")
    before_s = time.monotonic() - started
    rate_before = ROUNDS / before_s

    flooder = Flooder()
    try:
        start, started = applied_rounds(nodes), time.monotonic()
        flooder.flood(nodes, FLOOD)
        flood_s = time.monotonic() - started
        peers_after_flood = [dht_peers(n) for n in nodes]
        allowed_s = ROUNDS / (MIN_RATE_RATIO * rate_before)
        try:
            wait_for(lambda: applied_rounds(nodes) >= start + ROUNDS, allowed_s, f"{ROUNDS} rounds")
        except Exception:
            done = applied_rounds(nodes) - start
            raise AssertionError(
                f"{done} rounds in {allowed_s:.0f} s after the flood; {ROUNDS} in {before_s:.0f} s before"
            ) from None
        after_s = time.monotonic() - started
    finally:
        flooder.close()

    rejected = [throttled(n) for n in nodes]
    answered = [flooder.answers[n.info["dht_port"]] for n in nodes]
    peers = [dht_peers(n) for n in nodes]
    print(
        f"\nrounds/min before {60 * rate_before:.1f}, during and after the flood {60 * ROUNDS / after_s:.1f}"
        f" (flood {flood_s:.1f} s); answered {answered}, throttled {rejected}; routing tables"
        f" {peers_after_flood} after the flood, {peers} at the end"
    )
    assert ROUNDS / after_s >= MIN_RATE_RATIO * rate_before
    for answers, dropped in zip(answered, rejected, strict=True):
        assert dropped >= FLOOD / 2 and answers + dropped >= FLOOD  # the flood arrived, mostly throttled
    assert all(p <= len(nodes) - 1 for p in [*peers_after_flood, *peers]), (peers_after_flood, peers)
    stop_all(nodes)
