"""The train bench's anchor is the loop the node wraps, run the way a node runs: in a process of its
own session (so its own scheduling group where the kernel groups by session, as a node's) on a
training thread, timing its windows itself."""

from __future__ import annotations

import os
from pathlib import Path

from swarmnode.bench import train
from swarmnode.bench.procs import NodeProcess, Worker, wait_until
from swarmnode.bench.train import TIMEOUT_S


def test_bare_loop_trains_in_a_worker_of_its_own_session(tmp_path: Path) -> None:
    with Worker(tmp_path, "bare-train", "tiny", "1", "2", "cpu", "fp32", "8") as worker:
        assert worker.read(120) == {"bare": True}  # warmed up
        assert worker.proc is not None
        assert os.getsid(worker.proc.pid) != os.getsid(0)
        seconds = float(worker.ask({"steps": 3}, TIMEOUT_S)["seconds"])
        assert 0 < seconds < 120
        plain = float(worker.ask({"steps": 3, "plain": True}, TIMEOUT_S)["seconds"])  # no swarmnode around it
        assert 0 < plain < 120


def test_the_nodes_dirty_pages_are_flushed_while_it_is_stopped_before_each_bare_window(monkeypatch) -> None:
    """Unflushed, the kernel wrote a node snapshot's pages back during the next bare window, which then
    paid for the node's I/O (node / bare came out 1.07 and 1.09)."""
    nodes: list[NodeProcess] = []
    events: list[str] = []
    enter_node, ask_worker = NodeProcess.__enter__, Worker.ask

    def entered(self: NodeProcess) -> NodeProcess:
        nodes.append(enter_node(self))
        return self

    def sync() -> None:
        proc = nodes[0].proc
        assert proc is not None
        # SIGSTOP is delivered asynchronously: the node is stopped, or stopping, when the flush runs.
        wait_until(lambda: process_state(proc.pid) == "T" or None, 10, "the node stopped")
        events.append("sync, node stopped")

    def ask(self: Worker, request: dict, timeout_s: float) -> dict:
        events.append("plain window" if request.get("plain") else "bare window")
        return ask_worker(self, request, timeout_s)

    monkeypatch.setattr(NodeProcess, "__enter__", entered)
    monkeypatch.setattr(train.os, "sync", sync)
    monkeypatch.setattr(Worker, "ask", ask)
    node_rates, bare_rates, plain_rates = train.alternate("tiny", 1, 4, 2, train.TrainSetup.on("cpu", "auto"))
    assert len(node_rates) == len(bare_rates) == len(plain_rates) == 2
    assert events == ["sync, node stopped", "bare window", "plain window"] * 2, (
        "each flush runs with the node stopped (untimed)"
    )


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
