"""A swarm larger than --group-size: real `swarmnode run` processes average each round in several
groups and then among the groups' leaders (swarm/averaging/grouping.py), and still hold one model after every
round, with every ledger replaying."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_swarm_averaging import SWARM

from swarmtest import assert_ledgers_replay, cold_metadata, start_swarm, stop_all

pytestmark = pytest.mark.timeout(900)


def grouped_swarm_args(count: int, group_size: int, rounds: int) -> list[str]:
    return [
        *SWARM,
        "--max-outer-steps",
        str(rounds),
        "--wait-peers",
        str(count - 1),
        "--group-size",
        str(group_size),
    ]


def assert_one_model_after_every_round(nodes, rounds: int, groups: int, everyone: bool = True) -> None:
    """Every node holds the same global params after each round; each round averaged in `groups`
    groups, wholly, with every one of `nodes` (everyone: and no other) included."""
    metas = [cold_metadata(n) for n in nodes]
    ids = {n.info["node_id"] for n in nodes}
    for outer in range(1, rounds + 1):
        digests = {m[outer]["global_digest"] for m in metas}
        assert len(digests) == 1, f"round {outer}: {len(digests)} different global digests"
        last = metas[0][outer]["last_round"]
        assert last["groups"] == groups and last["coverage"] == 1.0, (outer, last)
        if everyone:
            assert set(last["group"]) == set(last["included"]) == ids, (outer, last)
        else:  # the slow member may be in it (with weight 0 when it came in late) or not
            assert ids <= set(last["included"]), (outer, last)


def test_six_nodes_in_groups_of_three_hold_one_model_after_every_round(tmp_path: Path, reaper) -> None:
    count, rounds = 6, 3
    extra = [["--shard", str(i)] for i in range(count)]
    nodes = start_swarm(reaper, tmp_path, count, grouped_swarm_args(count, 3, rounds), extra=extra)
    for node in nodes:
        assert node.wait(300) == 0, node.log()[-3000:]
    assert_one_model_after_every_round(nodes, rounds, groups=2)
    assert_ledgers_replay(nodes)


@pytest.mark.slow
def test_sixteen_nodes_in_groups_of_four_run_six_rounds(tmp_path: Path, reaper) -> None:
    count, rounds = 16, 6
    extra = [["--shard", str(i)] for i in range(count)]
    started = time.monotonic()
    nodes = start_swarm(reaper, tmp_path, count, grouped_swarm_args(count, 4, rounds), extra=extra)
    for node in nodes:
        assert node.wait(900) == 0, node.log()[-3000:]
    print(f"16 nodes, 6 rounds: {time.monotonic() - started:.0f} s")
    assert_one_model_after_every_round(nodes, rounds, groups=4)
    assert_ledgers_replay(nodes)


@pytest.mark.slow
def test_a_slow_member_of_sixteen_costs_the_others_at_most_one_matchmaking_timeout(
    tmp_path: Path, reaper
) -> None:
    count, timeout_s = 16, 4.0
    args = [*grouped_swarm_args(count, 4, 8), "--matchmaking-timeout", str(timeout_s)]
    extra = [["--shard", str(i)] for i in range(count)]
    faults = [None] * (count - 1) + ["sleep@inner_step=1.0"]  # 10 inner steps: 10 s behind the rest
    nodes = start_swarm(reaper, tmp_path, count, args, faults=faults, extra=extra)
    fast, slow = nodes[:-1], nodes[-1]
    for node in fast:
        assert node.wait(900) == 0, node.log()[-3000:]
    stop_all([slow])
    slow_id = slow.info["node_id"]
    for node in fast:
        for outer, meta in sorted(cold_metadata(node).items()):
            last = meta["last_round"]
            # the slow member never holds a round past the leader's deadline (plus the proposal's trip)
            assert last["matchmaking_seconds"] <= timeout_s + 1.5, (node.data_dir.name, outer, last)
    without = [m for m in cold_metadata(fast[0]).values() if slow_id not in m["last_round"]["group"]]
    assert without, "the slow member was never left out: the fault did not slow it"
    assert_one_model_after_every_round(fast, 8, groups=4, everyone=False)
    assert_ledgers_replay(nodes)
