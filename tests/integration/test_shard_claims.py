"""Shards claimed in the DHT by real `swarmnode run` processes: a swarm of 4 over 8 shards never shares
one, and a node killed for good has its shard taken over at its committed cursor, every window once."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from test_swarm_averaging import SWARM

from swarmnode.cli.main import main
from swarmnode.core.ledger import read_ledger
from swarmtest import assert_ledgers_replay, start_swarm, wait_for

pytestmark = pytest.mark.timeout(900)


def kept_shard(data_dir: Path) -> int:
    return int(json.loads((data_dir / "shard.json").read_text())["shard"])


def settled_rounds(data_dir: Path) -> int:
    return sum(1 for e in read_ledger(data_dir) if e["event"] == "settle" and e["status"] == "applied")


def test_four_nodes_over_eight_shards_never_share_one(tmp_path: Path, reaper, capsys) -> None:
    args = [*SWARM, "--num-shards", "8", "--max-outer-steps", "2", "--wait-peers", "3"]
    nodes = start_swarm(reaper, tmp_path, 4, args)
    for node in nodes:
        assert node.wait(300) == 0, node.log_tail()
    shards = [kept_shard(node.data_dir) for node in nodes]
    assert len(set(shards)) == 4, shards
    assert_ledgers_replay(nodes)
    assert main(["ledger", "check", *(str(n.data_dir) for n in nodes)]) == 0
    out = capsys.readouterr().out
    assert all(f"shard {s}: " in out for s in shards), out


@pytest.mark.slow
def test_a_node_killed_for_good_has_its_shard_taken_over_at_its_committed_cursor(
    tmp_path: Path, reaper, capsys
) -> None:
    ttl_s, rounds = 3.0, 8
    args = [*SWARM, "--num-shards", "4", "--shard-claim-ttl", str(ttl_s), "--max-outer-steps", str(rounds)]
    first, victim, third = start_swarm(reaper, tmp_path, 3, [*args, "--wait-peers", "2"])
    wait_for(lambda: settled_rounds(victim.data_dir) >= 2, 300, "the victim to settle two rounds")
    victim.signal(signal.SIGKILL)
    victim.wait(30)
    # The claim protocol's own bound: a claim lapses ttl_s after its node stopped re-announcing it.
    time.sleep(ttl_s + 1)
    peers = ["--peers", f"127.0.0.1:{first.info['dht_port']}"]
    taker = reaper.node(tmp_path / "taker", [*args, *peers]).start()
    for node in (first, third, taker):
        assert node.wait(600) == 0, node.log_tail()
    assert kept_shard(taker.data_dir) == kept_shard(victim.data_dir)
    adopts = [e for e in read_ledger(taker.data_dir) if e["event"] == "adopt"]
    assert adopts[0]["source"] == "takeover" and adopts[0]["cursor"]["position"] > 0, adopts
    assert_ledgers_replay([first, third, taker])
    dirs = [str(n.data_dir) for n in (first, victim, third, taker)]
    assert main(["ledger", "check", *dirs]) == 0, capsys.readouterr().out
    line = next(
        x
        for x in capsys.readouterr().out.splitlines()
        if x.startswith(f"shard {kept_shard(victim.data_dir)}:")
    )
    assert victim.info["node_id"][:12] in line and taker.info["node_id"][:12] in line, line
