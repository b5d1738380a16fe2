"""A single node: hot snapshots never block training, and export publishes plain safetensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from swarmnode.snapshot.read import read_snapshot
from swarmtest import metric_value, newest_snapshot, node_status, scrape, start_swarm, stop_all, wait_for


def test_a_slow_disk_skips_hot_snapshots_and_never_blocks_training(tmp_path: Path, reaper) -> None:
    args = ("--inner-steps", "1000", "--hot-every", "2", "--run-id", "slow-disk")
    (node,) = start_swarm(reaper, tmp_path, 1, args, faults=["sleep@snapshot_write=3"])
    first = wait_for(
        lambda: node_status(node)["inner_step"] > 5 and node_status(node)["inner_step"], 60, "steps"
    )
    # one write takes 3 s; meanwhile training goes on at full speed and the due hot snapshots are skipped
    wait_for(
        lambda: node_status(node)["inner_step"] > first + 40, 60, "training to go on during a slow write"
    )
    assert metric_value(scrape(node), "swarmnode_snapshots_skipped_total") >= 10
    stop_all([node])


def test_export_writes_the_global_weights_as_plain_safetensors(tmp_path: Path, reaper) -> None:
    (node,) = start_swarm(
        reaper, tmp_path, 1, ("--inner-steps", "20", "--max-outer-steps", "2", "--run-id", "export")
    )
    assert node.wait(120) == 0
    snapshot = newest_snapshot(node.data_dir)
    out = tmp_path / "model.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "export", str(snapshot), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    exported = load_file(str(out))
    tensors = read_snapshot(snapshot).tensors
    globals_ = {name.removeprefix("global/"): t for name, t in tensors.items() if name.startswith("global/")}
    assert set(exported) == set(globals_)
    assert all(torch.equal(exported[name], t) for name, t in globals_.items())
    bad = tmp_path / "bad.snap.zst"
    bad.write_bytes(snapshot.read_bytes()[:1000])
    failed = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "export", str(bad), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 1 and len(failed.stderr.strip().splitlines()) == 1
