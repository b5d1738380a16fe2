"""A swarm a bad member cannot steer: real `swarmnode run` processes (tiny model, pinned shards, fixed
identities) with one member that lies in its all-reduce headers or poisons its pseudo-gradient
(fault points `lie@sender`, `lie@part`, `scale@delta`, `nan@delta`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmnode.net.identity import Identity
from swarmtest import NodeProcess, cold_metadata, start_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 2
SWARM = (
    "--inner-steps",
    "10",
    "--hot-every",
    "1000",
    "--cold-every",
    "1",
    "--keep-cold",
    "100",
    "--matchmaking-timeout",
    "15",
    "--allreduce-timeout",
    "20",
    "--seed",
    "5",
    "--run-id",
    "poison",
    "--max-outer-steps",
    str(ROUNDS),
)


@pytest.fixture(scope="module")
def identities(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("identities")
    for i in range(3):
        Identity.load_or_create(root / f"id{i}.key")
    return [root / f"id{i}.key" for i in range(3)]


def run_swarm(reaper, base: Path, identities: list[Path], faults: list[str | None]) -> list[NodeProcess]:
    """len(faults) nodes that start together (node i: shard i, identity i), average ROUNDS rounds and
    exit 0."""
    count = len(faults)
    extra = [["--identity", str(identities[i]), "--shard", str(i)] for i in range(count)]
    nodes = start_swarm(reaper, base, count, [*SWARM, "--wait-peers", str(count - 1)], faults, extra)
    for node in nodes:
        assert node.wait(400) == 0, node.log_tail()
    return nodes


def after_round(node: NodeProcess, outer_step: int = 1) -> dict:
    """The metadata of the node's cold snapshot written after its outer step `outer_step` - 1."""
    found = cold_metadata(node).get(outer_step)
    assert found is not None, f"no cold snapshot at outer step {outer_step} in {node.data_dir}"
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory, identities) -> list[dict]:
    """The two honest members alone: their state after round 0."""
    from swarmtest import ProcessReaper

    reaper = ProcessReaper()
    try:
        nodes = run_swarm(reaper, tmp_path_factory.mktemp("reference"), identities, [None, None])
        return [after_round(node) for node in nodes]
    finally:
        reaper.kill_all()


@pytest.mark.parametrize("fault", ["scale@delta#1=1000", "nan@delta#1"])
def test_a_poisoner_is_left_out_and_the_survivors_loss_matches_a_round_without_it(
    tmp_path: Path, reaper, identities, reference, fault: str
) -> None:
    nodes = run_swarm(reaper, tmp_path, identities, [None, None, fault])
    honest = [after_round(node) for node in nodes[:2]]
    poisoner_id = nodes[2].info["node_id"]
    for meta in honest:
        assert len(meta["last_round"]["group"]) == 3, meta["last_round"]  # it was in the group
        assert poisoner_id not in meta["last_round"]["included"], meta["last_round"]
    assert honest[0]["global_digest"] == honest[1]["global_digest"]
    reason = "norm" if fault.startswith("scale") else "nonfinite"
    for node in nodes[:2]:
        assert "'s contribution out of part" in node.log() and reason in node.log(), node.log_tail()
    for meta, ref in zip(honest, reference, strict=True):
        assert abs(meta["heldout_loss"] - ref["heldout_loss"]) <= 0.01 * ref["heldout_loss"], (meta, ref)


@pytest.mark.parametrize("fault", ["lie@sender", "lie@part"])
def test_a_lying_member_is_refused_and_the_others_agree(
    tmp_path: Path, reaper, identities, fault: str
) -> None:
    nodes = run_swarm(reaper, tmp_path, identities, [None, None, fault])
    liar_id = nodes[2].info["node_id"]
    for outer in range(1, ROUNDS + 1):
        honest = [after_round(node, outer) for node in nodes[:2]]
        assert honest[0]["global_digest"] == honest[1]["global_digest"], outer
        for meta in honest:
            assert liar_id not in meta["last_round"]["included"], meta["last_round"]
    first = after_round(nodes[0])["last_round"]
    assert len(first["group"]) == 3 and first["coverage"] == 1.0, first  # the liar's own part too
    why = "impersonation" if fault == "lie@sender" else "invalid"
    for node in nodes[:2]:
        assert "refused an averaging call" in node.log() and why in node.log(), node.log_tail()
