"""`swarmnode bench quality --swarm`: the quality figure on real processes. W `swarmnode run` nodes on
loopback (node k pinned to shard k of W, fp32 on the wire, one torch thread, the bench's schedule,
learning rates, H and rounds) against the simulated DiLoCo at the same flags: their held-out losses
after every round must agree (within `TOLERANCE`), which catches a swarm that averages wrongly.

The nodes' held-out losses come from their ledgers (each settle entry carries the held-out loss of
the new global params, measured on the node's `HELDOUT_BATCHES` held-out batches; the simulation is
measured on the same batches). A round that some node did not average with all W (late, alone,
carried) is counted and shown: the simulation assumes every group whole.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from swarmnode.bench.procs import ChildFailed, NodeProcess
from swarmnode.bench.quality_sim import BATCH_SIZE, SEQ_LEN, Curve, Setup, Side, SideJob, run_jobs
from swarmnode.bench.runner import BenchResult
from swarmnode.core.ledger import read_ledger
from swarmnode.core.training import HELDOUT_BATCHES

TOLERANCE = 0.005
"""Most relative difference between the swarm's and the simulation's held-out loss."""
ROUND_TIMEOUT_S = 60.0
"""Matchmaking and all-reduce time allowed per round (generous: a loaded machine must not split
the group, which the comparison would then measure instead of the averaging)."""
NODE_TIMEOUT_S = 4 * 3600.0


def node_args(job: SideJob, shard: int) -> list[str]:
    """The `swarmnode run` flags of node `shard`: the simulated worker's settings, one to one."""
    schedule = job.schedule
    return [
        *("--model", job.model, "--run-id", "bench-quality", "--seed", "0", "--threads", "1"),
        *("--shard", str(shard), "--num-shards", str(job.workers)),
        *("--batch-size", str(BATCH_SIZE), "--seq-len", str(SEQ_LEN)),
        *("--inner-steps", str(job.inner_steps), "--max-outer-steps", str(job.rounds)),
        *("--inner-lr", str(job.lr), "--lr-schedule", str(schedule.kind)),
        *("--inner-warmup-steps", str(schedule.warmup_steps), "--total-steps", str(schedule.total_steps)),
        *("--final-lr-fraction", str(schedule.final_fraction)),
        *("--outer-lr", str(job.outer_lr), "--outer-momentum", str(job.outer_momentum)),
        *("--outer-mix", str(job.outer_mix)),
        *("--wire-dtype", "fp32", "--wait-peers", str(job.workers - 1)),
        *("--matchmaking-timeout", str(ROUND_TIMEOUT_S), "--allreduce-timeout", str(ROUND_TIMEOUT_S)),
        # A cold snapshot after every outer step announces the node's step, so from the second round
        # on each node knows whom to expect and matchmaking ends once all have offered (the first
        # round waits out the timeout: nobody has announced yet).
        *("--hot-every", "1000000", "--cold-every", "1", "--keep-cold", "1"),
    ]


def run_swarm(job: SideJob, base: Path) -> list[list[dict[str, Any]]]:
    """Runs the W nodes to their last round; each node's settle entries in round order."""
    nodes: list[NodeProcess] = []
    try:
        first = NodeProcess(base / "node-0", node_args(job, 0)).start()
        nodes.append(first)
        peers = ["--peers", f"127.0.0.1:{first.wait_ready()['dht_port']}"]
        for shard in range(1, job.workers):
            nodes.append(NodeProcess(base / f"node-{shard}", [*node_args(job, shard), *peers]).start())
        for node in nodes:
            if node.wait(NODE_TIMEOUT_S) != 0:
                raise node.fail("the node failed")
        return [[e for e in read_ledger(n.data_dir) if e["event"] == "settle"] for n in nodes]
    finally:
        for node in nodes:
            node.kill()


def compare_swarm(setup: Setup, log_dir: Path) -> tuple[Curve, list[list[dict[str, Any]]]]:
    """The simulation's curve and the nodes' settle entries, the two run at once."""
    job = setup.job(Side.DILOCO, heldout_batches=HELDOUT_BATCHES)
    with ThreadPoolExecutor(1, thread_name_prefix="quality-simulation") as simulation:
        simulated = simulation.submit(run_jobs, [job], log_dir, 1)
        settles = run_swarm(job, log_dir / "swarm")
    return simulated.result()[0], settles


def report_swarm(result: BenchResult, curve: Curve, settles: list[list[dict[str, Any]]]) -> None:
    job = curve.job
    whole = sum(
        all(s["status"] == "applied" and s["group_size"] == job.workers for s in round_settles)
        for round_settles in zip(*settles, strict=False)
    )
    worst, rows, final = 0.0, [], [0.0]
    for r in range(1, job.rounds + 1):
        found = [_heldout_after(node, r - 1) for node in settles]
        final = [loss for loss in found if loss is not None]
        if len(final) < len(found):
            raise ChildFailed(f"round {r - 1}: a node has no held-out loss in its ledger")
        worst = max(worst, *(abs(loss / curve.losses[r] - 1) for loss in final))
        rows.append({"round": r, "simulated": curve.losses[r], "nodes": final})
    setup = f"{job.workers} nodes, H={job.inner_steps}, {job.rounds} rounds, outer lr {job.outer_lr:g}"
    mean = sum(final) / len(final)
    result.add("swarm: nodes' held-out loss after the last round", mean, "nats", setup)
    result.add("swarm: simulated DiLoCo, same flags", curve.final, "nats", f"{curve.seconds:.0f} s")
    result.add("swarm: rounds every node averaged with all", whole, "rounds", f"of {job.rounds}")
    target = f"any node, any round; target ≤ {TOLERANCE}"
    result.add("swarm vs simulation: worst |ratio − 1|", worst, "", target)
    result.ratio("swarm / simulation held-out loss", mean / curve.final, "last round")
    result.series["swarm"] = rows


def _heldout_after(settles: list[dict[str, Any]], outer_step: int) -> float | None:
    found = (s["heldout_loss"] for s in settles if s["outer_step"] == outer_step)
    return next((float(loss) for loss in found if loss is not None), None)


def bench_swarm(result: BenchResult, setup: Setup, log_dir: Path) -> None:
    curve, settles = compare_swarm(setup, log_dir)
    report_swarm(result, curve, settles)
