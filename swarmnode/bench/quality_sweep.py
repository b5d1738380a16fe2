"""`swarmnode bench quality --sweep`: tunes each side at one inner-step budget (the run's H × R) and
picks the defaults.

1. Synchronous DP and one worker each over the peak learning rates `PEAK_LRS`; DiLoCo over outer lr
   `OUTER_LRS` × H `INNER_STEPS` (R = budget / H rounds) at its current peak lr: all queued at once.
2. DiLoCo's peak lr over `PEAK_LRS` and its outer mix over `OUTER_MIXES`, each at its best (outer lr,
   H) and the other's first value.

DiLoCo's best is the lowest held-out loss among the settings whose DP bytes / DiLoCo bytes (= H) is
at least `MIN_BYTES_RATIO` (the point of DiLoCo); the table marks the best overall too. Every side
gets its own best learning rate, so no side is a weakened baseline. The result's comparison is made
of the three winners' curves (no run is repeated).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from swarmnode.bench.quality_sim import SIDE_PROCESSES, Comparison, Curve, Setup, Side, SideJob, run_jobs
from swarmnode.bench.runner import BenchResult

OUTER_LRS = (0.3, 0.5, 0.7, 1.0)
INNER_STEPS = (50, 100, 250)
PEAK_LRS = (1e-3, 2e-3, 3e-3, 4e-3, 8e-3, 1.6e-2)
OUTER_MIXES = (0.0, 0.3, 0.5)
MIN_BYTES_RATIO = 100


def run_sweep(result: BenchResult, setup: Setup, log_dir: Path) -> tuple[Setup, Comparison]:
    """The sweep's table in `result`, the chosen setup and the comparison of the three winners."""
    budget = setup.inner_steps * setup.rounds
    grid = [
        setup.job(Side.DILOCO, outer_lr=outer_lr, inner_steps=h, rounds=max(1, budget // h))
        for h in INNER_STEPS
        for outer_lr in OUTER_LRS
    ]
    baselines = [setup.job(side, lr=lr) for side in (Side.DP, Side.SINGLE) for lr in PEAK_LRS]
    processes = max(SIDE_PROCESSES, os.cpu_count() or 1)
    first = run_jobs([*grid, *baselines], log_dir, processes)  # the longest (DiLoCo) first
    diloco = _best_diloco(first[: len(grid)])
    dp = _best([c for c in first if c.job.side is Side.DP])
    single = _best([c for c in first if c.job.side is Side.SINGLE])
    inner = [replace(diloco.job, lr=lr) for lr in PEAK_LRS if lr != diloco.job.lr]
    inner += [replace(diloco.job, outer_mix=mix) for mix in OUTER_MIXES if mix != diloco.job.outer_mix]
    second = run_jobs(inner, log_dir, processes)
    diloco = _best([diloco, *second])
    _table(result, [*first, *second], (diloco, dp, single))
    chosen = Setup(
        setup.model,
        setup.workers,
        diloco.job.inner_steps,
        diloco.job.rounds,
        diloco.job.outer_lr,
        diloco.job.lr,
        dp.job.lr,
        single.job.lr,
        diloco.job.outer_mix,
        setup.topk_outer_lr,
    )
    return chosen, Comparison(diloco, dp, single)


def _best(curves: Sequence[Curve]) -> Curve:
    return min(curves, key=lambda c: c.final)


def _best_diloco(curves: Sequence[Curve]) -> Curve:
    frugal = [c for c in curves if c.job.inner_steps >= MIN_BYTES_RATIO]
    return _best(frugal or curves)


def _name(job: SideJob) -> str:
    if job.side is Side.DILOCO:
        return (
            f"sweep: DiLoCo H={job.inner_steps} outer lr {job.outer_lr:g} outer mix {job.outer_mix:g} "
            f"peak lr {job.lr:g}"
        )
    return f"sweep: {job.side} peak lr {job.lr:g}"


def _table(result: BenchResult, curves: Sequence[Curve], chosen: Sequence[Curve]) -> None:
    best_overall = _best([c for c in curves if c.job.side is Side.DILOCO])
    rows = []
    for curve in curves:
        hits = (("chosen", curve in chosen), ("best overall", curve is best_overall))
        marks = [mark for mark, hit in hits if hit]
        note = f"{curve.job.rounds} rounds, {curve.seconds:.0f} s" + "".join(f"; {m}" for m in marks)
        result.add(_name(curve.job), curve.final, "nats", note)
        rows.append({**curve.job.to_dict(), "loss": curve.final, "chosen": curve in chosen})
    result.series["sweep"] = rows
