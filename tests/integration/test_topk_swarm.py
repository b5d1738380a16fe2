"""A top-k swarm (`--wire-dtype topk`): real `swarmnode run` processes send about 1% of their
pseudo-gradients and still agree on one global model every round; their ledgers replay."""

from __future__ import annotations

from pathlib import Path

from test_swarm_averaging import SWARM

from swarmtest import assert_ledgers_replay, cold_metadata, start_swarm


def test_three_topk_nodes_agree_on_one_digest_every_round_and_their_ledgers_replay(
    tmp_path: Path, reaper
) -> None:
    args = [*SWARM, "--wire-dtype", "topk", "--max-outer-steps", "3", "--wait-peers", "2"]
    nodes = start_swarm(reaper, tmp_path, 3, args)
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    metas = [cold_metadata(n) for n in nodes]
    ids = {n.info["node_id"] for n in nodes}
    for outer in (1, 2, 3):
        assert len({m[outer]["global_digest"] for m in metas}) == 1, f"digests differ after round {outer}"
        assert len({m[outer]["run_digest"] for m in metas}) == 1
        assert set(metas[0][outer]["last_round"]["included"]) == ids, metas[0][outer]["last_round"]
    losses = [metas[0][outer]["heldout_loss"] for outer in (1, 2, 3)]
    assert losses[-1] < losses[0], losses
    assert_ledgers_replay(nodes)


def test_three_topk_nodes_with_overlap_agree_every_round_and_the_overlap_stays_in_the_next_round(
    tmp_path: Path, reaper
) -> None:
    args = [*SWARM, "--wire-dtype", "topk", "--overlap", "on", "--max-outer-steps", "3", "--wait-peers", "2"]
    nodes = start_swarm(reaper, tmp_path, 3, args)
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    metas = [cold_metadata(n) for n in nodes]
    for outer in (1, 2, 3):
        assert len({m[outer]["global_digest"] for m in metas}) == 1, f"digests differ after round {outer}"
    # A round's step landed after inner steps of the next one (blocking rounds land at exactly 10 inner
    # steps per outer step), and those steps stayed in the next round.
    overlapped = [m[outer]["inner_step"] - 10 * outer for m in metas for outer in (1, 2)]
    assert max(overlapped) > 0, overlapped
    assert all(
        m[outer]["round_step"] == m[outer]["inner_step"] - 10 * outer for m in metas for outer in (1, 2)
    )
    losses = [metas[0][outer]["heldout_loss"] for outer in (1, 2, 3)]
    assert losses[-1] < losses[0], losses
    assert_ledgers_replay(nodes)
