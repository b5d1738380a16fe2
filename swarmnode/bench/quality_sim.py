"""The quality bench's simulation (`swarmnode bench quality`, `bench/quality.py`): DiLoCo against synchronous
data parallel and a single worker, without a network, at equal tokens per worker; the held-out loss of
each side after every outer step.

- DiLoCo: W `DilocoTrainer`s, worker k on shard k of W, H inner AdamW steps each, then the plain mean
  of their pseudo-gradients as every worker's outer step (Nesterov) — what a swarm of W nodes does
  when every round's group is whole (`bench/swarm_quality.py` checks that on real processes).
- Synchronous DP: one model whose every AdamW step takes the W workers' batches together (W× batch:
  the mean gradient an all-reduce every step would give), H·R steps.
- One worker: one model on the whole corpus (no shard: it trains alone), H·R steps of the same batch.

Every side runs the same schedule shape (linear warm-up over `WARMUP_FRACTION` of the steps, then a
cosine to zero, the schedule's `DEFAULT_FINAL_FRACTION`) at its own peak learning rate, each side's
best from the sweep (never a weakened baseline). Each side trains in a worker process with one torch
thread and deterministic kernels (the node's settings with `--threads 1`), the sides at once. Bytes per
worker: DiLoCo sends 2 × params × 4 bytes (fp32) per outer step, DP the same per step; so DP sends H
times as many.

`--variants` also runs, beside blocking DiLoCo at equal tokens and the same learning rates: `overlap`,
the overlapped outer step of `--overlap on` with each round's average landing `OVERLAP_SHARE`·H inner
steps into the next round (`DilocoTrainer.outer_step_overlapped`), `int4`, every Δ and every
average through the 4-bit wire codec, as the butterfly sends them, and `fragments`, `--fragments
FRAGMENTS` as a node runs it (`core/fragments.py`, the same plan and outer step as `TrainingRun`):
R·K rounds of about H/K inner steps, round r averaging fragment r mod K only; and `robust`, every
round's average through the node's robust outer step (screen and CenteredClip,
`swarm/averaging/aggregation.py`): its honest cost; and `topk`, SparseLoCo's outer step
(`DilocoConfig.topk`: error feedback, chunk-wise top-k with 2-bit values at `topk_density`, the
node's default α or `--topk-outer-lr`, no momentum), each ĉ through the top-k wire codec;
`topk_robust`, the same through the robust outer step.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from swarmnode.bench.procs import Worker
from swarmnode.bench.runner import BenchResult
from swarmnode.core import sparse
from swarmnode.core.data import Batch, Corpus, ShardLoader, default_corpus
from swarmnode.core.diloco import AveragedDelta, DilocoConfig, DilocoTrainer
from swarmnode.core.fragments import FragmentPlan, round_steps
from swarmnode.core.model import configure_determinism, count_parameters
from swarmnode.core.model_spec import load_model_spec
from swarmnode.core.schedule import DEFAULT_FINAL_FRACTION, InnerSchedule, LrSchedule
from swarmnode.swarm.averaging import codecs
from swarmnode.swarm.averaging.aggregation import Contribution, average
from swarmnode.swarm.averaging.trust import DEFAULT_MAX_NORM_RATIO

BATCH_SIZE = 8
SEQ_LEN = 128
HELDOUT_BATCHES = 16
WARMUP_FRACTION = 0.05
FP32_BYTES = 4
TIMEOUT_S = 4 * 3600.0
SIDE_PROCESSES = 3
"""Worker processes at once (the three sides of a comparison; a sweep's jobs queue for them)."""

# The defaults (docs/benchmarks.md "Model quality"): H (DiLoCo's best with DP bytes / DiLoCo bytes ≥ 100),
# outer lr and momentum from the sweep and the 20-round screen, the merge's α and each side's peak learning
# rate its best at the default length. 80 rounds, because at 40 the comparison had not settled: DiLoCo / DP
# fell from 1.17 (round 20) to 1.11 (40) and only levels out at 1.04-1.06 from round 60.
DEFAULT_WORKERS = 4
DEFAULT_INNER_STEPS = 100
DEFAULT_ROUNDS = 80
DEFAULT_OUTER_LR = 1.0
DEFAULT_OUTER_MOMENTUM = 0.9
DEFAULT_OUTER_MIX = DilocoConfig.outer_mix  # the node's default is the one chosen here
DEFAULT_LR = {"diloco": 3e-3, "dp": 1.6e-2, "single": 4e-3}


OVERLAP_SHARE = 0.25
"""Inner steps an overlapped all-reduce takes, as a share of H (a slow link's round)."""
FRAGMENTS = 4
"""K of the `fragments` variant (Streaming DiLoCo's own choice for its largest runs is of this order)."""


class Side(StrEnum):
    DILOCO = "diloco"
    DP = "dp"
    SINGLE = "single"
    OVERLAP = "overlap"
    INT4 = "int4"
    FRAGMENTS = "fragments"
    ROBUST = "robust"
    TOPK = "topk"
    TOPK_ROBUST = "topk_robust"
    TOPK_OVERLAP = "topk_overlap"


VARIANTS = (
    Side.OVERLAP,
    Side.INT4,
    Side.FRAGMENTS,
    Side.ROBUST,
    Side.TOPK,
    Side.TOPK_ROBUST,
    Side.TOPK_OVERLAP,
)
_TOPK_SIDES = (Side.TOPK, Side.TOPK_ROBUST, Side.TOPK_OVERLAP)
_OVERLAP_SIDES = (Side.OVERLAP, Side.TOPK_OVERLAP)
LABELS = {
    Side.DILOCO: "DiLoCo ({w} workers)",
    Side.DP: "sync DP ({w}× batch)",
    Side.SINGLE: "one worker",
    Side.OVERLAP: "DiLoCo, overlapped outer step",
    Side.INT4: "DiLoCo, int4 wire",
    Side.FRAGMENTS: f"DiLoCo, {FRAGMENTS} fragments",
    Side.ROBUST: "DiLoCo, robust outer step",
    Side.TOPK: "SparseLoCo, top-k wire",
    Side.TOPK_ROBUST: "SparseLoCo, robust outer step",
    Side.TOPK_OVERLAP: "SparseLoCo, overlapped outer step",
}


@dataclass(frozen=True)
class SideJob:
    """One side's training run: what a worker process is asked to do (JSON both ways)."""

    side: Side
    model: str
    workers: int
    inner_steps: int
    rounds: int
    lr: float
    """Peak inner learning rate (DP and one worker: their only optimizer's)."""
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    outer_mix: float = DEFAULT_OUTER_MIX
    """α of the merge after each outer step (`DilocoConfig.outer_mix`; DiLoCo's sides only)."""
    heldout_batches: int = HELDOUT_BATCHES
    final_fraction: float = DEFAULT_FINAL_FRACTION
    """Where every side's cosine ends, as a fraction of its peak (`InnerSchedule.final_fraction`)."""
    topk_density: float = sparse.DEFAULT_DENSITY
    """`Side.TOPK`: the kept share of Δ's entries (`core/sparse.py`)."""
    topk_outer_lr: float = sparse.DEFAULT_OUTER_LR
    """`Side.TOPK`: α of SparseLoCo's outer step θ_g ← θ_g − α·mean(ĉ) (no momentum: the error
    feedback is it); the node's default unless `--topk-outer-lr`."""

    @property
    def total_steps(self) -> int:
        return self.inner_steps * self.rounds

    @property
    def schedule(self) -> InnerSchedule:
        warmup = max(1, round(WARMUP_FRACTION * self.total_steps))
        end = max(self.total_steps, warmup + 1)
        return InnerSchedule(LrSchedule.COSINE, warmup, end, self.final_fraction)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "side": str(self.side)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SideJob:
        return cls(**{**raw, "side": Side(raw["side"])})


@dataclass(frozen=True)
class Curve:
    """A side's held-out loss after every outer step (index 0: the initial weights)."""

    job: SideJob
    tokens: tuple[int, ...]
    """Tokens trained per worker when each loss was measured."""
    losses: tuple[float, ...]
    seconds: float
    params: int

    @property
    def final(self) -> float:
        return self.losses[-1]

    @property
    def label(self) -> str:
        if self.job.side in _TOPK_SIDES:
            return f"{LABELS[self.job.side]} {self.job.topk_density:.1%}"
        return LABELS[self.job.side].format(w=self.job.workers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job.to_dict(),
            "tokens": list(self.tokens),
            "losses": list(self.losses),
            "seconds": self.seconds,
            "params": self.params,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Curve:
        return cls(
            SideJob.from_dict(raw["job"]),
            tuple(raw["tokens"]),
            tuple(raw["losses"]),
            raw["seconds"],
            raw["params"],
        )


# ----- one side, in a worker process -----


def train_side(job: SideJob) -> Curve:
    """Trains one side with one deterministic torch thread; its held-out curve."""
    configure_determinism(torch.device("cpu"), 1)
    corpus = default_corpus()
    heldout = loader(corpus, 0, job.workers).heldout_batches(job.heldout_batches)
    started = time.perf_counter()
    steps = {
        Side.DILOCO: _diloco_rounds,
        Side.DP: _data_parallel_rounds,
        Side.SINGLE: _single_rounds,
        Side.OVERLAP: _diloco_rounds,
        Side.INT4: _diloco_rounds,
        Side.FRAGMENTS: _fragment_rounds,
        Side.ROBUST: _diloco_rounds,
        Side.TOPK: _diloco_rounds,
        Side.TOPK_ROBUST: _diloco_rounds,
        Side.TOPK_OVERLAP: _diloco_rounds,
    }
    trainer, losses = None, []
    for trainer, use_global in steps[job.side](corpus, job):
        losses.append(trainer.evaluate(heldout, use_global=use_global))
    assert trainer is not None
    tokens = tuple(r * job.inner_steps * BATCH_SIZE * SEQ_LEN for r in range(job.rounds + 1))
    return Curve(job, tokens, tuple(losses), time.perf_counter() - started, count_parameters(trainer.model))


def loader(corpus: Corpus, shard: int, workers: int) -> ShardLoader:
    """Worker k's loader: shard k of W, seed 0 (a node run with `--shard k --num-shards W`)."""
    return ShardLoader(corpus, shard, workers, BATCH_SIZE, SEQ_LEN, seed=0)


def trainer_for(corpus: Corpus, job: SideJob) -> DilocoTrainer:
    """A fresh trainer; every one starts from the same weights (seed 0), like a run's nodes."""
    spec = load_model_spec(job.model, corpus.vocab_size)  # a preset, or an hf:/py: model
    model = spec.build(0, torch.device("cpu"))
    topk = sparse.kept_per_chunk(job.topk_density) if job.side in _TOPK_SIDES else 0
    cfg = DilocoConfig(
        inner_lr=job.lr,
        schedule=job.schedule,
        outer_lr=job.topk_outer_lr if topk else job.outer_lr,
        outer_momentum=0.0 if topk else job.outer_momentum,
        outer_mix=0.0 if topk else job.outer_mix,
        topk=topk,
    )
    return DilocoTrainer(model, cfg, torch.device("cpu"), spec.loss)


def _diloco_rounds(corpus: Corpus, job: SideJob) -> Any:
    """Worker 0 before the first and after every outer step (every worker then holds the same θ_g).
    `Side.INT4`: every Δ and the average pass through the int4 codec; `Side.OVERLAP` and
    `Side.TOPK_OVERLAP`: each round's average lands `OVERLAP_SHARE`·H inner steps into the next round
    (the last one after the last)."""
    trainers = [trainer_for(corpus, job) for _ in range(job.workers)]
    loaders = [loader(corpus, k, job.workers) for k in range(job.workers)]
    topk_wire = sparse.wire_name(trainers[0].cfg.topk or 1)
    wire = topk_wire if job.side in _TOPK_SIDES else "int4" if job.side == Side.INT4 else "fp32"
    overlap = int(OVERLAP_SHARE * job.inner_steps) if job.side in _OVERLAP_SIDES else 0
    pending: AveragedDelta | None = None
    yield trainers[0], True
    for _ in range(job.rounds):
        early = overlap if pending is not None else 0
        for trainer, shard_loader in zip(trainers, loaders, strict=True):
            for _ in range(early):
                trainer.inner_step(shard_loader.next_batch())
        if pending is not None:
            for trainer in trainers:
                trainer.outer_step_overlapped(pending)
            yield trainers[0], True
        for trainer, shard_loader in zip(trainers, loaders, strict=True):
            for _ in range(job.inner_steps - early):
                trainer.inner_step(shard_loader.next_batch())
        deltas = [t.pseudo_gradient().clone() for t in trainers]
        averaged = group_average(deltas, wire, robust=job.side in (Side.ROBUST, Side.TOPK_ROBUST))
        if overlap:
            pending = averaged
            continue
        for trainer in trainers:
            trainer.outer_step(averaged)
        yield trainers[0], True
    if pending is not None:
        for trainer in trainers:
            trainer.outer_step_overlapped(pending)
        yield trainers[0], True


def _fragment_rounds(corpus: Corpus, job: SideJob) -> Any:
    """Worker 0 before the first and after every K fragment rounds (H inner steps, as the other sides
    are measured): round r trains `round_steps` inner steps, averages Δ on fragment r mod K only and
    takes the outer step there, as `TrainingRun.prepare_round` and `apply_outer` do on a node."""
    trainers = [trainer_for(corpus, job) for _ in range(job.workers)]
    loaders = [loader(corpus, k, job.workers) for k in range(job.workers)]
    plan = FragmentPlan(trainers[0].global_flat.numel(), FRAGMENTS)
    yield trainers[0], True
    for r in range(job.rounds * FRAGMENTS):
        for trainer, shard_loader in zip(trainers, loaders, strict=True):
            for _ in range(round_steps(job.inner_steps, FRAGMENTS, r)):
                trainer.inner_step(shard_loader.next_batch())
        fragment = plan.for_round(r)
        deltas = [plan.delta_of(t.pseudo_gradient(), fragment).clone() for t in trainers]
        averaged = plan.lift(group_average(deltas, "fp32"), fragment)
        for trainer in trainers:
            trainer.outer_step(averaged)
        if (r + 1) % FRAGMENTS == 0:
            yield trainers[0], True


def group_average(deltas: Sequence[torch.Tensor], wire: str, robust: bool = False) -> AveragedDelta:
    """The reducer's average (`swarm.aggregation.average`) of the workers' Δs at equal weights,
    screening off (`robust`: the node's robust outer step, screen and CenteredClip): each Δ goes in as
    the wire image a reducer receives and the average comes out through the codec, as the butterfly
    sends them (fp32: Σᵢ Δᵢ / W in member order); what every member applies."""
    n = deltas[0].numel()
    images: list[Contribution] = [(k, 1.0, bytearray(codecs.encode(d, wire))) for k, d in enumerate(deltas)]
    averaged = average(images, wire, n, DEFAULT_MAX_NORM_RATIO if robust else math.inf)
    assert averaged.values is not None and len(averaged.included) == len(deltas), averaged.excluded
    return AveragedDelta(averaged.values, ((0, n),), len(deltas))


def _data_parallel_rounds(corpus: Corpus, job: SideJob) -> Any:
    """One model on the workers' batches together; measured every H steps (its local θ is the model)."""
    trainer = trainer_for(corpus, job)
    loaders = [loader(corpus, k, job.workers) for k in range(job.workers)]
    yield trainer, False
    for _ in range(job.rounds):
        for _ in range(job.inner_steps):
            batches = [shard_loader.next_batch() for shard_loader in loaders]
            inputs = torch.cat([b.inputs for b in batches])
            targets = torch.cat([b.targets for b in batches])
            trainer.inner_step(Batch(inputs, targets, batches[0].epoch, batches[0].position))
        yield trainer, False


def _single_rounds(corpus: Corpus, job: SideJob) -> Any:
    """One model alone on the whole corpus: a worker that trains alone has no shard. On shard 0 of W it
    would see 1/W of the text, and past one epoch of it (`tiny` at 40 rounds: 3.5) overfit that shard, a
    baseline weakened by its data, not by training alone."""
    trainer = trainer_for(corpus, job)
    shard_loader = loader(corpus, 0, 1)
    yield trainer, False
    for _ in range(job.rounds):
        for _ in range(job.inner_steps):
            trainer.inner_step(shard_loader.next_batch())
        yield trainer, False


# ----- running jobs in worker processes -----


def run_jobs(jobs: Sequence[SideJob], log_dir: Path, processes: int = SIDE_PROCESSES) -> list[Curve]:
    """Each job in a `quality` worker process, `processes` at once; the curves in the jobs' order."""
    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(jobs)):
        todo.put(index)
    results: dict[int, Curve] = {}
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with Worker(log_dir, "quality") as worker:
                worker.read(TIMEOUT_S)  # started
                while not errors:
                    try:
                        index = todo.get_nowait()
                    except queue.Empty:
                        return
                    results[index] = Curve.from_dict(worker.ask(jobs[index].to_dict(), TIMEOUT_S))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=serve, name=f"quality-{k}") for k in range(min(processes, len(jobs)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[index] for index in range(len(jobs))]


# ----- the comparison -----


@dataclass(frozen=True)
class Setup:
    """A comparison's size and learning rates (the bench's flags, else the defaults)."""

    model: str = "tiny"
    workers: int = DEFAULT_WORKERS
    inner_steps: int = DEFAULT_INNER_STEPS
    rounds: int = DEFAULT_ROUNDS
    outer_lr: float = DEFAULT_OUTER_LR
    lr_diloco: float = DEFAULT_LR["diloco"]
    lr_dp: float = DEFAULT_LR["dp"]
    lr_single: float = DEFAULT_LR["single"]
    outer_mix: float = DEFAULT_OUTER_MIX
    topk_outer_lr: float = sparse.DEFAULT_OUTER_LR

    def job(self, side: Side, **changes: Any) -> SideJob:
        lr = {Side.DILOCO: self.lr_diloco, Side.DP: self.lr_dp, Side.SINGLE: self.lr_single}[side]
        job = SideJob(side, self.model, self.workers, self.inner_steps, self.rounds, lr, self.outer_lr)
        return replace(job, outer_mix=self.outer_mix, topk_outer_lr=self.topk_outer_lr, **changes)


@dataclass(frozen=True)
class Comparison:
    diloco: Curve
    dp: Curve
    single: Curve

    @property
    def loss_ratio(self) -> float:
        return self.diloco.final / self.dp.final

    @property
    def gain_kept(self) -> float:
        """DiLoCo's share of DP's gain over one worker (1: all of it)."""
        return (self.single.final - self.diloco.final) / (self.single.final - self.dp.final)

    @property
    def bytes_ratio(self) -> float:
        return self.dp.job.total_steps / self.diloco.job.rounds

    def curves(self) -> list[Curve]:
        return [self.diloco, self.dp, self.single]


def compare(setup: Setup, log_dir: Path) -> Comparison:
    jobs = [setup.job(side) for side in (Side.DILOCO, Side.DP, Side.SINGLE)]
    return Comparison(*run_jobs(jobs, log_dir))


def report(result: BenchResult, comparison: Comparison, label: str = "quality") -> None:
    """The comparison's figures and ratios, and its curves as the result's series."""
    d = comparison.diloco
    exchange = 2 * d.params * FP32_BYTES * d.job.workers
    tokens = d.tokens[-1]
    setup = f"{d.job.workers} workers, H={d.job.inner_steps}, {d.job.rounds} rounds, {tokens} tokens/worker"
    for curve in comparison.curves():
        note = f"peak lr {curve.job.lr:g}"
        if curve is d:
            note += f", outer lr {curve.job.outer_lr:g}, outer mix {curve.job.outer_mix:g}"
        note += f", cosine to {curve.job.final_fraction:g}× peak; {curve.seconds:.0f} s"
        result.add(f"{label}: {curve.label} held-out loss", curve.final, "nats", note)
    result.add(f"{label}: DiLoCo bytes communicated", exchange * d.job.rounds / 1e6, "MB", setup)
    result.add(f"{label}: sync DP bytes communicated", exchange * comparison.dp.job.total_steps / 1e6, "MB")
    result.ratio("DiLoCo loss / sync DP loss", comparison.loss_ratio, "target ≤ 1.05 (stretch 1.02)")
    result.ratio("DiLoCo share of DP's gain over one worker", comparison.gain_kept, "target ≥ 0.75")
    result.ratio("sync DP bytes / DiLoCo bytes", comparison.bytes_ratio, "target ≥ 100")
    result.series[label] = [curve.to_dict() for curve in comparison.curves()]


def topk_sweep(setup: Setup, densities: Sequence[float], log_dir: Path) -> tuple[Curve, list[Curve]]:
    """Blocking DiLoCo (fp32) and the top-k wire at each density, same learning rates and tokens, and
    the top-k wire through the robust outer step at the default density (its honest cost)."""
    base = setup.job(Side.DILOCO)
    jobs = [base, *(replace(base, side=Side.TOPK, topk_density=d) for d in densities)]
    jobs.append(replace(base, side=Side.TOPK_ROBUST, topk_density=sparse.DEFAULT_DENSITY))
    curves = run_jobs(jobs, log_dir)
    return curves[0], curves[1:]


def report_topk_sweep(result: BenchResult, base: Curve, curves: Sequence[Curve]) -> None:
    result.add(f"quality: {base.label} held-out loss", base.final, "nats", f"{base.seconds:.0f} s")
    for curve in curves:
        d = curve.job.topk_density
        note = f"{curve.seconds:.0f} s"
        name = f"top-k {d:g}" + (", robust" if curve.job.side == Side.TOPK_ROBUST else "")
        if curve.job.topk_outer_lr != sparse.DEFAULT_OUTER_LR:
            name += f", α {curve.job.topk_outer_lr:g}"
        result.add(f"quality: {name} held-out loss", curve.final, "nats", note)
        result.ratio(f"{name} loss / DiLoCo fp32 loss", curve.final / base.final, "target ≤ 1.01")
    result.series["topk sweep"] = [c.to_dict() for c in (base, *curves)]


def report_variants(result: BenchResult, comparison: Comparison, log_dir: Path) -> None:
    """The overlapped outer step, the int4 wire and fragments against blocking DiLoCo at the same flags."""
    base = comparison.diloco
    jobs = [replace(base.job, side=side) for side in VARIANTS]
    for curve in run_jobs(jobs, log_dir):
        result.add(f"quality: {curve.label} held-out loss", curve.final, "nats", f"{curve.seconds:.0f} s")
        result.ratio(f"DiLoCo {curve.job.side} loss / DiLoCo loss", curve.final / base.final, "target ≤ 1.01")


@dataclass(frozen=True)
class QualityRun:
    """The short comparison `swarmnode bench train` adds (its --nodes, --inner-steps, --rounds)."""

    workers: int
    inner_steps: int
    outer_steps: int


def add_quality(result: BenchResult, run: QualityRun, log_dir: Path) -> None:
    setup = Setup("tiny", run.workers, run.inner_steps, run.outer_steps)
    report(result, compare(setup, log_dir), label="quality (tiny)")
