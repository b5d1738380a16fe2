"""`--nproc-per-node`: a node of several training ranks (gloo on the CPU) is one swarm member.

Real `swarmnode run` processes: a 2-rank node and a 1-rank node average with one digest every round,
the 2-rank node weighing twice a rank's tokens; a kill -9 of the 2-rank node leaves no rank behind, its
restart resumes from its own snapshot (bit for bit, every rank's cursor and RNG state restored) and
every ledger replays; a rank that dies takes its node down with exit 1, at once. `--shard-model` (FSDP2
shards across the ranks) trains the replicated node's model, in its snapshots' format, and continues
bit for bit after a kill -9 too.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from test_kill9_continuation import AFTER_A_SNAPSHOT, assert_same_run, final_state
from test_swarm_averaging import SWARM

from swarmnode.core.data import Batch, ShardLoader, default_corpus
from swarmnode.core.diloco import DilocoConfig, InnerTrainer
from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.model import configure_determinism
from swarmnode.core.training import HELDOUT_BATCHES
from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot.read import read_header, read_snapshot
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import assert_ledgers_replay, cold_metadata, identity_file, start_swarm, wait_for

RANKS = ("--max-ranks", "2")
TWO_RANKS = ("--nproc-per-node", "2")
BATCH_TOKENS = 4 * 64  # TINY_ARGS: --batch-size 4, --seq-len 64


def rank_pids(log: str) -> list[int]:
    """The child ranks' pids, as rank 0 logs them at start."""
    found = re.findall(r"ranks 1\.\.\d+ are pids \[([\d, ]+)\]", log)
    assert found, "rank 0 never said which pids its ranks have"
    return [int(pid) for pid in found[-1].split(",")]


