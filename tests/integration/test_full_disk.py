"""A full disk never loses work silently: a node whose snapshot disk fills up mid-run says so (log,
status, metric) and, stopped before room is made, exits 1 naming the newest step on disk; a restart
resumes exactly there. Real `swarmnode run` processes, the disk a small tmpfs (root; skipped without)."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import metric_value, node_status, tmpfs, wait_for

pytestmark = pytest.mark.timeout(240)
ONE_LONG_ROUND = ("--inner-steps", "100000", "--hot-every", "5", "--keep-hot", "1", "--keep-cold", "1")


def fill(directory: Path) -> Path:
    """Write a file in `directory` until its filesystem has no byte left."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        size = 1 << 20
        while size:  # big writes, then ever smaller ones for the last pages
            try:
                os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                size //= 2
    finally:
        os.close(fd)
    return filler


def newest_on_disk(snapshots: Path) -> tuple[int, int]:
    steps = [parse_snapshot_name(p.name)[1:3] for p in iter_snapshot_files(snapshots)]
    return max(steps)  # type: ignore[type-var]


def test_a_stop_whose_final_snapshot_fails_exits_1_naming_the_newest_step_on_disk(
    tmp_path: Path, reaper
) -> None:
    data_dir = tmp_path / "node"
    snapshots = data_dir / "snapshots"
    snapshots.mkdir(parents=True)
    with tmpfs(snapshots, "20m"):  # room for about three tiny snapshots
        node = reaper.node(data_dir, ONE_LONG_ROUND).start()
        node.wait_ready()
        wait_for(lambda: list(iter_snapshot_files(snapshots)), 60, "a first snapshot")
        filler = fill(snapshots)
        wait_for(
            lambda: (
                metric_value(node.metrics(), "swarmnode_snapshot_failures_total", 'reason="disk_full"') >= 2
            ),
            60,
            "two writes to fail on the full disk",
        )
        assert metric_value(node.metrics(), "swarmnode_snapshot_save_failing") == 1
        status = node_status(node)
        saved = newest_on_disk(snapshots)
        assert "snapshot writes failing (disk_full" in status["snapshot_error"], status
        assert f"newest snapshot on disk: o{saved[0]}/i{saved[1]}" in status["snapshot_error"], status
        wait_for(lambda: node_status(node)["inner_step"] >= saved[1] + 20, 60, "training to go on")

        node.signal(signal.SIGTERM)
        assert node.wait(60) == 1, node.log_tail()
        last = node.log().strip().splitlines()[-1]
        assert last.startswith("swarmnode run: error: the final snapshot failed (disk_full)"), last
        assert f"the newest snapshot on disk is o{saved[0]}/i{saved[1]}" in last, last
        assert newest_on_disk(snapshots) == saved  # the state it stopped at is not on disk
        assert "snapshot write failed (disk_full)" in node.log()

        os.unlink(filler)  # room again: the restart resumes from the newest snapshot on disk
        node.restart()
        receipt = wait_for(lambda: read_receipts(data_dir)[1:], 60, "the restart's receipt")[0]
        assert (receipt["source"], receipt["inner_step"]) == ("local", saved[1]), receipt
        wait_for(lambda: newest_on_disk(snapshots)[1] > saved[1], 60, "a snapshot written again")
        assert node_status(node)["snapshot_error"] == ""
        node.signal(signal.SIGTERM)
        assert node.wait(60) == 0, node.log_tail()
