"""The quality bench's parts that need no long run: the simulated average is the reducer's, the sweep
picks each side's best (DiLoCo's among settings that save ≥ 100× bytes), and the plot is a PNG that
names its three series."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from swarmnode.bench import quality_sim, quality_sweep
from swarmnode.bench.plotting import SERIES_KEY
from swarmnode.bench.quality_plot import plot_comparison
from swarmnode.bench.quality_sim import Comparison, Curve, Setup, Side, SideJob
from swarmnode.bench.runner import BenchResult, run_bench
from swarmnode.core import sparse
from swarmnode.core.data import default_corpus
from swarmnode.swarm.averaging import codecs
from swarmnode.util.errors import ConfigError


def test_simulated_average_is_the_reducers_at_equal_weights() -> None:
    g = torch.Generator().manual_seed(0)
    d0, d1 = (torch.randn(1000, generator=g) for _ in range(2))
    averaged = quality_sim.group_average([d0, d1], "fp32")
    assert torch.equal(averaged.delta, (d0 + d1) / 2)
    assert (averaged.covered, averaged.group_size) == (((0, 1000),), 2)


def test_int4_average_passes_every_delta_and_the_mean_through_the_codec() -> None:
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(1000, generator=g) for _ in range(4)]

    def through(x: torch.Tensor) -> torch.Tensor:
        return codecs.decode(codecs.encode(x, "int4"), "int4", x.numel())

    mean = torch.zeros(1000)
    for d in deltas:
        mean.add_(through(d), alpha=1 / 4)
    averaged = quality_sim.group_average(deltas, "int4")
    assert torch.equal(averaged.delta, through(mean))
    assert not torch.equal(averaged.delta, quality_sim.group_average(deltas, "fp32").delta)
    assert (averaged.covered, averaged.group_size) == (((0, 1000),), 4)


def fake_curve(job: SideJob) -> Curve:
    """A made-up final loss: lower for a higher outer lr and a smaller H, best at peak lr 2e-3."""
    loss = 2.0 - 0.1 * job.outer_lr + job.inner_steps / 1000 + abs(job.lr - 2e-3) * 100
    loss += {Side.DILOCO: 0.0, Side.DP: -0.2, Side.SINGLE: 0.3}[job.side]
    return Curve(job, (0, 1), (4.0, loss), 1.0, 1000)


def test_sweep_picks_each_sides_best_and_a_frugal_h(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[SideJob] = []

    def run_jobs(jobs: list[SideJob], log_dir: Path, processes: int = 1) -> list[Curve]:
        asked.extend(jobs)
        return [fake_curve(job) for job in jobs]

    monkeypatch.setattr(quality_sweep, "run_jobs", run_jobs)
    result = BenchResult("quality", "tiny")
    chosen, comparison = quality_sweep.run_sweep(
        result, Setup(inner_steps=100, rounds=10, lr_diloco=2e-3), Path(".")
    )
    # H=50 is best overall but sends only 50× fewer bytes than DP: the choice is H=100.
    assert (chosen.inner_steps, chosen.rounds, chosen.outer_lr) == (100, 10, 1.0)
    assert (chosen.lr_diloco, chosen.lr_dp, chosen.lr_single) == (2e-3, 2e-3, 2e-3)
    assert {(j.inner_steps, j.rounds) for j in asked if j.side is Side.DILOCO} == {
        (50, 20),
        (100, 10),
        (250, 4),
    }
    lrs, mixes = len(quality_sweep.PEAK_LRS), len(quality_sweep.OUTER_MIXES)
    assert len(asked) == 12 + 2 * lrs + (lrs - 1) + (mixes - 1)
    assert {j.outer_mix for j in asked if j.side is Side.DILOCO} == set(quality_sweep.OUTER_MIXES)
    assert comparison.diloco.job.inner_steps == 100
    notes = {f.name: f.note for f in result.figures}
    mix = f"outer mix {Setup().outer_mix:g}"
    assert "best overall" in notes[f"sweep: DiLoCo H=50 outer lr 1 {mix} peak lr 0.002"]
    assert "chosen" in notes[f"sweep: DiLoCo H=100 outer lr 1 {mix} peak lr 0.002"]


def test_plot_is_a_png_with_three_labelled_series(tmp_path: Path) -> None:
    setup = Setup(workers=4, inner_steps=10, rounds=3)
    curves = [
        Curve(setup.job(side), (0, 10, 20, 30), (5.5, 3.0 - k / 10, 2.5 - k / 10, 2.2 - k / 10), 1.0, 100)
        for k, side in enumerate((Side.DILOCO, Side.DP, Side.SINGLE))
    ]
    path = tmp_path / "quality.png"
    labels = plot_comparison(Comparison(*curves), path)
    image = Image.open(path)
    assert image.format == "PNG" and image.width > 400 and image.height > 300
    assert (
        image.text[SERIES_KEY].split("\n")
        == labels
        == ["DiLoCo (4 workers)", "sync DP (4× batch)", "one worker"]
    )
    colours = np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)
    assert len(colours) > 20  # drawn, not blank


def test_swarm_nodes_get_the_simulated_workers_settings() -> None:
    import argparse

    from swarmnode.bench.swarm_quality import node_args
    from swarmnode.node.config import build_run_parser, load_config

    job = Setup(workers=4, inner_steps=25, rounds=6).job(Side.DILOCO, final_fraction=0.1)  # not the default
    args = build_run_parser(argparse.ArgumentParser()).parse_args(node_args(job, 2))
    cfg = load_config(vars(args), {}, None)
    assert cfg.inner_schedule == job.schedule and cfg.inner_schedule.final_fraction == 0.1
    assert (cfg.inner_lr, cfg.outer_lr, cfg.outer_momentum) == (job.lr, job.outer_lr, job.outer_momentum)
    assert (cfg.shard, cfg.num_shards, cfg.inner_steps, cfg.max_outer_steps) == (2, 4, 25, 6)
    assert (cfg.batch_size, cfg.seq_len, cfg.seed, cfg.threads) == (
        quality_sim.BATCH_SIZE,
        quality_sim.SEQ_LEN,
        0,
        1,
    )
    assert cfg.wire_dtype == "fp32" and cfg.model == job.model


def test_swarm_report_finds_the_worst_node_round_and_partial_groups() -> None:
    from swarmnode.bench.swarm_quality import report_swarm

    job = Setup(workers=2, inner_steps=5, rounds=2).job(Side.DILOCO)
    curve = Curve(job, (0, 1, 2), (5.0, 3.0, 2.0), 1.0, 100)
    settles = [
        [{"outer_step": 0, "status": "applied", "group_size": 2, "heldout_loss": 3.0},
         {"outer_step": 1, "status": "applied", "group_size": 2, "heldout_loss": 2.0}],
        [{"outer_step": 0, "status": "solo", "group_size": 1, "heldout_loss": 3.03},
         {"outer_step": 1, "status": "applied", "group_size": 2, "heldout_loss": 2.0}],
    ]  # fmt: skip
    result = BenchResult("quality", "tiny")
    report_swarm(result, curve, settles)
    figures = {f.name: f.value for f in result.figures}
    assert figures["swarm: rounds every node averaged with all"] == 1
    assert figures["swarm vs simulation: worst |ratio − 1|"] == pytest.approx(0.01)
    assert result.ratios[0].value == pytest.approx(1.0)


def test_the_fragments_variant_measures_after_every_h_steps_at_equal_tokens() -> None:
    job = SideJob(Side.FRAGMENTS, "tiny", 2, 6, 2, 2e-3)  # H = 6 in rounds of 1 or 2 steps (K = 4)
    curve = quality_sim.train_side(job)
    blocking = quality_sim.train_side(SideJob(Side.DILOCO, "tiny", 2, 6, 2, 2e-3))
    assert len(curve.losses) == len(blocking.losses) == 3 and curve.tokens == blocking.tokens
    assert curve.losses[0] == blocking.losses[0] and curve.losses[-1] != blocking.losses[-1]
    assert curve.losses[-1] < curve.losses[0]


def test_one_worker_trains_on_the_whole_corpus_and_the_workers_on_their_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []
    real_loader = quality_sim.loader

    def recording_loader(corpus: object, shard: int, workers: int) -> object:
        asked.append((shard, workers))
        return real_loader(corpus, shard, workers)  # type: ignore[arg-type]

    monkeypatch.setattr(quality_sim, "loader", recording_loader)
    quality_sim.train_side(SideJob(Side.SINGLE, "tiny", 4, 1, 1, 2e-3))
    assert asked[1:] == [(0, 1)]  # asked[0]: the held-out batches, the same for every side
    asked.clear()
    quality_sim.train_side(SideJob(Side.DILOCO, "tiny", 2, 1, 1, 2e-3))
    assert asked[1:] == [(0, 2), (1, 2)]


def test_the_attacks_bench_simulates_the_attacker_in_the_reducers_average() -> None:
    """A short attacked run: the attacker's Δ is what its attack says, the robust step keeps the honest
    worker's loss where the screen alone lets a flipped ×7 Δ through."""
    from swarmnode.bench.attacks import Attacker, AttackRun, run_attack

    delta = torch.randn(64, generator=torch.Generator().manual_seed(0))
    attacker = Attacker("flip", 64)
    assert torch.equal(attacker.send(delta), -7 * delta)
    attacker = Attacker("minus4", 64)
    attacker.last_average = delta
    assert torch.equal(attacker.send(torch.zeros(64)), -4 * delta)
    assert Attacker("noise", 64).send(delta).norm() == pytest.approx(float(delta.norm()), rel=1e-5)
    robust = run_attack(AttackRun("flip", "robust", 3, 3, 20, 3, "tiny"))
    screen_only = run_attack(AttackRun("flip", "screen only", 3, 3, 20, 3, "tiny"))
    assert robust < screen_only


