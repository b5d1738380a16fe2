"""`swarmnode bench attacks`: what one hostile member of a group does to the honest members' model, with
the norm screen alone (the aggregation before CenteredClip) and with the robust outer step (the node's
default), against the same honest members averaging alone (same seeds, same shards) — simulated like
`bench quality` (`quality_sim.py`): W DiLoCo workers in one process, worker W−1 the attacker, every
round's average the reducer's own `aggregation.average` on the workers' Δs.

Attacks, each round, on the Δ the attacker sends (its weight is the honest one: `over_weight` refuses a
heavier offer before any average):
- `flip`: −7 × its own Δ (under the default --max-norm-ratio 8, so the screen lets it through);
- `direction`: a fixed random direction, 7 × its Δ's norm;
- `noise`: random, of its Δ's norm;
- `minus4`: −4 × the last round's average (its own Δ the first round).

The figure: the honest worker 0's held-out loss after R rounds, as a ratio to the honest alone's; and
the honest cost, an attack-free run's loss through the robust step against the screen alone.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from dataclasses import dataclass, replace

import torch

from swarmnode.bench.quality_sim import DEFAULT_LR, HELDOUT_BATCHES, Side, SideJob, loader, trainer_for
from swarmnode.bench.runner import BenchResult, load_note
from swarmnode.core.data import default_corpus
from swarmnode.core.diloco import AveragedDelta
from swarmnode.core.model import configure_determinism
from swarmnode.swarm.averaging import aggregation
from swarmnode.swarm.averaging.trust import DEFAULT_MAX_NORM_RATIO

ATTACKS = ("flip", "direction", "noise", "minus4")
SCREEN_ONLY, ROBUST = "screen only", "robust"


@dataclass(frozen=True)
class AttackRun:
    """One simulated run: `attack` None is an attack-free one (`workers` of them honest)."""

    attack: str | None
    aggregator: str
    workers: int
    shards: int
    """The group's size: the honest alone train on the shards they have in the attacked group."""
    inner_steps: int
    rounds: int
    model: str


def bench_attacks(preset: str, workers: int = 4, inner_steps: int = 50, rounds: int = 10) -> BenchResult:
    result = BenchResult("attacks", preset)
    base = AttackRun(None, ROBUST, workers, workers, inner_steps, rounds, preset)
    runs = [replace(base, workers=workers - 1), base, replace(base, aggregator=SCREEN_ONLY)]
    runs += [replace(base, attack=a, aggregator=g) for a in ATTACKS for g in (SCREEN_ONLY, ROBUST)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
        losses = list(pool.map(run_attack, runs))
    alone = losses[0]
    result.add(f"honest alone ({workers - 1} workers), held-out loss", alone, "nats", load_note())
    result.ratio(f"attack-free, {workers} workers, robust / alone", losses[1] / alone)
    result.ratio("honest cost: attack-free, robust / screen only", losses[1] / losses[2])
    for run, loss in zip(runs[3:], losses[3:], strict=True):
        result.add(f"{run.attack}, {run.aggregator}: held-out loss", loss, "nats")
        result.ratio(f"{run.attack}, {run.aggregator} / honest alone", loss / alone)
    return result


def run_attack(run: AttackRun) -> float:
    """Worker 0's held-out loss after the run's last outer step."""
    configure_determinism(torch.device("cpu"), 1)
    corpus = default_corpus()
    job = SideJob(Side.DILOCO, run.model, run.workers, run.inner_steps, run.rounds, DEFAULT_LR["diloco"])
    trainers = [trainer_for(corpus, job) for _ in range(run.workers)]
    loaders = [loader(corpus, k, run.shards) for k in range(run.workers)]
    attacker = Attacker(run.attack, trainers[0].global_flat.numel()) if run.attack else None
    for _ in range(run.rounds):
        for trainer, shard_loader in zip(trainers, loaders, strict=True):
            for _ in range(run.inner_steps):
                trainer.inner_step(shard_loader.next_batch())
        deltas = [t.pseudo_gradient().clone() for t in trainers]
        if attacker is not None:
            deltas[-1] = attacker.send(deltas[-1])
        averaged = _aggregate(deltas, run.aggregator)
        if attacker is not None:
            attacker.last_average = averaged.delta
        for trainer in trainers:
            trainer.outer_step(averaged)
    heldout = loader(corpus, 0, run.shards).heldout_batches(HELDOUT_BATCHES)
    return float(trainers[0].evaluate(heldout, use_global=True))


def _aggregate(deltas: list[torch.Tensor], aggregator: str) -> AveragedDelta:
    n = deltas[0].numel()
    contributions: list[aggregation.Contribution] = [(k, 1.0, d) for k, d in enumerate(deltas)]
    averaged = aggregation.average(
        contributions, "fp32", n, DEFAULT_MAX_NORM_RATIO, clip=aggregator == ROBUST
    )
    assert averaged.values is not None
    return AveragedDelta(averaged.values.clone(), ((0, n),), len(averaged.included))


class Attacker:
    """What the hostile member sends instead of its Δ (see the module notes)."""

    def __init__(self, attack: str, n: int) -> None:
        self.attack = attack
        generator = torch.Generator().manual_seed(1234)
        self.direction = torch.randn(n, generator=generator)
        self.direction /= self.direction.norm()
        self.generator = generator
        self.last_average: torch.Tensor | None = None

    def send(self, delta: torch.Tensor) -> torch.Tensor:
        if self.attack == "flip":
            return -7 * delta
        if self.attack == "direction":
            return self.direction * 7 * delta.norm()
        if self.attack == "noise":
            noise = torch.randn(delta.numel(), generator=self.generator)
            return noise / noise.norm() * delta.norm()
        return -4 * (self.last_average if self.last_average is not None else delta)
