"""Real `swarmnode run` nodes train the same model as the simulated DiLoCo at the same flags: the
held-out loss of every node after every round agrees with the simulation's (slow: real rounds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_swarm_matches_the_simulation_round_by_round() -> None:
    knobs = ("--swarm", "--workers", "3", "--inner-steps", "20", "--rounds", "3", "--json")
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "bench", "quality", "--model", "tiny", *knobs],
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    figures = {f["name"]: f["value"] for f in report["figures"]}
    assert figures["swarm: rounds every node averaged with all"] == 3
    assert figures["swarm vs simulation: worst |ratio − 1|"] <= 0.005, report["series"]["swarm"]
