"""A `--precision bf16` swarm: real `swarmnode run` processes train under bf16 autocast (the CPU runs
it too) and still average into one global model, one digest per round, every round."""

from __future__ import annotations

from pathlib import Path

from test_swarm_averaging import SWARM

from swarmtest import cold_metadata, start_swarm


def test_two_bf16_nodes_average_with_one_digest_per_round(tmp_path: Path, reaper) -> None:
    args = [*SWARM, "--precision", "bf16", "--max-outer-steps", "2", "--wait-peers", "1"]
    nodes = start_swarm(reaper, tmp_path, 2, args)
    for node in nodes:
        assert node.wait(120) == 0, node.log()[-3000:]
        assert "in bf16" in node.log()  # the node says what it trains in
    metas = [cold_metadata(n) for n in nodes]
    for outer in (1, 2):
        assert len({m[outer]["global_digest"] for m in metas}) == 1, f"digests differ after round {outer}"
        assert len({m[outer]["run_digest"] for m in metas}) == 1
        assert set(metas[0][outer]["swarm_cursors"]) == {n.info["node_id"] for n in nodes}
