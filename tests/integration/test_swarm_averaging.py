"""The swarm trains one model: real `swarmnode run` processes average their pseudo-gradients over gRPC."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from swarmnode.data import ShardLoader, default_corpus
from swarmnode.diloco import AveragedDelta, DilocoConfig, DilocoTrainer
from swarmnode.model import build_model, preset
from swarmnode.recovery import read_receipts
from swarmnode.snapshot import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot_read import read_header, read_snapshot
from swarmtest import (
    NodeProcess,
    assert_ledgers_replay,
    first_agreed_round,
    metric_value,
    node_status,
    scrape,
    start_swarm,
    stop_all,
    wait_for,
)

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
    "10",
    "--allreduce-timeout",
    "20",
    "--seed",
    "5",
    "--run-id",
    "avg",
)


def cold_metadata(node: NodeProcess) -> dict[int, dict]:
    """outer step -> metadata of the node's cold snapshot written right after that outer step."""
    found = {}
    for path in iter_snapshot_files(node.data_dir / "snapshots"):
        kind, outer, _, _ = parse_snapshot_name(path.name)
        if kind == "cold":
            found[outer] = read_header(path).metadata
    return found


def cold_global(node: NodeProcess, outer_step: int) -> torch.Tensor:
    for path in iter_snapshot_files(node.data_dir / "snapshots"):
        kind, outer, _, _ = parse_snapshot_name(path.name)
        if kind == "cold" and outer == outer_step:
            tensors = read_snapshot(path).tensors
            return torch.cat([t.reshape(-1) for n, t in tensors.items() if n.startswith("global/")])
    raise AssertionError(f"no cold snapshot at outer step {outer_step} in {node.data_dir}")


def reference_globals(shards: list[int], rounds: int, inner_steps: int) -> list[torch.Tensor]:
    """DiLoCo over the same two batch streams in one process: θ_g after each round."""
    torch.set_num_threads(1)
    corpus = default_corpus()
    cfg = DilocoConfig()
    trainers, loaders = [], []
    for shard in shards:
        model = build_model(preset("tiny", 256), 5, torch.device("cpu"))
        trainers.append(DilocoTrainer(model, cfg, torch.device("cpu")))
        loaders.append(ShardLoader(corpus, shard, 16, 4, 64, seed=5))
    history = []
    for _ in range(rounds):
        for trainer, loader in zip(trainers, loaders, strict=True):
            for _ in range(inner_steps):
                trainer.inner_step(loader.next_batch())
        deltas = [t.pseudo_gradient().clone() for t in trainers]
        mean = (deltas[0] + deltas[1]) / 2  # equal token weights
        for trainer in trainers:
            trainer.outer_step(AveragedDelta(mean, ((0, mean.numel()),), 2))
        history.append(trainers[0].global_flat.clone())
    return history


