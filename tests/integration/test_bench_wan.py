"""`swarmnode bench wan`: real nodes on the bandwidth-capped namespace bed, blocking vs `--overlap on`.

Without root the bench refuses with one line and exit 2; with root a 2-node tiny run reports every
figure, each node sent the butterfly's share of Δ, and the all-reduce took at least the link cap's
bound (the cap fired: an uncapped veth moves the same bytes many times faster)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from swarmnode.bench import netbed, wan
from swarmnode.cli.main import main
from swarmnode.swarm.averaging import codecs


def test_the_wan_bench_without_root_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(netbed, "unavailable", lambda: "network namespaces need root")
    assert main(["bench", "wan", "--model", "tiny", "--nodes", "2", "--mbit", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "root" in err[0] and err[0].startswith("swarmnode bench: error:"), err


def test_the_wan_bench_refuses_a_bad_cap_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "wan", "--model", "tiny", "--nodes", "2", "--mbit", "0"]) == 2
    assert "--mbit" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_wan_bench_runs_both_modes_on_a_capped_bed() -> None:
    reason = netbed.unavailable()
    if reason is not None:
        pytest.skip(f"no network test bed here: {reason}")
    report, figures, ratios = _two_tiny_nodes_one_round_at_20_mbit(timeout=840)
    assert {
        "blocking: round wall / inner phase",
        "overlap: round wall / inner phase",
        "overlap round wall / blocking round wall",
        "blocking: all-reduce / bandwidth bound",
        "overlap: all-reduce / bandwidth bound",
    } <= set(ratios)
    assert all(v > 0 for v in ratios.values()), ratios
    delta_mb = figures["Δ on the wire (B)"]
    assert delta_mb * 1e6 == codecs.encoded_size("bf16", wan._parameters("tiny"))
    for mode in ("blocking", "overlap"):
        assert figures[f"{mode}: rounds measured"] == 1
        assert figures[f"{mode}: bytes sent per node per round"] == pytest.approx(delta_mb)  # 2(N-1)/N = 1
        assert ratios[f"{mode}: all-reduce / bandwidth bound"] > 0.8, "the link cap did not hold"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_wan_bench_compares_the_topk_wire_with_int4_bf16_and_its_own_overlap() -> None:
    reason = netbed.unavailable()
    if reason is not None:
        pytest.skip(f"no network test bed here: {reason}")
    report, figures, ratios = _two_tiny_nodes_one_round_at_20_mbit("--wire-dtype", "topk", timeout=1140)
    modes = ("topk", "int4", "bf16", wan.TOPK_OVERLAPPED)
    assert {f"{m}: round wall / inner phase" for m in modes} == set(ratios), ratios
    assert all(v > 0 for v in ratios.values()), ratios
    for mode in modes:
        assert figures[f"{mode}: round wall"] > 0
    # The top-k wire sends a small share of what int4 does, overlapped or not (2 nodes: one image each).
    topk_mb, int4_mb = (
        figures["topk: bytes sent per node per round"],
        figures["int4: bytes sent per node per round"],
    )
    assert 0 < topk_mb < int4_mb / 5, (topk_mb, int4_mb)
    assert figures[f"{wan.TOPK_OVERLAPPED}: bytes sent per node per round"] == pytest.approx(
        topk_mb, rel=0.05
    )
    assert set(report["series"]) == set(modes)


def _two_tiny_nodes_one_round_at_20_mbit(
    *extra: str, timeout: float
) -> tuple[dict[str, Any], dict[str, float], dict[str, float]]:
    """`swarmnode bench wan --json` for 2 tiny nodes, one round of 10 inner steps at 20 Mbit/s: the report,
    its figures and its ratios by name."""
    argv = ["bench", "wan", "--model", "tiny", "--json", "--nodes", "2", "--mbit", "20", *extra]
    argv += ["--rounds", "1", "--inner-steps", "10"]
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", *argv], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    figures = {f["name"]: f["value"] for f in report["figures"]}
    ratios = {r["name"]: r["value"] for r in report["ratios"]}
    return report, figures, ratios
