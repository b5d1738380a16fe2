"""`swarmnode demo` runs end to end, prints its summary and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def test_demo_trains_crashes_recovers_and_cleans_up(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "demo"], capture_output=True, text=True, timeout=240, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "held-out loss first → last" in out.stdout
    assert "recovery of node3" in out.stdout and "fetched from 127.0.0.1:" in out.stdout
    assert "1 distinct global digest(s)" in out.stdout
    assert list(tmp_path.iterdir()) == [], "the demo left temporary files behind"
    assert processes_mentioning(str(tmp_path)) == [], "the demo left processes behind"
