"""A node's own data dir holds only what it may trust: its snapshots of this run. Other runs' files,
crafted files and damaged ones never crash a start, never win a recovery and are never deleted by
retention; a fresh start commits the cursor it really resumes from."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from swarmnode.core.ledger import check, read_ledger
from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot.read import read_header
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import NodeProcess, sound_file, start_swarm, stop_all, wait_for, with_metadata

SOLO = ("--inner-steps", "5", "--hot-every", "2", "--cold-every", "1", "--keep-hot", "2", "--keep-cold", "2")


def solo(reaper, data_dir: Path, *args: str) -> NodeProcess:
    return reaper.node(data_dir, [*SOLO, *args])


def run_to_end(node: NodeProcess) -> NodeProcess:
    assert node.start().wait(120) == 0, node.log()[-3000:]
    return node


def snapshot_names(data_dir: Path) -> set[str]:
    return {p.name for p in iter_snapshot_files(data_dir / "snapshots")}


def test_a_seed_change_keeps_both_runs_snapshots_and_resumes_its_own(tmp_path: Path, reaper) -> None:
    data = tmp_path / "node"
    run_to_end(solo(reaper, data, "--seed", "1", "--max-outer-steps", "4"))
    first_run = snapshot_names(data)
    assert {parse_snapshot_name(name)[:2] for name in first_run} >= {("cold", 3), ("cold", 4)}

    run_to_end(solo(reaper, data, "--seed", "2", "--max-outer-steps", "2"))
    receipt = read_receipts(data)[-1]
    assert (receipt["source"], receipt["cursor"]["position"]) == ("fresh", 0), receipt
    assert first_run <= snapshot_names(data), "retention deleted the other run's snapshots"
    second_run = snapshot_names(data) - first_run
    kinds = sorted(parse_snapshot_name(name)[:2] for name in second_run)
    assert ("cold", 1) in kinds and ("cold", 2) in kinds, kinds

    run_to_end(solo(reaper, data, "--seed", "2", "--max-outer-steps", "3"))
    receipt = read_receipts(data)[-1]
    assert (receipt["source"], receipt["outer_step"]) == ("local", 2), receipt
    assert not check(read_ledger(data)).errors


def test_crafted_files_neither_crash_a_start_nor_win_nor_get_served(tmp_path: Path, reaper) -> None:
    data = tmp_path / "node"
    run_to_end(solo(reaper, data, "--max-outer-steps", "2"))
    snapshots = data / "snapshots"
    newest = next(iter_snapshot_files(snapshots))
    yesterday = with_metadata(newest, {"created_at": "yesterday", "outer_step": 50}, 50, keep_original=True)
    lots = with_metadata(newest, {"inner_step": "lots", "outer_step": 60}, 60, keep_original=True)
    meta = {**read_header(newest).metadata, "outer_step": 999, "layout": "plain"}
    info = {
        "format": "swarmnode-snapshot",
        "format_version": "1",
        "layout": "plain",
        "swarmnode": json.dumps(meta),
    }
    terabyte = sound_file(
        snapshots,
        {"__metadata__": info, "model/x": {"dtype": "F32", "shape": [1 << 38], "data_offsets": [0, 1 << 40]}},
        "cold",
        999,
    )
    node = solo(reaper, data, "--max-outer-steps", "100").start()
    receipt = wait_for(lambda: read_receipts(data)[1:], 60, "the restart's receipt")[0]
    assert (receipt["source"], receipt["outer_step"]) == ("local", 2), receipt
    for crafted in (yesterday, lots, terabyte):
        assert crafted.with_name(crafted.name + ".corrupt").exists(), f"{crafted.name} not set aside"
    out = tmp_path / "latest.snap.zst"
    fetched = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "fetch", node.grpc_address, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fetched.returncode == 0, fetched.stderr
    outer = int(fetched.stdout.split("outer step ")[1].split(",")[0])
    assert 2 <= outer < 50, fetched.stdout
    node.signal(signal.SIGTERM)
    assert node.wait(60) == 0
    set_aside = [line for line in node.log().splitlines() if ".corrupt" in line]
    assert len(set_aside) == 3, set_aside  # one warning per crafted file


def assert_fresh_start_commits(data: Path, cursor_source: str) -> None:
    """The last start was fresh at this node's own cursor: the ledger's adopt entry is that cursor, the
    first round starts there, and the chain replays."""
    receipt = read_receipts(data)[-1]
    assert (receipt["source"], receipt["cursor_source"]) == ("fresh", cursor_source), receipt
    assert receipt["cursor"]["position"] > 0
    entries = read_ledger(data)
    adopted = [e for e in entries if e["event"] == "adopt"][-1]
    assert adopted["cursor"] == receipt["cursor"]
    first_round = next(e for e in entries[entries.index(adopted) :] if e["event"] == "round")
    assert first_round["start"] == receipt["cursor"]
    report = check(entries)
    assert not report.errors, report.errors


def test_a_fresh_start_from_its_announced_cursor_commits_that_cursor(tmp_path: Path, reaper) -> None:
    """Snapshots wiped and the only peer serves corrupt bytes: the node starts fresh at the cursor of its
    own last announcement, and that is what its ledger and first round say."""
    args = [*SOLO, "--max-outer-steps", "100", "--wait-peers", "1", "--run-id", "fresh"]
    nodes = start_swarm(reaper, tmp_path, 2, args, faults=["corrupt@serve_chunk", None])
    victim = nodes[1]
    wait_for(
        lambda: len([e for e in read_ledger(victim.data_dir) if e["event"] == "settle"]) >= 3, 90, "rounds"
    )
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    shutil.rmtree(victim.data_dir / "snapshots")  # the identity key stays
    victim.restart()
    wait_for(lambda: read_receipts(victim.data_dir)[1:], 90, "the restart receipt")
    wait_for(lambda: read_ledger(victim.data_dir)[-1]["event"] != "adopt", 60, "its first round")
    stop_all(nodes)
    assert_fresh_start_commits(victim.data_dir, "announcement")


def test_damaged_own_snapshots_still_give_a_fresh_start_its_cursor(tmp_path: Path, reaper) -> None:
    data = tmp_path / "node"
    run_to_end(solo(reaper, data, "--max-outer-steps", "2"))
    for path in iter_snapshot_files(data / "snapshots"):  # every file's data damaged, its header readable
        blob = bytearray(path.read_bytes())
        blob[-8:] = bytes(8)
        path.write_bytes(bytes(blob))
    run_to_end(solo(reaper, data, "--max-outer-steps", "3"))
    assert_fresh_start_commits(data, "own_snapshot")
