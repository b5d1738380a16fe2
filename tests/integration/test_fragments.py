"""`--fragments K` with real `swarmnode run` processes: each round of H/K inner steps averages one
fragment of Δ, the members agree on the global digest after every fragment's step, θ_g moves on that
fragment only, and the ledgers replay (core/fragments.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from test_swarm_averaging import SWARM, digests_by_round, first_round_all_agree

from swarmnode.core.fragments import FragmentPlan
from swarmnode.core.model import build_model
from swarmnode.core.presets import preset
from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot.read import read_snapshot
from swarmtest import NodeProcess, assert_ledgers_replay, cold_metadata, start_swarm, stop_all, wait_for

FRAGMENTED = [*SWARM, "--fragments", "2", "--wire-dtype", "fp32", "--wait-peers", "2"]
ROUND_STEPS = 5  # --inner-steps 10 in two fragments


def global_params(node: NodeProcess, outer_step: int) -> torch.Tensor:
    """θ_g of the node's cold snapshot after `outer_step`, flat in parameter order (the fragments')."""
    names = [name for name, _ in build_model(preset("tiny", 256), 0, torch.device("cpu")).named_parameters()]
    for path in iter_snapshot_files(node.data_dir / "snapshots"):
        kind, outer, _, _ = parse_snapshot_name(path.name)  # type: ignore[misc]
        if kind == "cold" and outer == outer_step:
            tensors = read_snapshot(path).tensors
            return torch.cat([tensors[f"global/{name}"].reshape(-1) for name in names])
    raise AssertionError(f"no cold snapshot at outer step {outer_step} in {node.data_dir}")


def test_a_fragmented_swarm_agrees_after_every_fragment_step_and_moves_one_fragment_each(
    tmp_path: Path, reaper
) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, [*FRAGMENTED, "--max-outer-steps", "4"])
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    metas = [cold_metadata(n) for n in nodes]
    for outer in range(1, 5):
        digests = {m[outer]["global_digest"] for m in metas}
        assert len(digests) == 1, f"round {outer}: {len(digests)} different global digests"
        assert all(m[outer]["inner_step"] == ROUND_STEPS * outer for m in metas)  # rounds of H/K steps
        assert all(len(m[outer]["last_round"]["group"]) == 3 for m in metas)
    plan = FragmentPlan(global_params(nodes[0], 1).numel(), 2)
    # Each all-reduce carried half of Δ: the butterfly's 2(N−1)/N of the fragment's fp32 bytes.
    fragment_bytes = 4 * (plan.fragment(0)[1] - plan.fragment(0)[0])
    for m in metas:
        sent = m[4]["last_round"]["bytes_sent"]
        assert abs(sent - 2 * 2 / 3 * fragment_bytes) <= 64, (sent, fragment_bytes)
    for outer in range(1, 4):  # round `outer` averaged fragment outer mod 2, and moved θ_g only there
        moved = (global_params(nodes[0], outer + 1) != global_params(nodes[0], outer)).nonzero().flatten()
        a, b = plan.for_round(outer)
        assert moved.numel() > 0 and a <= int(moved.min()) and int(moved.max()) < b, (outer, a, b)
    assert_ledgers_replay(nodes)


@pytest.mark.slow
def test_a_node_killed_between_fragment_steps_recovers_and_the_swarm_agrees_again(
    tmp_path: Path, reaper
) -> None:
    args = [*FRAGMENTED, "--allreduce-timeout", "8", "--max-outer-steps", "40", "--hot-every", "3"]
    nodes = start_swarm(reaper, tmp_path, 3, args, faults=[None, None, "kill@inner_step#18"])
    victim = nodes[2]
    assert victim.wait(120) == -signal.SIGKILL  # in round 3 (fragment 1), fragment 0 stepped before
    killed_at = max(digests_by_round(nodes[:2]), default=0)
    victim.restart()
    agreed = wait_for(lambda: first_round_all_agree(nodes, killed_at), 150, "all three digests to agree")
    assert agreed > killed_at
    stop_all(nodes)
    assert_ledgers_replay(nodes)


@pytest.mark.slow
def test_overlapped_fragment_rounds_agree_after_every_step_and_their_ledgers_replay(
    tmp_path: Path, reaper
) -> None:
    nodes = start_swarm(reaper, tmp_path, 3, [*FRAGMENTED, "--overlap", "on", "--max-outer-steps", "6"])
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    metas = [cold_metadata(n) for n in nodes]
    for outer in range(1, 7):
        digests = {m[outer]["global_digest"] for m in metas}
        assert len(digests) == 1, f"round {outer}: {len(digests)} different global digests"
    # The steps did overlap: a fragment's step landed after inner steps of the next fragment round.
    assert max(m[outer]["inner_step"] - ROUND_STEPS * outer for m in metas for outer in range(1, 6)) > 0
    plan = FragmentPlan(global_params(nodes[0], 1).numel(), 2)
    for outer in range(1, 6):
        moved = (global_params(nodes[0], outer + 1) != global_params(nodes[0], outer)).nonzero().flatten()
        a, b = plan.for_round(outer)
        assert moved.numel() > 0 and a <= int(moved.min()) and int(moved.max()) < b, (outer, a, b)
    assert_ledgers_replay(nodes)
