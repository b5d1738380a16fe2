"""The speculative checkpointer: never blocks on hot snapshots, survives bad disks, keeps retention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmnode.snapshot.checkpointer import CheckpointerConfig, SnapshotOwner, SpeculativeCheckpointer
from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot.read import read_snapshot
from swarmnode.util import faults
from swarmnode.util.metrics import Metrics
from swarmtest import sound_file, tmpfs, with_metadata

NODE = "ab" * 20
RUN = "1" * 64
OTHER_RUN = "2" * 64


def state(value: float) -> dict[str, torch.Tensor]:
    return {"model/w": torch.full((64, 64), value), "rng/torch": torch.random.get_rng_state()}


def meta(step: int, outer: int = 0, run_digest: str = RUN, node_id: str = NODE, **changes: object) -> dict:
    """Metadata as a node writes it (every field the catalogue validates)."""
    cursor = {"shard": 0, "epoch": 0, "position": 4 * step}
    return {
        "run_id": "r",
        "node_id": node_id,
        "run_digest": run_digest,
        "corpus_digest": "c" * 64,
        "model": "tiny",
        "outer_step": outer,
        "inner_step": step,
        "round_step": step,
        "round_tokens": 0,
        "tokens": 256 * step,
        "last_loss": 2.5,
        "heldout_loss": None,
        "cursor": cursor,
        "committed_cursor": cursor,
        "swarm_cursors": {NODE: cursor},
        "last_round": None,
        "global_digest": "d" * 64,
        "optimizer": {"adam_step": step, "schedule_step": step},
        "created_at": 1.7e9 + step,
        **changes,
    }


def owner(run_digest: str = RUN) -> SnapshotOwner:
    live = state(0.0)
    return SnapshotOwner(NODE, run_digest, {n: (t.dtype, tuple(t.shape)) for n, t in live.items()})


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
    assert ckpt.save_health().failing == "io_error"


def big_state(seed: int) -> dict[str, torch.Tensor]:
    """About 1 MB of incompressible state: a few fit on a small tmpfs."""
    return {"model/w": torch.rand((512, 512), generator=torch.Generator().manual_seed(seed))}


def test_a_full_disk_makes_room_from_the_oldest_snapshots(tmp_path: Path) -> None:
    metrics = Metrics()
    with tmpfs(tmp_path, "3500k"):
        ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path, keep_hot=5, keep_cold=5), metrics)
        try:
            for step in range(1, 7):
                ckpt.snapshot(big_state(step), meta(step), "cold" if step == 2 else "hot")
                assert ckpt.wait_idle(30)
                assert ckpt.save_health().failing is None, f"step {step}: {ckpt.save_health()}"
        finally:
            ckpt.close()
        kept = sorted((s.kind, s.inner_step) for s in ckpt.list_snapshots())
        on_disk = sorted(parse_snapshot_name(p.name)[::3] for p in iter_snapshot_files(tmp_path))
    assert ("hot", 6) in kept and len(kept) < 6, kept  # the oldest went early, the newest stayed
    assert ("cold", 2) in kept, f"a hot snapshot goes before a cold one: {kept}"
    assert len(on_disk) == len(kept)
    assert sample(metrics, "swarmnode_snapshot_evictions_total") == 6 - len(kept)
    assert sample(metrics, "swarmnode_snapshot_failures_total", reason="disk_full") == 0


def test_a_state_that_cannot_be_saved_is_reported_each_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import swarmnode.snapshot.checkpointer as checkpointer

    metrics = Metrics()
    with tmpfs(tmp_path, "1500k"):
        ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path), metrics)
        try:
            for step in range(1, 4):  # the first fits; the newest is never removed for the next
                ckpt.snapshot(big_state(step), meta(step), "hot")
                assert ckpt.wait_idle(30)
            health = ckpt.save_health()
            assert (health.failing, health.failures_in_a_row, health.newest_on_disk) == (
                "disk_full",
                2,
                (0, 1),
            )
            assert sample(metrics, "swarmnode_snapshot_save_failing") == 1
            assert "newest snapshot on disk: o0/i1" in health.describe()
            assert caplog.text.count("snapshot write failed (disk_full)") == 1  # rate-limited...
            monkeypatch.setattr(checkpointer, "FAILURE_LOG_INTERVAL_S", 0.0)
            ckpt.snapshot(big_state(4), meta(4), "hot")
            assert ckpt.wait_idle(30)
            assert caplog.text.count("snapshot write failed (disk_full)") == 2  # ...not once per process
            assert "2 failed write(s) since the last such line" in caplog.text
        finally:
            ckpt.close()
        assert [s.inner_step for s in ckpt.list_snapshots()] == [1]
        assert not list(tmp_path.glob(".tmp-*")), "a failed write leaves no temporary file"
    assert sample(metrics, "swarmnode_snapshot_failures_total", reason="disk_full") == 3


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


def write_all(directory: Path, snapshots: list[tuple[dict, str]], keep: int = 50) -> None:
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(directory, keep_hot=keep, keep_cold=keep), Metrics())
    try:
        for metadata, kind in snapshots:
            ckpt.snapshot(state(1.0), metadata, kind)
            assert ckpt.wait_idle(30)
    finally:
        ckpt.close()


def test_snapshots_of_another_configuration_are_ignored_and_never_deleted(tmp_path: Path) -> None:
    """A `--seed` change in the same data dir: the old run's snapshots (at higher steps) must neither
    rank above this run's in retention nor be deleted by it."""
    old = [
        (meta(i, outer=10 + i, run_digest=OTHER_RUN), kind) for i in range(1, 5) for kind in ("hot", "cold")
    ]
    write_all(tmp_path, old)
    foreign = sorted(p.name for p in iter_snapshot_files(tmp_path))
    ckpt = SpeculativeCheckpointer(
        CheckpointerConfig(tmp_path, keep_hot=2, keep_cold=1), Metrics(), owner=owner()
    )
    try:
        assert ckpt.adopt_existing() == []
        for step in range(1, 5):
            ckpt.snapshot(state(step), meta(step, outer=step), "hot")
            ckpt.wait_idle(30)
            ckpt.snapshot(state(step), meta(step, outer=step), "cold")
            ckpt.wait_idle(30)
        kept = [(s.kind, s.outer_step) for s in ckpt.list_snapshots()]
        newest = ckpt.find(None)
    finally:
        ckpt.close()
    assert kept == [("hot", 3), ("hot", 4), ("cold", 4)]
    assert newest is not None and newest.outer_step == 4  # what `fetch latest` serves
    on_disk = {p.name for p in iter_snapshot_files(tmp_path)}
    assert set(foreign) <= on_disk, "retention deleted another configuration's snapshots"
    assert len(on_disk) == len(foreign) + 3


