"""kill -9 at an arbitrary point, restart with the same arguments: the run ends bit-identical."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot.read import read_snapshot
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import identity_file, newest_snapshot

# Both runs are the same node (one identity key), so they own the same shard and RNG stream.
RUN_ARGS = (
    "--inner-steps",
    "12",
    "--hot-every",
    "5",
    "--cold-every",
    "2",
    "--max-outer-steps",
    "3",
    "--keep-hot",
    "2",
    "--seed",
    "3",
    # A warm-up and a cosine over the run's 36 inner steps: the schedule's position must resume too.
    "--lr-schedule",
    "cosine",
    "--inner-warmup-steps",
    "6",
)


@pytest.fixture(scope="module")
def run_args(tmp_path_factory) -> tuple[str, ...]:
    return (*RUN_ARGS, "--identity", str(identity_file(tmp_path_factory)))


AFTER_A_SNAPSHOT = "kill@snapshot_halfway#2"
"""SIGKILL half-way through the second snapshot write: the one writer has finished the first, so a test
of what a restore brings back has a snapshot on disk however loaded the machine (a kill at a fixed
inner step can land while a fast run's first write is still going)."""


def final_state(data_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    loaded = read_snapshot(newest_snapshot(data_dir))
    return loaded.tensors, loaded.metadata


def straight_run(tmp_path_factory, args: tuple[str, ...], name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The final state of the run with `args`, never interrupted."""
    from swarmtest import ProcessReaper

    reaper = ProcessReaper()
    try:
        data_dir = tmp_path_factory.mktemp(name)
        node = reaper.node(data_dir, args).start()
        assert node.wait(180) == 0, node.log()
        return final_state(data_dir)
    finally:
        reaper.kill_all()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, run_args) -> tuple[dict[str, torch.Tensor], dict]:
    return straight_run(tmp_path_factory, run_args, "straight")


@pytest.fixture(scope="module")
def hf_run_args(tmp_path_factory, run_args) -> tuple[str, ...]:
    """The same run with a tiny Llama (`hf:` config) instead of the `tiny` preset."""
    from hfmodels import llama_config

    return (*run_args, "--model", f"hf:{llama_config(tmp_path_factory.mktemp('llama'))}")


@pytest.fixture(scope="module")
def hf_uninterrupted(tmp_path_factory, hf_run_args) -> tuple[dict[str, torch.Tensor], dict]:
    return straight_run(tmp_path_factory, hf_run_args, "straight-hf")


def assert_same_run(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    tensors, meta = got
    want_tensors, want_meta = want
    assert set(tensors) == set(want_tensors)
    for name, tensor in want_tensors.items():
        assert torch.equal(tensors[name], tensor), f"{name} differs after the restart"
    for key in ("outer_step", "inner_step", "cursor", "tokens", "global_digest", "last_loss"):
        assert meta[key] == want_meta[key], key
    for key in ("schedule_step", "lr"):
        assert meta["optimizer"][key] == want_meta["optimizer"][key], key


@pytest.mark.parametrize("fault", ["kill@inner_step#17", "kill@snapshot_halfway#3"])
def test_killed_run_continues_bit_identically(
    fault: str, tmp_path: Path, reaper, uninterrupted, run_args
) -> None:
    first = reaper.node(tmp_path, run_args, faults=fault).start()
    assert first.wait(180) == -signal.SIGKILL, first.log()
    complete = list(iter_snapshot_files(tmp_path / "snapshots"))  # the writer may lag on a loaded machine
    second = reaper.node(tmp_path, run_args).start()
    assert second.wait(180) == 0, second.log()
    assert not list((tmp_path / "snapshots").glob(".tmp-*")), "an interrupted write's temporary file was kept"
    assert_same_run(final_state(tmp_path), uninterrupted)
    receipts = read_receipts(tmp_path)
    if not complete:  # killed before its first write ended: it trains again from the start, identically
        assert [r["source"] for r in receipts] == ["fresh", "fresh"]
        return
    assert [r["source"] for r in receipts] == ["fresh", "local"]
    resumed = receipts[-1]
    assert resumed["snapshot_id"] == parse_snapshot_name(complete[0].name)[3]  # the newest complete one
    assert resumed["first_loss_after"] is not None and resumed["inner_step"] > 0
    if fault == "kill@inner_step#17":
        assert resumed["inner_step"] <= 17


def test_killed_hf_run_continues_bit_identically(
    tmp_path: Path, reaper, hf_uninterrupted, hf_run_args
) -> None:
    first = reaper.node(tmp_path, hf_run_args, faults="kill@inner_step#17").start()
    assert first.wait(180) == -signal.SIGKILL, first.log()
    second = reaper.node(tmp_path, hf_run_args).start()
    assert second.wait(180) == 0, second.log()
    assert_same_run(final_state(tmp_path), hf_uninterrupted)
    assert hf_uninterrupted[1]["model"].startswith("hf:")
    assert any(name.startswith("inner/model.layers.0.") for name in hf_uninterrupted[0])


# The same 36 inner steps in rounds of 4, each averaging (alone) one of 3 fragments: the schedule's place
# (which fragment, how far into its round) must resume exactly too.
_ROUNDS_AT = RUN_ARGS.index("--max-outer-steps") + 1
FRAGMENT_ARGS = (*RUN_ARGS[:_ROUNDS_AT], "9", *RUN_ARGS[_ROUNDS_AT + 1 :], "--fragments", "3")


@pytest.fixture(scope="module")
def uninterrupted_fragments(tmp_path_factory, run_args) -> tuple[dict[str, torch.Tensor], dict]:
    from swarmtest import ProcessReaper

    reaper = ProcessReaper()
    try:
        data_dir = tmp_path_factory.mktemp("straight-fragments")
        node = reaper.node(data_dir, (*FRAGMENT_ARGS, *run_args[len(RUN_ARGS) :])).start()
        assert node.wait(180) == 0, node.log()
        return final_state(data_dir)
    finally:
        reaper.kill_all()


def test_killed_fragmented_run_continues_bit_identically(
    tmp_path: Path, reaper, uninterrupted_fragments, run_args
) -> None:
    args = (*FRAGMENT_ARGS, *run_args[len(RUN_ARGS) :])
    first = reaper.node(tmp_path, args, faults=AFTER_A_SNAPSHOT).start()
    assert first.wait(180) == -signal.SIGKILL, first.log()
    second = reaper.node(tmp_path, args).start()
    assert second.wait(180) == 0, second.log()
    assert_same_run(final_state(tmp_path), uninterrupted_fragments)
    assert uninterrupted_fragments[1]["outer_step"] == 9 and uninterrupted_fragments[1]["inner_step"] == 36
    assert [r["source"] for r in read_receipts(tmp_path)][-1] == "local"


def test_corrupt_newest_snapshot_falls_back_to_the_previous(
    tmp_path: Path, reaper, uninterrupted, run_args
) -> None:
    # Killed as its third write begins: two complete snapshots exist, however slow the writer.
    first = reaper.node(tmp_path, run_args, faults="kill@snapshot_write#3").start()
    assert first.wait(180) == -signal.SIGKILL
    newest = newest_snapshot(tmp_path)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    second = reaper.node(tmp_path, run_args).start()
    assert second.wait(180) == 0, second.log()
    assert newest.with_name(newest.name + ".corrupt").exists()
    assert "refused" in second.log()
    assert_same_run(final_state(tmp_path), uninterrupted)


# The top-k wire: its error feedback (node-specific state, in every snapshot) must resume bit for bit.
TOPK_ARGS = (*RUN_ARGS, "--wire-dtype", "topk", "--topk-density", "0.01")


@pytest.fixture(scope="module")
def uninterrupted_topk(tmp_path_factory, run_args) -> tuple[dict[str, torch.Tensor], dict]:
    return straight_run(tmp_path_factory, (*run_args, *TOPK_ARGS[len(RUN_ARGS) :]), "straight-topk")


def test_killed_topk_run_restores_its_error_feedback_bit_for_bit(
    tmp_path: Path, reaper, uninterrupted_topk, run_args
) -> None:
    args = (*run_args, *TOPK_ARGS[len(RUN_ARGS) :])
    first = reaper.node(tmp_path, args, faults=AFTER_A_SNAPSHOT).start()
    assert first.wait(180) == -signal.SIGKILL, first.log()
    second = reaper.node(tmp_path, args).start()
    assert second.wait(180) == 0, second.log()
    assert_same_run(final_state(tmp_path), uninterrupted_topk)
    feedback = [t for name, t in uninterrupted_topk[0].items() if name.startswith("error_feedback/")]
    assert feedback and any(bool(t.any()) for t in feedback)  # it holds what was not sent
    assert [r["source"] for r in read_receipts(tmp_path)] == ["fresh", "local"]
