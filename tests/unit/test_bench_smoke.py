"""`swarmnode bench` runs and emits well-formed JSON (its speed is not asserted: machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_snapshot_bench_emits_json_with_ratios() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "bench", "snapshot", "--model", "tiny", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bench"] == "snapshot" and report["preset"] == "tiny"
    ratios = {r["name"]: r["value"] for r in report["ratios"]}
    assert {"stall / memcpy", "planes write / gzip-6 write"} <= set(ratios)
    assert all(v > 0 for v in ratios.values())
    assert report["peak_rss_mb"] > 0