def test_two_nodes_fp32_match_a_single_process_reference(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(
        reaper, tmp_path, 2, [*SWARM, "--wire-dtype", "fp32", "--max-outer-steps", "3", "--wait-peers", "1"]
    )
    shards = [n.info["shard"] for n in nodes]
    for node in nodes:
        assert node.wait(120) == 0, node.log()[-3000:]
    expected = reference_globals(shards, 3, 10)
    for outer in (1, 2, 3):
        metas = [cold_metadata(n)[outer] for n in nodes]
        assert len({m["global_digest"] for m in metas}) == 1, f"digests differ after round {outer}"
        assert set(metas[0]["swarm_cursors"]) == {n.info["node_id"] for n in nodes}
        torch.testing.assert_close(cold_global(nodes[0], outer), expected[outer - 1], rtol=0, atol=1e-6)


def test_four_nodes_agree_after_every_round_and_heldout_loss_falls(tmp_path: Path, reaper) -> None:
    nodes = start_swarm(reaper, tmp_path, 4, [*SWARM, "--max-outer-steps", "5", "--wait-peers", "3"])
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    metas = [cold_metadata(n) for n in nodes]
    for outer in range(1, 6):
        digests = {m[outer]["global_digest"] for m in metas}
        assert len(digests) == 1, f"round {outer}: {len(digests)} different global digests"
    losses = [metas[0][outer]["heldout_loss"] for outer in range(1, 6)]
    assert losses[-1] < losses[0], losses


def digests_by_round(nodes: list[NodeProcess]) -> dict[int, dict[str, str]]:
    """outer step -> {node id: global digest} over every node's cold snapshots."""
    rounds: dict[int, dict[str, str]] = {}
    for node in nodes:
        for outer, meta in cold_metadata(node).items():
            rounds.setdefault(outer, {})[meta["node_id"]] = meta["global_digest"]
    return rounds


def first_round_all_agree(nodes: list[NodeProcess], after: int) -> int | None:
    """The first outer step past `after` at which every node wrote a cold snapshot with one digest."""
    return first_agreed_round(digests_by_round(nodes), len(nodes), after)


def test_a_member_killed_mid_allreduce_costs_a_timeout_not_the_round(tmp_path: Path, reaper) -> None:
    args = [
        *SWARM,
        "--allreduce-timeout",
        "8",
        "--wire-dtype",
        "fp32",
        "--max-outer-steps",
        "40",
        "--wait-peers",
        "3",
    ]
    nodes = start_swarm(reaper, tmp_path, 4, args, faults=[None, None, None, "kill@allreduce_send#4"])
    victim, survivors = nodes[3], nodes[:3]
    assert victim.wait(120) == -signal.SIGKILL
    partial = wait_for(
        lambda: [
            s
            for s in map(node_status, survivors)
            if s["last_coverage"] is not None and s["last_coverage"] < 1
        ],
        60,
        "the survivors' round with a dead member",
    )
    assert partial, "no survivor reported coverage < 1"
    rounds = digests_by_round(survivors)
    for outer, digests in rounds.items():
        assert len(set(digests.values())) == 1, f"survivors disagree after round {outer}"
    killed_at = max(rounds)
    victim.restart()
    agreed = wait_for(lambda: first_round_all_agree(nodes, killed_at), 120, "all four digests to agree")
    receipts = (victim.data_dir / "receipts.jsonl").read_text()
    assert '"source": "peer"' in receipts or '"source": "local"' in receipts
    assert agreed <= max(digests_by_round([victim])) + 2
    stop_all(nodes)
    assert_ledgers_replay(nodes)


def test_a_late_joiner_catches_up_and_joins_a_group(tmp_path: Path, reaper) -> None:
    args = [*SWARM, "--max-outer-steps", "40"]
    nodes = start_swarm(reaper, tmp_path, 3, args, extra=[["--wait-peers", "2"]] * 3)
    wait_for(lambda: max(digests_by_round(nodes), default=0) >= 3, 120, "three rounds")
    seed_dht = nodes[0].info["dht_port"]
    late = reaper.node(tmp_path / "late", [*args, "--peers", f"127.0.0.1:{seed_dht}"]).start()
    receipt = wait_for(lambda: read_receipts(late.data_dir), 90, "the late joiner's receipt")[0]
    assert receipt["source"] == "peer" and receipt["outer_step"] >= 3
    wait_for(
        lambda: len(node_status(late)["last_group"]) == 4, 90, "the late joiner to average in a group of 4"
    )
    everyone = [*nodes, late]
    assert wait_for(lambda: first_round_all_agree(everyone, receipt["outer_step"]), 90, "four equal digests")
    stop_all(everyone)
    assert_ledgers_replay(everyone)


def test_a_node_whose_global_params_went_astray_repairs_itself(tmp_path: Path, reaper) -> None:
    args = [*SWARM, "--max-outer-steps", "40", "--wait-peers", "2"]
    nodes = start_swarm(reaper, tmp_path, 3, args, faults=[None, None, "corrupt@global_params#2"])
    astray = nodes[2]
    wait_for(lambda: node_status(astray)["repairs"] >= 1, 120, "the astray node to repair itself")
    assert "disagreed with the swarm's" in astray.log()
    assert metric_value(scrape(astray), "swarmnode_repairs_total") >= 1
    assert wait_for(lambda: first_round_all_agree(nodes, 3), 90, "three equal digests again")
    stop_all(nodes)
    assert_ledgers_replay(nodes)


def wire_run(tmp_path: Path, reaper, wire_dtype: str) -> tuple[float, float]:
    """(held-out loss after 4 rounds, bytes sent per round) of a 2-node swarm with pinned shards."""
    args = [*SWARM, "--wire-dtype", wire_dtype, "--max-outer-steps", "40", "--wait-peers", "1"]
    nodes = start_swarm(reaper, tmp_path / wire_dtype, 2, args, extra=[["--shard", "0"], ["--shard", "1"]])
    wait_for(lambda: all(4 in cold_metadata(n) for n in nodes), 120, f"4 rounds with {wire_dtype}")
    sent = metric_value(scrape(nodes[0]), "swarmnode_allreduce_round_sent_bytes")
    loss = cold_metadata(nodes[0])[4]["heldout_loss"]
    stop_all(nodes)
    assert_ledgers_replay(nodes)
    return loss, sent


def test_bf16_and_int8_wire_lose_little_and_send_half_and_a_quarter(tmp_path: Path, reaper) -> None:
    fp32_loss, fp32_bytes = wire_run(tmp_path, reaper, "fp32")
    for dtype, share in (("bf16", 0.5), ("int8", 0.25)):
        loss, sent = wire_run(tmp_path, reaper, dtype)
        assert abs(loss - fp32_loss) <= 0.02 * fp32_loss, (dtype, loss, fp32_loss)
        assert share <= sent / fp32_bytes <= share * 1.05, (dtype, sent, fp32_bytes)


def test_a_slow_node_contributes_fewer_tokens_with_a_smaller_weight(tmp_path: Path, reaper) -> None:
    args = [
        *SWARM,
        "--inner-steps",
        "400",
        "--inner-seconds",
        "1.5",
        "--max-outer-steps",
        "40",
        "--wait-peers",
        "2",
        "--matchmaking-timeout",
        "4",
    ]
    nodes = start_swarm(reaper, tmp_path, 3, args, faults=[None, None, "sleep@inner_step=0.1"])
    slow_id = nodes[2].info["node_id"]
    rounds = wait_for(
        lambda: [
            m["last_round"]
            for o, m in sorted(cold_metadata(nodes[0]).items())
            if o >= 2 and len(m["last_round"]["group"]) == 3
        ],
        120,
        "rounds with all three",
    )
    weights = rounds[-1]["weights"]
    fast = [w for node_id, w in weights.items() if node_id != slow_id]
    assert weights[slow_id] < 0.5 * min(fast), weights
    assert weights[slow_id] % (4 * 64) == 0  # whole batches of 4 × 64 tokens: the tokens it trained
    assert rounds[-1]["seconds"] < 4 + 20  # never beyond the matchmaking timeout (+ the all-reduce)
    stop_all(nodes)
    assert_ledgers_replay(nodes)
