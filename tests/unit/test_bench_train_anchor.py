"""The train bench's anchor is the loop the node wraps, run the way a node runs: in a process of its
own session (so its own scheduling group where the kernel groups by session, as a node's) on a
training thread, timing its windows itself."""

from __future__ import annotations

import os
from pathlib import Path

from swarmnode.bench.train import TIMEOUT_S
from swarmnode.util.procs import Worker


def test_bare_loop_trains_in_a_worker_of_its_own_session(tmp_path: Path) -> None:
    with Worker(tmp_path, "bare-train", "tiny", "1", "2") as worker:
        assert worker.read(120) == {"bare": True}  # warmed up
        assert worker.proc is not None
        assert os.getsid(worker.proc.pid) != os.getsid(0)
        seconds = float(worker.ask({"steps": 3}, TIMEOUT_S)["seconds"])
        assert 0 < seconds < 120
