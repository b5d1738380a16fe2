"""`swarmnode bench` runs and emits well-formed JSON (its speed is not asserted: machines are noisy).

Each bench runs once with the tiny preset and its size knobs turned down, as a user would run it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest


def run_bench(name: str, *knobs: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "bench", name, "--model", "tiny", "--json", *knobs],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.stdout)
    assert report["bench"] == name and report["preset"] == "tiny"
    assert report["peak_rss_mb"] > 0
    for figure in report["figures"] + report["ratios"]:
        assert set(figure) == {"name", "value", "unit", "note"}
        assert math.isfinite(figure["value"]), figure
    return report


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """The report's ratios; each positive, but for a share of a gain (a 6-step DiLoCo may trail one
    worker: its share of DP's gain is then below 0)."""
    values = {r["name"]: r["value"] for r in report["ratios"]}
    assert all(v > 0 for name, v in values.items() if "share" not in name), values
    return values


def test_snapshot_bench_emits_json_with_ratios() -> None:
    report = run_bench("snapshot", "--rounds", "3")
    assert {"stall / memcpy", "planes write / gzip-6 write"} <= set(ratios(report))


def test_fetch_bench_compares_grpc_with_raw_tcp() -> None:
    report = run_bench("fetch", "--rounds", "2")
    assert {"fetch / raw (same work)", "fetch / raw (receive only)"} <= set(ratios(report))


def test_allreduce_bench_reports_each_wire_dtype_against_the_bound() -> None:
    report = run_bench("allreduce", "--nodes", "3", "--rounds", "1")
    wanted = {f"all-reduce {dtype} / butterfly bound" for dtype in ("fp32", "bf16", "int8", "int4")}
    wanted |= {"all-reduce fp32 / gloo fp32", "all-reduce bf16 / gloo fp32"}
    assert wanted <= set(ratios(report))
    coverage = [f["note"] for f in report["figures"] if f["name"].startswith("all-reduce ")]
    assert all("coverage 1.00" in note for note in coverage), coverage


def test_recovery_bench_times_a_kill_and_each_stage() -> None:
    report = run_bench("recovery", "--steps", "2")
    assert {"recovery / slowest stage", "recovery / sum of its stages alone"} <= set(ratios(report))
    names = {f["name"] for f in report["figures"]}
    assert {"kill → trained again (first inner step)", "recovery (restart receipt)"} <= names


def test_train_bench_compares_node_with_bare_loop_and_diloco_with_dp() -> None:
    report = run_bench("train", "--steps", "10", "--nodes", "2", "--inner-steps", "3", "--rounds", "2")
    wanted = {"node / bare loop tokens/s", "DiLoCo loss / sync DP loss", "sync DP bytes / DiLoCo bytes"}
    assert wanted <= set(ratios(report))


def test_a_knob_the_bench_does_not_take_is_a_usage_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "bench", "fetch", "--model", "tiny", "--nodes", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--nodes" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_quality_bench_compares_three_sides_and_plots_them(tmp_path) -> None:
    from PIL import Image

    from swarmnode.bench.plotting import SERIES_KEY

    png = tmp_path / "quality.png"
    knobs = ("--workers", "2", "--inner-steps", "2", "--rounds", "2", "--plot", str(png))
    report = run_bench("quality", *knobs)
    wanted = {
        "DiLoCo loss / sync DP loss",
        "DiLoCo share of DP's gain over one worker",
        "sync DP bytes / DiLoCo bytes",
    }
    assert wanted <= set(ratios(report))
    curves = report["series"]["quality"]
    assert [c["job"]["side"] for c in curves] == ["diloco", "dp", "single"]
    assert all(len(c["losses"]) == 3 for c in curves)  # the start and after each of 2 outer steps
    assert len(Image.open(png).text[SERIES_KEY].split("\n")) == 3


@pytest.mark.slow
def test_swarm_bench_emits_json_per_swarm_size() -> None:
    report = run_bench("swarm", "--nodes", "2,3", "--rounds", "1", "--group-size", "2", "--inner-steps", "5")
    names = {f["name"] for f in report["figures"]}
    for n in (2, 3):
        assert {f"N={n}: matchmaking per round", f"N={n}: DHT requests per node per round"} <= names
    assert "overhead share N=3 / N=2" in ratios(report)


def test_swarm_bench_plot_draws_both_panels_through_the_shared_plotting(tmp_path) -> None:
    from PIL import Image

    from swarmnode.bench.plotting import SERIES_KEY
    from swarmnode.bench.swarm import SwarmFigures, _plot

    measured = [SwarmFigures(n, 0.1 * n, 0.2, 50.0, 4.0, 4.0, 2.0 + n, 300.0) for n in (2, 4)]
    png = tmp_path / "swarm.png"
    _plot(measured, 2, png)
    labels = Image.open(png).text[SERIES_KEY].split("\n")
    assert len(labels) == 6 and {"round wall time (anchor)", "overhead / round wall time"} <= set(labels)


def test_swarm_sizes_are_a_list_only_for_the_swarm_bench() -> None:
    for knobs in (["allreduce", "--nodes", "2,4"], ["swarm", "--nodes", "8,x"]):
        out = subprocess.run(
            [sys.executable, "-m", "swarmnode.cli", "bench", *knobs, "--model", "tiny"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (knobs, out.stderr)
        assert "--nodes" in out.stderr.strip().splitlines()[-1]
