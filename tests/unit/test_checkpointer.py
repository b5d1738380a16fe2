"""The speculative checkpointer: never blocks on hot snapshots, survives bad disks, keeps retention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmnode import faults
from swarmnode.checkpointer import CheckpointerConfig, SpeculativeCheckpointer
from swarmnode.metrics import Metrics
from swarmnode.snapshot import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot_read import read_snapshot


def state(value: float) -> dict[str, torch.Tensor]:
    return {"model/w": torch.full((64, 64), value), "rng/torch": torch.random.get_rng_state()}


def meta(step: int) -> dict:
    return {"outer_step": 0, "inner_step": step, "run_id": "r", "node_id": "n"}


@pytest.fixture
def no_faults():
    yield
    faults.configure(None)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def test_hot_snapshots_are_skipped_not_waited_for_while_a_slow_write_runs(tmp_path: Path, no_faults) -> None:
    faults.configure("sleep@snapshot_write=1.0")
    metrics = Metrics()
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path), metrics)
    try:
        assert ckpt.snapshot(state(1.0), meta(1), "hot")
        results = [ckpt.snapshot(state(float(i)), meta(i), "hot") for i in range(2, 6)]
        still_writing = not ckpt.wait_idle(0)
        assert results == [False] * 4
        assert still_writing, "the training thread waited for the slow write"
        assert sample(metrics, "swarmnode_snapshots_skipped_total") == 4
        # a cold snapshot is never skipped: it waits for the slow write, and the wait counts as stall
        assert ckpt.snapshot(state(9.0), meta(9), "cold")
        assert ckpt.wait_idle(30)
    finally:
        ckpt.close()
    kinds = sorted(p.name.split("-")[0] for p in iter_snapshot_files(tmp_path))
    assert kinds == ["cold", "hot"]
    assert sample(metrics, "swarmnode_snapshot_stall_seconds_count", kind="cold") == 1
    assert sample(metrics, "swarmnode_snapshot_stall_seconds_sum", kind="cold") > 0


def test_staged_copy_is_taken_at_snapshot_time(tmp_path: Path, no_faults) -> None:
    faults.configure("sleep@snapshot_write=0.3")
    live = state(1.0)
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path), Metrics())
    try:
        ckpt.snapshot(live, meta(1), "hot")
        live["model/w"].fill_(2.0)  # training goes on while the write is in flight
        assert ckpt.wait_idle(30)
    finally:
        ckpt.close()
    loaded = read_snapshot(next(iter_snapshot_files(tmp_path)))
    assert torch.equal(loaded.tensors["model/w"], torch.full((64, 64), 1.0))


def test_retention_keeps_the_newest_of_each_kind(tmp_path: Path) -> None:
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path, keep_hot=2, keep_cold=1), Metrics())
    try:
        for step in range(1, 6):
            ckpt.snapshot(state(step), meta(step), "hot")
            ckpt.wait_idle(30)
            ckpt.snapshot(state(step), meta(step), "cold")
            ckpt.wait_idle(30)
    finally:
        ckpt.close()
    kept = sorted(parse_snapshot_name(p.name)[:3] for p in iter_snapshot_files(tmp_path))
    assert kept == [("cold", 0, 5), ("hot", 0, 4), ("hot", 0, 5)]
    assert [s.inner_step for s in ckpt.list_snapshots()] == [4, 5, 5]


def test_unwritable_directory_is_counted_and_survived(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    metrics = Metrics()
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(blocker / "snaps"), metrics)
    try:
        for step in range(3):
            ckpt.snapshot(state(step), meta(step), "cold")
            assert ckpt.wait_idle(30)
    finally:
        ckpt.close()
    assert sample(metrics, "swarmnode_snapshot_failures_total", reason="io_error") == 3
    assert ckpt.list_snapshots() == []


def test_adopting_existing_files_sets_corrupt_ones_aside(tmp_path: Path) -> None:
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path, keep_hot=5), Metrics())
    for step in (1, 2):
        ckpt.snapshot(state(step), meta(step), "hot")
        ckpt.wait_idle(30)
    ckpt.close()
    newest = next(iter_snapshot_files(tmp_path))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 1
    newest.write_bytes(bytes(data))
    again = SpeculativeCheckpointer(CheckpointerConfig(tmp_path, keep_hot=5), Metrics())
    try:
        adopted = again.adopt_existing()
    finally:
        again.close()
    assert [s.inner_step for s in adopted] == [1]
    assert newest.with_name(newest.name + ".corrupt").exists()
    assert again.find(None).inner_step == 1
