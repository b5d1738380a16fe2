"""`--overlap on` with real `swarmnode run` processes: a round's all-reduce runs while the next inner
phase trains, and every invariant of blocking rounds still holds (node/overlap.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_swarm_averaging import SWARM, digests_by_round, first_round_all_agree

from swarmtest import assert_ledgers_replay, cold_metadata, start_swarm, stop_all, wait_for

OVERLAP = [*SWARM, "--overlap", "on", "--wire-dtype", "fp32", "--wait-peers", "2"]


@pytest.mark.slow
def test_an_overlapped_swarm_agrees_after_every_round_and_its_ledgers_replay(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, [*OVERLAP, "--max-outer-steps", "4"])
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    metas = [cold_metadata(n) for n in nodes]
    for outer in range(1, 5):
        digests = {m[outer]["global_digest"] for m in metas}
        assert len(digests) == 1, f"round {outer}: {len(digests)} different global digests"
    # The steps did overlap: a round's outer step landed after inner steps of the next round (blocking
    # rounds land at exactly 10 inner steps per outer step), and those steps stayed in the next round.
    overlapped = [m[outer]["inner_step"] - 10 * outer for m in metas for outer in range(1, 4)]
    assert max(overlapped) > 0, overlapped
    assert all(
        m[outer]["round_step"] == m[outer]["inner_step"] - 10 * outer for m in metas for outer in (1, 2)
    )
    losses = [metas[0][outer]["heldout_loss"] for outer in range(1, 5)]
    assert losses[-1] < losses[0], losses
    assert_ledgers_replay(nodes)


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["fp32", "topk"])
def test_a_node_killed_mid_overlap_recovers_and_the_swarm_agrees_again(
    tmp_path: Path, reaper, wire: str
) -> None:
    args = [
        *OVERLAP,
        "--wire-dtype",
        wire,
        "--allreduce-timeout",
        "8",
        "--max-outer-steps",
        "40",
        "--hot-every",
        "5",
    ]
    nodes = start_swarm(reaper, tmp_path, 3, args, faults=[None, None, "kill@overlap_step#15"])
    victim = nodes[2]
    assert victim.wait(120) == -signal.SIGKILL  # the fault fired: killed with a round in flight
    killed_at = max(digests_by_round(nodes[:2]), default=0)
    victim.restart()
    agreed = wait_for(lambda: first_round_all_agree(nodes, killed_at), 150, "all three digests to agree")
    assert agreed > killed_at
    stop_all(nodes)
    assert_ledgers_replay(nodes)
