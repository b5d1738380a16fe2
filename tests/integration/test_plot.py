"""`swarmnode plot`: a real node's ledger and JSON log become a PNG of its loss, held-out loss and
tokens/s; a dir that is no node's is a usage error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image

from swarmnode.bench.plotting import SERIES_KEY
from swarmnode.core.ledger import STATS, read_ledger
from swarmtest import start_swarm


def plot(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "swarmnode.cli", "plot", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_plot_draws_a_nodes_ledger_and_log(tmp_path: Path, reaper) -> None:
    args = ("--inner-steps", "15", "--max-outer-steps", "2", "--run-id", "plot")
    (node,) = start_swarm(reaper, tmp_path, 1, (*args, "--log-format", "json", "--progress-interval", "0.2"))
    assert node.wait(120) == 0, node.log()
    rounds = [e for e in read_ledger(node.data_dir) if e["event"] in ("round", "settle")]
    assert len(rounds) == 4 and all(set(STATS) <= set(e) for e in rounds), rounds
    assert all(e["heldout_loss"] is not None for e in rounds if e["event"] == "settle")
    out = tmp_path / "node.png"
    done = plot(str(node.data_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    image = Image.open(out)
    assert image.format == "PNG" and image.height > image.width > 400  # three panels stacked
    assert image.text[SERIES_KEY].split("\n") == [f"{node.data_dir.name} ({rounds[0]['node_id'][:8]})"]


def test_plot_refuses_a_dir_without_a_ledger_and_a_non_png(tmp_path: Path) -> None:
    missing = plot(str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert missing.returncode == 2 and "ledger.jsonl" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    wrong = plot(str(tmp_path), "--out", str(tmp_path / "x.jpg"))
    assert wrong.returncode == 2 and "--out" in wrong.stderr
