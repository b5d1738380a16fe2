"""`swarmnode bench recovery --peers K --mbit R`: one peer against K at once on the capped namespace bed.

Without root (or with a bad knob) the bench refuses with one line and exit 2; with root a tiny run
recovers once from one peer and once from two, and the second's receipt names both peers and their
ranges. The ratio itself is not asserted (tiny's state is a few MB: latency, not bandwidth)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmnode.bench import netbed
from swarmnode.cli.main import main


def test_recovery_from_many_peers_bench_without_root_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(netbed, "unavailable", lambda: "network namespaces need root")
    assert main(["bench", "recovery", "--model", "tiny", "--peers", "3", "--mbit", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "root" in err[0], err


@pytest.mark.parametrize(("knob", "value"), [("--peers", "1"), ("--mbit", "0")])
def test_recovery_from_many_peers_bench_refuses_bad_knobs(
    knob: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "recovery", "--model", "tiny", knob, value]) == 2
    assert knob in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recovery_from_two_peers_against_one_on_a_capped_bed() -> None:
    reason = netbed.unavailable()
    if reason is not None:
        pytest.skip(f"no network test bed here: {reason}")
    argv = ["bench", "recovery", "--model", "tiny", "--json", "--peers", "2", "--mbit", "20"]
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", *argv], capture_output=True, text=True, timeout=840
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    figures = {f["name"]: f for f in report["figures"]}
    ratios = {r["name"]: r["value"] for r in report["ratios"]}
    assert ratios["recovery from 2 peers / from one"] > 0
    assert figures["recovering node's link cap"]["value"] == 40
    assert figures["  from 2 peers: ranges per peer"]["value"] == 2
    assert figures["from 1 peer: recovery (restart receipt)"]["value"] > 0
