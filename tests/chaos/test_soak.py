"""The kill soak: a three-node loopback swarm of real processes under a random SIGKILL every 20–40 s
for eight minutes (any phase: inner steps, snapshot writes, matchmaking, the all-reduce, a recovery
download). Afterwards every ledger replays, no chain keeps a round whose average left it out
(`ledger.cross_check`), the swarm's model holds each node at a point of its chain, and the digests
agree again. Marked `slow`: `pytest -m slow tests/chaos/test_soak.py`."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from swarmnode.bench.procs import free_port
from swarmnode.core.ledger import read_ledger
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import NodeProcess, assert_ledgers_replay, first_agreed_round, stop_all, wait_for

SOAK_S = float(os.environ.get("SWARMNODE_SOAK_SECONDS", 480))
KILL_EVERY_S = (20.0, 40.0)
SEED = int(os.environ.get("SWARMNODE_SOAK_SEED", 16))
ARGS = (
    "--inner-steps",
    "30",
    "--hot-every",
    "3",
    "--cold-every",
    "1",
    "--matchmaking-timeout",
    "4",
    "--allreduce-timeout",
    "6",
    "--wait-peers",
    "1",
    "--run-id",
    "soak",
    "--seed",
    "3",
)


def pause(seconds: float) -> None:
    """The soak's schedule itself (the faults are random times by design, not waits for an event)."""
    threading.Event().wait(seconds)


def digests(nodes: list[NodeProcess]) -> dict[int, dict[str, str]]:
    from swarmnode.core.ledger import digests_by_round

    rounds: dict[int, dict[str, str]] = {}
    for node in nodes:
        for outer, digest in digests_by_round(read_ledger(node.data_dir)).items():
            rounds.setdefault(outer, {})[node.data_dir.name] = digest
    return rounds


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 600)
def test_random_kills_for_minutes_lose_no_batch_and_the_swarm_agrees(tmp_path: Path, reaper) -> None:
    rng = random.Random(SEED)
    dht_ports = [free_port(socket.SOCK_DGRAM) for _ in range(3)]
    nodes = []
    for i, port in enumerate(dht_ports):  # fixed DHT ports: a restarted node is found where it was
        peers = ",".join(f"127.0.0.1:{p}" for p in dht_ports if p != port)
        args = [*ARGS, "--shard", str(i), "--dht-port", str(port), "--peers", peers]
        nodes.append(reaper.node(tmp_path / f"n{i}", args).start())
    for node in nodes:
        node.wait_ready()
    wait_for(lambda: max(digests(nodes), default=0) >= 2, 120, "two rounds before the first kill")
    kills: list[str] = []
    ends = time.monotonic() + SOAK_S
    while time.monotonic() < ends:
        pause(rng.uniform(*KILL_EVERY_S))
        victim = rng.choice(nodes)
        victim.signal(signal.SIGKILL)
        victim.wait(10)
        kills.append(victim.data_dir.name)
        pause(rng.uniform(0.0, 3.0))
        victim.restart()
    for node in nodes:  # every kill came back through a recovery (or it is still coming back)
        starts = 1 + kills.count(node.data_dir.name)
        wait_for(
            lambda n=node, s=starts: len(read_receipts(n.data_dir)) >= s, 120, f"{node.data_dir.name} back"
        )
    last = max(digests(nodes), default=0)
    agreed = wait_for(lambda: first_agreed_round(digests(nodes), 3, last), 180, "all three digests to agree")
    stop_all(nodes)
    assert len(kills) >= SOAK_S / KILL_EVERY_S[1] - 1, kills
    assert_ledgers_replay(nodes)
    rounds = max(digests(nodes))
    print(f"soak seed {SEED}: {len(kills)} kills {kills}, {rounds} rounds, agreed again at round {agreed}")