def gone(pid: int) -> bool:
    """The process ended (absent, or a zombie its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


def assert_every_rank_recorded(data_dir: Path, world: int) -> None:
    """Every snapshot records each of its node's `world` ranks: its cursor (the node's, between
    steps) and, for ranks 1.., its RNG state."""
    paths = list(iter_snapshot_files(data_dir / "snapshots"))
    assert paths
    for path in paths:
        header = read_header(path)
        assert header.metadata["ranks"] == [header.metadata["cursor"]] * world, path.name
        rng = sorted(e.name for e in header.entries if e.name.startswith("rng/rank/"))
        assert rng == [f"rng/rank/{k}/torch" for k in range(1, world)], path.name


def snapshots_by_step(data_dir: Path) -> dict[tuple[str, int, int], tuple[dict, dict]]:
    """(kind, outer, inner) -> (tensors, metadata) of every snapshot of a node."""
    found = {}
    for path in iter_snapshot_files(data_dir / "snapshots"):
        kind, outer, inner, _ = parse_snapshot_name(path.name)  # type: ignore[misc]
        loaded = read_snapshot(path)
        found[kind, outer, inner] = (loaded.tensors, loaded.metadata)
    return found


def data_parallel_step(state: tuple[dict, dict], batches: list[Batch], world_sync: bool) -> dict:
    """θ after one inner step from a snapshot's `state`, its gradients averaged over `batches` (rank
    k's batch k) as the node's all-reduce does (`world_sync`; else rank 0's batch alone)."""
    tensors, meta = state
    spec = GptSpec.preset("tiny", default_corpus().vocab_size)

    def model() -> torch.nn.Module:
        module = spec.build(3, torch.device("cpu"))
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(tensors[f"model/{name}"])
        return module

    others = []
    for batch in batches[1:]:
        replica = model()
        spec.loss(replica, batch.inputs, batch.targets).backward()
        others.append([p.grad for p in replica.parameters()])

    def sync(params, loss: torch.Tensor) -> float:
        for i, p in enumerate(params):
            total = p.grad.clone()
            for grads in others:
                total += grads[i]
            p.grad.copy_(total / len(batches))
        return float(loss.detach())

    trainer = InnerTrainer(
        model(), DilocoConfig(), torch.device("cpu"), spec.loss, sync if world_sync else None
    )
    for name, p in trainer.model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            trainer.inner_opt.state[p][key].copy_(tensors[f"inner/{name}/{key}"])
    trainer.set_adam_step(meta["optimizer"]["adam_step"])
    trainer.inner_step_at(batches[0], meta["optimizer"]["lr"])
    return {f"model/{name}": p.detach() for name, p in trainer.model.named_parameters()}


def node_batches(cursor: dict, count: int) -> list[Batch]:
    loader = ShardLoader(default_corpus(), cursor["shard"], 16, 4, 64, 3)
    loader.load_state_dict(cursor)
    return [loader.next_batch() for _ in range(count)]


@pytest.fixture
def deterministic_cpu():
    """The node's CPU settings in this process (deterministic kernels, one thread), then as they were."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    configure_determinism(torch.device("cpu"), 1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def test_a_two_rank_step_is_the_data_parallel_step_from_rank_0s_broadcast_state(
    tmp_path: Path, reaper, deterministic_cpu
) -> None:
    """Round 1's first step averages the gradients of the node's two batches; round 2's starts both
    ranks from rank 0's θ after the outer step (its merge): without the all-reduce, or without the
    broadcast, rank 0's θ lands elsewhere."""
    args = [*TWO_RANKS, *RANKS, "--inner-steps", "1", "--hot-every", "1", "--cold-every", "1"]
    # (each step waits 2 s, so the cold write of outer step 1 has ended when step 2's hot one falls due)
    node = reaper.node(
        tmp_path, [*args, "--max-outer-steps", "2", "--seed", "3"], faults="sleep@inner_step=2"
    )
    node.start()
    assert node.wait(120) == 0, node.log()[-3000:]
    snaps = snapshots_by_step(tmp_path)
    first = snaps["hot", 0, 1]
    fresh = {
        f"model/{n}": p.detach()
        for n, p in GptSpec.preset("tiny", 256).build(3, torch.device("cpu")).named_parameters()
    }
    fresh |= {
        f"inner/{n[6:]}/{k}": torch.zeros_like(t) for n, t in fresh.items() for k in ("exp_avg", "exp_avg_sq")
    }
    start = {"optimizer": {"adam_step": 0, "lr": 1e-3}, "cursor": first[1]["committed_cursor"]}
    for before, after in (((fresh, start), first), (snaps["cold", 1, 1], snaps["hot", 1, 2])):
        batches = node_batches(before[1]["cursor"], 2)
        got = data_parallel_step(before, batches, world_sync=True)
        alone = data_parallel_step(before, batches, world_sync=False)
        for name, tensor in got.items():
            assert torch.equal(tensor, after[0][name]), name
        assert not all(torch.equal(t, after[0][n]) for n, t in alone.items())


@pytest.mark.parametrize(
    ("mode", "steps"),
    [
        ((), 10),
        (("--wire-dtype", "topk"), 10),
        (("--shard-model",), 10),
        pytest.param(("--fragments", "2"), 5, marks=pytest.mark.slow),  # rounds of H/K steps
        pytest.param(("--overlap", "on"), None, marks=pytest.mark.slow),  # steps: as the rounds overlap
        pytest.param(("--overlap", "on", "--shard-model"), None, marks=pytest.mark.slow),
    ],
    ids=["dense", "topk", "sharded", "fragments", "overlap", "sharded-overlap"],
)
def test_two_rank_node_and_one_rank_node_average_with_one_digest_per_round(
    tmp_path: Path, reaper, mode: tuple[str, ...], steps: int | None
) -> None:
    """The outer step's modes all hold with a node of several ranks: whatever the mode changes on rank 0
    (θ_g, θ, the error feedback, a fragment, a step landing mid-phase), every rank then takes its θ."""
    own = tuple(a for a in mode if a == "--shard-model")  # (the 2-rank node's alone)
    shared = [a for a in mode if a not in own]
    args = [*SWARM, *RANKS, *shared, "--max-outer-steps", "2", "--wait-peers", "1"]
    nodes = start_swarm(reaper, tmp_path, 2, args, extra=[(*TWO_RANKS, *own), ()])
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    two, one = (n.info["node_id"] for n in nodes)
    metas = [cold_metadata(n) for n in nodes]
    for outer in (1, 2):
        assert len({m[outer]["global_digest"] for m in metas}) == 1, f"digests differ after round {outer}"
        weights = metas[1][outer]["last_round"]["weights"]
        assert set(weights) == {two, one}, "the 2-rank node is one member"
        if steps is not None:
            assert weights[one] == steps * BATCH_TOKENS and weights[two] == 2 * weights[one]
        else:
            assert weights[one] % BATCH_TOKENS == 0 and weights[two] % (2 * BATCH_TOKENS) == 0
    assert_every_rank_recorded(nodes[0].data_dir, 2)
    if steps is not None:
        assert metas[0][2]["cursor"]["position"] == 2 * metas[1][2]["cursor"]["position"]  # 2 batches a step
    assert_ledgers_replay(nodes)
    for pid in rank_pids(nodes[0].log()):
        assert gone(pid), f"rank pid {pid} outlived its node's stop"


@pytest.mark.parametrize(
    "shard", [(), pytest.param(("--shard-model",), marks=pytest.mark.slow)], ids=["replicated", "sharded"]
)
def test_killed_two_rank_node_leaves_no_rank_and_recovers_in_its_swarm(
    tmp_path: Path, reaper, shard: tuple[str, ...]
) -> None:
    args = [*SWARM, *RANKS, "--max-outer-steps", "3", "--wait-peers", "1", "--hot-every", "4"]
    faults = ["kill@inner_step#15", None]
    nodes = start_swarm(reaper, tmp_path, 2, args, faults=faults, extra=[(*TWO_RANKS, *shard), ()])
    two = nodes[0]
    assert two.wait(180) == -signal.SIGKILL, two.log()[-3000:]
    pids = rank_pids(two.log())
    wait_for(lambda: all(gone(pid) for pid in pids), 10, "the killed node's ranks to die with it")
    two.restart()
    for node in nodes:
        assert node.wait(240) == 0, node.log()[-3000:]
    # It starts fresh, or from its peer's first snapshot when its ranks took longer to start than the
    # peer took to write one; it comes back from its own snapshot or its peer's fresher one.
    sources = [r["source"] for r in read_receipts(two.data_dir)]
    assert len(sources) == 2 and sources[0] in ("fresh", "peer") and sources[1] in ("local", "peer"), sources
    metas = [cold_metadata(n) for n in nodes]
    assert metas[0][3]["global_digest"] == metas[1][3]["global_digest"]
    assert_every_rank_recorded(two.data_dir, 2)
    assert_ledgers_replay(nodes)


RUN_ARGS = (
    *TWO_RANKS,
    *RANKS,
    "--inner-steps",
    "12",
    "--hot-every",
    "5",
    "--cold-every",
    "2",
    "--max-outer-steps",
    "3",
    "--seed",
    "3",
    "--lr-schedule",
    "cosine",
    "--inner-warmup-steps",
    "6",
)


@pytest.fixture(scope="module")
def two_rank_args(tmp_path_factory) -> tuple[str, ...]:
    return (*RUN_ARGS, "--identity", str(identity_file(tmp_path_factory)))


@pytest.mark.parametrize(
    "shard",
    # (the replicated node's kill -9 runs by default in the swarm's test above)
    [pytest.param((), marks=pytest.mark.slow), ("--shard-model",)],
    ids=["replicated", "sharded"],
)
def test_killed_two_rank_node_continues_bit_identically(
    tmp_path: Path, reaper, two_rank_args, shard: tuple[str, ...]
) -> None:
    """Sharded: the snapshot holds the whole state gathered from the shards, and the restart scatters it
    back, so the shards are those the killed node held."""
    straight = reaper.node(tmp_path / "straight", (*two_rank_args, *shard)).start()
    assert straight.wait(180) == 0, straight.log()[-3000:]
    killed = reaper.node(tmp_path / "killed", (*two_rank_args, *shard), faults=AFTER_A_SNAPSHOT).start()
    assert killed.wait(180) == -signal.SIGKILL, killed.log()[-3000:]
    killed.restart()
    assert killed.wait(180) == 0, killed.log()[-3000:]
    assert [r["source"] for r in read_receipts(killed.data_dir)] == ["fresh", "local"]
    got, want = final_state(killed.data_dir), final_state(straight.data_dir)
    assert_same_run(got, want)
    assert got[1]["ranks"] == want[1]["ranks"] == [want[1]["cursor"]] * 2
    assert torch.equal(got[0]["rng/rank/1/torch"], want[0]["rng/rank/1/torch"])


def heldout_loss_of(tensors: dict, shard: int) -> float:
    """The held-out loss of a snapshot's θ_g, measured here as a node of one rank measures it."""
    spec = GptSpec.preset("tiny", default_corpus().vocab_size)
    module = spec.build(3, torch.device("cpu"))
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(tensors[f"global/{name}"])
        batches = ShardLoader(default_corpus(), shard, 16, 4, 64, 3).heldout_batches(HELDOUT_BATCHES)
        return sum(float(spec.loss(module, b.inputs, b.targets)) for b in batches) / len(batches)


def test_a_sharded_node_trains_the_replicated_nodes_model(tmp_path: Path, reaper, two_rank_args) -> None:
    """FSDP2's reduce-scatter averages the ranks' gradients as the replicated node's all-reduce does (to
    rounding: it sums in another order, and AdamW magnifies rounding where a gradient is near zero, as
    on the qkv biases), and its snapshots hold the same whole tensors. Each rank holds half of θ and
    the moments. Its held-out loss, measured on the shards, is its θ_g's."""
    args = (*two_rank_args, "--max-outer-steps", "2")
    runs = {}
    for name, shard in (("replicated", ()), ("sharded", ("--shard-model",))):
        node = reaper.node(tmp_path / name, (*args, *shard)).start()
        assert node.wait(180) == 0, node.log()[-3000:]
        runs[name] = (final_state(node.data_dir), node.log())
    (tensors, meta), log = runs["sharded"]
    (want, want_meta), _ = runs["replicated"]
    layout = {n: (t.dtype, t.shape) for n, t in tensors.items()}
    assert layout == {n: (t.dtype, t.shape) for n, t in want.items()}
    start = GptSpec.preset("tiny", 256).build(3, torch.device("cpu")).state_dict()
    for kind in ("global", "model"):
        names = [n for n in want if n.startswith(f"{kind}/")]
        got = torch.cat([tensors[n].reshape(-1) for n in names])
        same = torch.cat([want[n].reshape(-1) for n in names])
        moved = same - torch.cat([start[n.split("/", 1)[1]].reshape(-1) for n in names])
        gap = float((got - same).norm() / moved.norm())
        assert gap < 1e-2, (kind, gap)  # (measured 2.5e-3 to 3e-3 of how far training moved them)
    assert meta["cursor"] == want_meta["cursor"] and meta["ranks"] == want_meta["ranks"]
    assert meta["heldout_loss"] == pytest.approx(heldout_loss_of(tensors, meta["cursor"]["shard"]), rel=1e-5)
    held = re.search(r"sharded model: rank 0 holds (\d+) of the (\d+) values", log)
    assert held is not None, log[-3000:]
    assert abs(2 * int(held[1]) - int(held[2])) <= 64  # (dim-0 shards: the odd rows fall to rank 0)
    assert "sharded model" not in runs["replicated"][1]


def test_a_sharded_and_a_replicated_node_restore_each_others_snapshots(
    tmp_path: Path, reaper, two_rank_args
) -> None:
    """Sharded, then replicated, then sharded again in one data dir: each restart resumes the other's
    snapshot (a constant schedule here: a cosine's length, hence the run, follows --max-outer-steps)."""
    args = (*TWO_RANKS, *RANKS, "--inner-steps", "6", "--cold-every", "1", *two_rank_args[-2:])  # identity
    for rounds, shard in (("1", ("--shard-model",)), ("2", ()), ("3", ("--shard-model",))):
        node = reaper.node(tmp_path, (*args, "--max-outer-steps", rounds, *shard)).start()
        assert node.wait(180) == 0, node.log()[-3000:]
    assert [r["source"] for r in read_receipts(tmp_path)] == ["fresh", "local", "local"]
    assert final_state(tmp_path)[1]["outer_step"] == 3


def test_dead_rank_takes_its_node_down_with_exit_1(tmp_path: Path, reaper) -> None:
    """Rank 1 dies after the round's last step: rank 0's outer step (its θ broadcast) finds it gone and
    the node stops there — not a failed round that trains on."""
    node = reaper.node(tmp_path, [*RUN_ARGS, "--max-outer-steps", "50"], faults="kill@rank_step#12").start()
    assert node.wait(60) == 1, node.log()[-3000:]
    lines = [line for line in node.log().splitlines() if line.startswith("swarmnode run: error:")]
    assert len(lines) == 1 and "rank" in lines[0], node.log()[-3000:]
    assert "failed; its work stays local progress" not in node.log()
    assert all(gone(pid) for pid in rank_pids(node.log()))


def test_sigterm_to_the_process_group_stops_a_two_rank_node_cleanly(tmp_path: Path, reaper) -> None:
    """A service manager's SIGTERM (or a terminal's Ctrl-C) reaches every rank: the children wait for
    rank 0, whose stop writes the final snapshot with every rank's record, then stops them."""
    node = reaper.node(tmp_path, [*RUN_ARGS, "--max-outer-steps", "50"]).start()
    wait_for(lambda: any(iter_snapshot_files(tmp_path / "snapshots")), 120, "the node's first snapshot")
    node.signal(signal.SIGTERM)
    assert node.wait(60) == 0, node.log()[-3000:]
    assert_every_rank_recorded(tmp_path, 2)
    assert all(gone(pid) for pid in rank_pids(node.log()))
