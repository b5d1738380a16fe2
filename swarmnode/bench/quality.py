"""`swarmnode bench quality`: DiLoCo against synchronous data parallel and a single worker at equal tokens
per worker (`quality_sim.py` simulates the three sides), with a sweep of their settings first
(`quality_sweep.py`), real nodes against the simulation (`swarm_quality.py`) or the curves drawn
(`quality_plot.py`)."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from swarmnode.bench import quality_sim
from swarmnode.bench.quality_sim import (
    DEFAULT_INNER_STEPS,
    DEFAULT_ROUNDS,
    DEFAULT_WORKERS,
    Setup,
    compare,
    report,
    report_variants,
)
from swarmnode.bench.quality_sweep import run_sweep
from swarmnode.bench.runner import BenchResult
from swarmnode.bench.swarm_quality import bench_swarm
from swarmnode.util.errors import ConfigError


def bench_quality(
    preset_name: str,
    workers: int | None = None,
    inner_steps: int | None = None,
    rounds: int | None = None,
    plot: str | None = None,
    sweep: bool = False,
    swarm: bool = False,
    variants: bool = False,
    topk_sweep: Sequence[float] | None = None,
    topk_outer_lr: float | None = None,
) -> BenchResult:
    """`--workers`, `--inner-steps`, `--rounds` size the run; `--plot FILE.png` draws the curves;
    `--sweep` tunes the learning rates, outer lr and H first, at the same inner-step budget; `--swarm`
    runs real nodes against the simulated DiLoCo instead (`bench/swarm_quality.py`); `--variants` adds
    the overlapped outer step, the int4 wire and `--fragments FRAGMENTS` beside blocking DiLoCo, same
    learning rates; `--topk-sweep D,…` runs blocking DiLoCo fp32 against the top-k wire at each density
    instead (and `--plot` draws those curves); `--topk-outer-lr A` sets the top-k sides' α (default the
    node's)."""
    if plot is not None and not plot.endswith(".png"):
        raise ConfigError(f"--plot: must name a .png file, got {plot!r}")
    setup = Setup(
        preset_name,
        workers or DEFAULT_WORKERS,
        inner_steps or DEFAULT_INNER_STEPS,
        rounds or DEFAULT_ROUNDS,
    )
    if topk_outer_lr is not None:
        if not 0 < topk_outer_lr < math.inf:  # the node's --outer-lr rule (NaN fails it too)
            raise ConfigError(f"--topk-outer-lr: must be a positive number, got {topk_outer_lr:g}")
        setup = replace(setup, topk_outer_lr=topk_outer_lr)
    result = BenchResult("quality", preset_name)
    if topk_sweep:
        with tempfile.TemporaryDirectory() as tmp:
            base, curves = quality_sim.topk_sweep(setup, topk_sweep, Path(tmp))
        quality_sim.report_topk_sweep(result, base, curves)
        if plot is not None:
            from swarmnode.bench.quality_plot import plot_curves

            plot_curves([base, *curves], Path(plot), "top-k density sweep")
            result.add("plot", len(curves) + 1, "series", plot)
        return result
    if swarm:
        with tempfile.TemporaryDirectory() as tmp:
            bench_swarm(result, setup, Path(tmp))
        return result
    with tempfile.TemporaryDirectory() as tmp:
        if sweep:
            setup, comparison = run_sweep(result, setup, Path(tmp))
        else:
            comparison = compare(setup, Path(tmp))
        if variants:
            report_variants(result, comparison, Path(tmp))
    report(result, comparison)
    if plot is not None:
        from swarmnode.bench.quality_plot import plot_comparison  # matplotlib only for --plot

        plot_comparison(comparison, Path(plot))
        result.add("plot", len(comparison.curves()), "series", plot)
    return result