def test_a_crafted_file_claiming_a_terabyte_never_enters_the_catalogue(tmp_path: Path) -> None:
    write_all(tmp_path, [(meta(1, outer=1), "cold"), (meta(2, outer=2), "cold")])
    info = {"format": "swarmnode-snapshot", "format_version": "1", "layout": "plain"}
    document = {
        "__metadata__": {
            **info,
            "swarmnode": json.dumps(meta(0, outer=999, kind="cold", layout="plain")),
        },
        "model/w": {"dtype": "F32", "shape": [1 << 38], "data_offsets": [0, 1 << 40]},
    }
    crafted = sound_file(tmp_path, document, "cold", 999)
    ckpt = SpeculativeCheckpointer(
        CheckpointerConfig(tmp_path, keep_hot=1, keep_cold=2), Metrics(), owner=owner()
    )
    try:
        adopted = ckpt.adopt_existing()
        ckpt.snapshot(state(3.0), meta(3, outer=3), "cold")
        ckpt.wait_idle(30)
        newest = ckpt.find(None)
    finally:
        ckpt.close()
    assert sorted(s.outer_step for s in adopted) == [1, 2]
    assert newest is not None and newest.outer_step == 3
    assert not crafted.exists() and crafted.with_name(crafted.name + ".corrupt").exists()
    assert sorted(parse_snapshot_name(p.name)[1] for p in iter_snapshot_files(tmp_path)) == [2, 3]


@pytest.mark.parametrize(
    ("field", "value"), [("created_at", "yesterday"), ("inner_step", "lots"), ("committed_cursor", [1, 2])]
)
def test_a_hash_valid_file_with_a_malformed_field_is_quarantined_with_one_warning(
    tmp_path: Path, field: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    write_all(tmp_path, [(meta(1, outer=1), "cold"), (meta(2, outer=2), "cold")])
    bad = with_metadata(next(iter_snapshot_files(tmp_path)), {field: value})
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path), Metrics(), owner=owner())
    try:
        with caplog.at_level("WARNING"):
            adopted = ckpt.adopt_existing()
    finally:
        ckpt.close()
    assert [s.outer_step for s in adopted] == [1]
    assert bad.with_name(bad.name + ".corrupt").exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and field in warnings[0], warnings


def test_the_training_runs_metadata_reads_back_field_for_field() -> None:
    """The fields are declared once (StateMetadata): what a run writes is what a reader validates."""
    import dataclasses

    from swarmnode.bench.runner import trained_run
    from swarmnode.snapshot.metadata import SnapshotMetadata, StateMetadata

    written = trained_run("tiny", 2, 64, 2).state_metadata()
    read = SnapshotMetadata.parse({**written, "kind": "hot", "layout": "planes"})
    assert {f.name for f in dataclasses.fields(StateMetadata)} == set(written)
    assert StateMetadata(**{k: getattr(read, k) for k in written}).to_dict() == written
