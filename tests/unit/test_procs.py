"""The child-process harness (`swarmnode.bench.procs`): a child dies with its parent even when the parent
is SIGKILLed (no `with` block or `kill()` runs then), and `stop_all` stops children cleanly or kills them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from swarmnode.bench import procs

PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from swarmnode.bench.procs import _Child

    child = _Child(Path(sys.argv[1]))
    child._start(["sleep", "600"], piped=False)
    print(child.proc.pid, flush=True)
    time.sleep(600)
    """
)


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (no such process, or a zombie its new parent has not reaped yet)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_child_dies_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child)
        parent.kill()
        parent.wait(10)
        procs.wait_until(lambda: _gone(child), 10, f"child {child} to die with its parent")
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_stop_all_returns_each_exit_code_and_kills_a_child_that_does_not_stop(tmp_path: Path) -> None:
    clean = "import signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))"
    stubborn = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    children = [procs._Child(tmp_path / f"c{i}.log") for i in range(2)]
    try:
        for child, setup in zip(children, (clean, stubborn), strict=True):
            child._start([sys.executable, "-c", f"{setup}; print('up', flush=True); time.sleep(60)"], True)
            assert child.proc is not None and child.proc.stdout is not None
            assert child.proc.stdout.readline() == "up\n"
        assert procs.stop_all(children, timeout_s=2) == [0, -signal.SIGKILL]
        assert not any(child.alive() for child in children)
    finally:
        for child in children:
            child.kill()