def test_the_topk_sides_step_at_the_benchs_topk_outer_lr(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[SideJob] = []

    def run_jobs(jobs: list[SideJob], log_dir: Path, processes: int = 1) -> list[Curve]:
        asked.extend(jobs)
        return [Curve(job, (0, 1), (4.0, 2.0), 1.0, 1000) for job in jobs]

    monkeypatch.setattr(quality_sim, "run_jobs", run_jobs)
    result = run_bench("quality", "tiny", {"topk_sweep": (0.01,), "topk_outer_lr": 3.0, "inner_steps": 25})
    assert {job.side for job in asked} == {Side.DILOCO, Side.TOPK, Side.TOPK_ROBUST}
    assert all(job.topk_outer_lr == 3.0 and job.inner_steps == 25 for job in asked)
    corpus = default_corpus()
    steps = {job.side: quality_sim.trainer_for(corpus, job).cfg for job in asked}
    assert steps[Side.TOPK].outer_lr == steps[Side.TOPK_ROBUST].outer_lr == 3.0
    assert steps[Side.DILOCO].outer_lr == quality_sim.DEFAULT_OUTER_LR != 3.0
    assert any(ratio.name.startswith("top-k 0.01, α 3 loss") for ratio in result.ratios)


def test_the_topk_outer_lr_defaults_to_the_nodes_and_refuses_nonsense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Setup().job(Side.DILOCO).topk_outer_lr == sparse.DEFAULT_OUTER_LR == 2

    def run_jobs(jobs: list[SideJob], log_dir: Path, processes: int = 1) -> list[Curve]:
        raise AssertionError("a refused α trained")

    monkeypatch.setattr(quality_sim, "run_jobs", run_jobs)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--topk-outer-lr: must be a positive number"):
            run_bench("quality", "tiny", {"topk_sweep": (0.01,), "topk_outer_lr": bad})
    with pytest.raises(ConfigError, match="--topk-outer-lr: bench allreduce has no such knob"):
        run_bench("allreduce", "tiny", {"topk_outer_lr": 3.0})
