"""Background threads run idle-only (SCHED_IDLE) until hurried, and fall back to nice 10 where leaving
SCHED_IDLE is not permitted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from swarmnode.bench.procs import wait_until
from swarmnode.snapshot.checkpointer import CheckpointerConfig, SpeculativeCheckpointer
from swarmnode.snapshot.write import write_snapshot
from swarmnode.util import background, faults
from swarmnode.util.background import BACKGROUND_NICENESS, BackgroundPriority, idle_policy_usable
from swarmnode.util.metrics import Metrics

needs_idle = pytest.mark.skipif(not idle_policy_usable(), reason="SCHED_IDLE cannot be left here")


def idle(tid: int) -> bool:
    return os.sched_getscheduler(tid) == os.SCHED_IDLE  # (its nice value means nothing there)


def nice_10(tid: int) -> bool:
    return (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)) == (
        os.SCHED_OTHER,
        BACKGROUND_NICENESS,
    )


class Member:
    """A thread that joins `priority` and waits until told to leave."""

    def __init__(self, priority: BackgroundPriority) -> None:
        self.priority, self.joined, self.done = priority, threading.Event(), threading.Event()
        self.tid = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.joined.wait(10)

    def _run(self) -> None:
        self.tid = self.priority.enter()
        self.joined.set()
        self.done.wait(30)
        self.priority.leave(self.tid)

    def end(self) -> None:
        self.done.set()
        self.thread.join(10)


@needs_idle
def test_members_are_idle_only_until_hurried_and_again_after_relax() -> None:
    priority = BackgroundPriority()
    early = Member(priority)
    try:
        assert idle(early.tid)
        priority.hurry()
        late = Member(priority)  # joins while hurried: starts at nice 10 too
        try:
            assert nice_10(early.tid) and nice_10(late.tid)
            priority.relax(grace_s=60)
            assert idle(early.tid) and idle(late.tid)
        finally:
            late.end()
        assert late.tid not in priority.members()
    finally:
        early.end()
        priority.close()
    assert priority.members() == frozenset()


@needs_idle
def test_the_watchdog_hurries_work_that_stayed_idle_only_past_its_grace() -> None:
    """A machine busy with other work could starve an idle-only write forever."""
    priority = BackgroundPriority()
    member = Member(priority)
    try:
        priority.relax(grace_s=0.2)
        assert idle(member.tid)
        wait_until(lambda: nice_10(member.tid) or None, 10, "the watchdog's hurry")
        priority.relax(grace_s=60)
        priority.finished()  # ended in time: nothing left to hurry
        assert idle(member.tid) and not priority.hurried
    finally:
        member.end()
        priority.close()


def test_where_sched_idle_cannot_be_left_members_run_at_nice_10(monkeypatch) -> None:
    monkeypatch.setattr(background, "idle_policy_usable", lambda: False)
    priority = BackgroundPriority()
    member = Member(priority)
    try:
        assert not priority.idle_only
        assert nice_10(member.tid)
    finally:
        member.end()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_probe_says_no_for_root_without_cap_sys_nice() -> None:
    """Docker's default root: without CAP_SYS_NICE (and with RLIMIT_NICE 0) a thread in SCHED_IDLE could
    never be hurried, so the probe must find that out (on a thread of its own) instead of stranding the
    writer. (Root keeps its other capabilities, so it still reads this checkout wherever it lies.)"""
    code = "from swarmnode.util.background import idle_policy_usable; print(idle_policy_usable())"
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root)
    drop = ["--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice"]
    argv = ["setpriv", *drop, sys.executable, "-c", code]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.fixture
def no_faults():
    yield
    faults.configure(None)


@needs_idle
def test_the_writer_is_idle_only_and_hurried_when_the_next_snapshot_falls_due(
    tmp_path: Path, no_faults
) -> None:
    faults.configure("sleep@snapshot_write=1.5")
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp_path), Metrics())
    writer = ckpt._thread.native_id
    assert writer is not None
    tensors = {"model/w": torch.ones(64, 64)}
    meta = {"run_id": "r", "node_id": "ab" * 20, "outer_step": 0, "created_at": 1.0}
    try:
        assert ckpt.snapshot(tensors, dict(meta, inner_step=1), "hot")
        wait_until(lambda: idle(writer) or None, 10, "the writer idle-only")
        assert not ckpt.snapshot(tensors, dict(meta, inner_step=2), "hot")  # due while in flight
        assert nice_10(writer), "an overdue write stayed idle-only"
        assert ckpt.wait_idle(30)
        assert ckpt.snapshot(tensors, dict(meta, inner_step=3), "hot")
        wait_until(lambda: idle(writer) or None, 10, "the next write idle-only again")
        assert not ckpt.wait_idle(0), "the observation must be made while the write is in flight"
    finally:
        ckpt.close()


def test_compressing_threads_leave_when_the_write_ends(tmp_path: Path) -> None:
    """Thread ids are reused by the kernel: a stale member could later name a training thread."""
    priority = BackgroundPriority()
    entered: list[int] = []
    original = priority.enter

    def counting_enter() -> int:
        entered.append(tid := original())
        return tid

    priority.enter = counting_enter  # type: ignore[method-assign]
    big = {"model/w": torch.randn(1 << 20)}  # float planes large enough for frames of their own
    meta = {"run_id": "r", "node_id": "ab" * 20, "outer_step": 0, "inner_step": 1}
    write_snapshot(tmp_path, big, meta, kind="hot", threads=1, priority=priority)
    assert entered, "the compressing thread never joined the priority"
    assert priority.members() == frozenset()
