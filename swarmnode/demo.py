"""`swarmnode demo`: a newcomer's first minute — a three-node swarm on loopback trains, one node is killed
and its snapshots wiped, it comes back from a neighbour's snapshot, and a summary table is printed.

Everything lives in one temporary directory and three child processes, all removed on every way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from swarmnode import rpc, rpc_client
from swarmnode.bench_procs import child_env
from swarmnode.config import LOOPBACK_ARGS
from swarmnode.recovery import read_receipts
from swarmnode.snapshot import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot_read import read_header

NODE_ARGS = (
    "--model",
    "tiny",
    "--threads",
    "1",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    *LOOPBACK_ARGS,
    "--inner-steps",
    "40",
    "--hot-every",
    "10",
    "--cold-every",
    "1",
    "--keep-cold",
    "50",
    "--wait-peers",
    "2",
    "--matchmaking-timeout",
    "5",
    "--allreduce-timeout",
    "10",
    "--run-id",
    "demo",
    "--progress-interval",
    "3600",
)
ROUNDS_BEFORE_CRASH = 3
ROUNDS_AFTER_RECOVERY = 2
T = TypeVar("T")


@dataclass
class DemoNode:
    name: str
    data_dir: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    history: list[str] = field(default_factory=list)

    def start(self) -> None:
        (self.data_dir / "node.json").unlink(missing_ok=True)
        # No SWARMNODE_* setting of the user's reaches a demo node (with SWARMNODE_PEERS it would join
        # their real swarm). torch keeps a compiler cache under $TMPDIR; the demo's directory holds it.
        env = {**child_env(), "TORCHINDUCTOR_CACHE_DIR": str(self.data_dir.parent / "torch-cache")}
        with (self.data_dir / "node.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "swarmnode.cli", "run", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def info(self) -> dict[str, Any] | None:
        path = self.data_dir / "node.json"
        return json.loads(path.read_text()) if path.exists() else None

    def address(self) -> str:
        info = self.info()
        assert info is not None
        return f"127.0.0.1:{info['grpc_port']}"

    def status(self) -> rpc.NodeStatus | None:
        try:
            return asyncio.run(rpc_client.get_status(self.address(), timeout_s=3.0))
        except (rpc.PeerUnavailable, AssertionError, OSError):
            return None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.proc.wait(10)


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"the demo gave up waiting for {what} after {timeout_s:.0f} s")


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


@contextlib.contextmanager
def demo_swarm(workdir: Path) -> Iterator[list[DemoNode]]:
    nodes: list[DemoNode] = []
    try:
        yield nodes
    finally:
        for node in nodes:
            node.signal(signal.SIGTERM)
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.wait(20)


def start_nodes(workdir: Path, nodes: list[DemoNode]) -> None:
    for i in range(3):
        data_dir = workdir / f"node{i + 1}"
        data_dir.mkdir()
        nodes.append(DemoNode(f"node{i + 1}", data_dir, [*NODE_ARGS, "--data-dir", str(data_dir)]))
    nodes[0].start()
    seed = wait_for(nodes[0].info, 60, "node1 to listen")
    for node in nodes[1:]:
        node.args += ["--peers", f"127.0.0.1:{seed['dht_port']}"]
        node.start()
    for node in nodes:
        wait_for(node.info, 60, f"{node.name} to listen")
    say(f"three nodes listening (DHT seed 127.0.0.1:{seed['dht_port']}); data in {workdir}")


def wait_rounds(nodes: list[DemoNode], rounds: int, timeout_s: float) -> list[rpc.NodeStatus]:
    def reached() -> list[rpc.NodeStatus] | None:
        statuses = [node.status() for node in nodes]
        if all(s is not None and s.outer_step >= rounds for s in statuses):
            return statuses  # type: ignore[return-value]
        return None

    return wait_for(reached, timeout_s, f"round {rounds}")


def crash_and_recover(victim: DemoNode) -> dict[str, Any]:
    say(f"SIGKILL {victim.name} and delete its snapshots (its identity key stays)")
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    shutil.rmtree(victim.data_dir / "snapshots", ignore_errors=True)
    started = time.monotonic()
    victim.start()
    receipt = wait_for(lambda: read_receipts(victim.data_dir)[1:], 90, f"{victim.name} to recover")[0]
    say(
        f"{victim.name} back in {time.monotonic() - started:.1f} s (process start included): "
        f"{receipt['source']} snapshot {receipt['snapshot_id'][:12]} from {receipt['peer']}, "
        f"cursor {receipt['cursor']} ({receipt['cursor_source']})"
    )
    return receipt


def node_history(node: DemoNode) -> dict[str, Any]:
    rounds: dict[int, dict[str, Any]] = {}
    sizes = []
    for path in iter_snapshot_files(node.data_dir / "snapshots"):
        kind, outer, _, _ = parse_snapshot_name(path.name)  # type: ignore[misc]
        sizes.append(path.stat().st_size)
        if kind == "cold":
            rounds[outer] = read_header(path).metadata
    losses = [m["heldout_loss"] for _, m in sorted(rounds.items()) if m.get("heldout_loss") is not None]
    digest = rounds[max(rounds)]["global_digest"][:12] if rounds else "-"
    return {
        "rounds": max(rounds, default=0),
        "first": losses[0] if losses else None,
        "last": losses[-1] if losses else None,
        "digest": digest,
        "size": sum(sizes) / len(sizes) if sizes else 0,
    }


def print_summary(nodes: list[DemoNode], receipt: dict[str, Any]) -> None:
    print()
    print(
        f"{'node':<7} {'rounds':>6} {'held-out loss first → last':>28} {'snapshot':>10} {'global digest':>14}"
    )
    for node in nodes:
        h = node_history(node)
        first = "-" if h["first"] is None else f"{h['first']:.3f}"
        last = "-" if h["last"] is None else f"{h['last']:.3f}"
        print(
            f"{node.name:<7} {h['rounds']:>6} {first + ' → ' + last:>28} {h['size'] / 1e6:>8.1f}MB "
            f"{h['digest']:>14}"
        )
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(receipt["stages_s"].items()))
    print(
        f"\nrecovery of {nodes[-1].name}: {receipt['seconds']:.2f} s in the node ({stages}); "
        f"{receipt['bytes'] / 1e6:.1f} MB fetched from {receipt['peer']}; loss before "
        f"{receipt['loss_before']:.3f}, first loss after {receipt['first_loss_after']:.3f}"
    )


def run_demo() -> int:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="swarmnode-demo-"))
    try:
        with demo_swarm(workdir) as nodes:
            start_nodes(workdir, nodes)
            for status in wait_rounds(nodes, ROUNDS_BEFORE_CRASH, 120):
                say(
                    f"round {status.outer_step}: {status.node_id[:12]} loss {status.last_loss:.3f}, "
                    f"group of {len(status.last_group)}, coverage {status.last_coverage}"
                )
            receipt = crash_and_recover(nodes[-1])
            target = receipt["outer_step"] + ROUNDS_AFTER_RECOVERY
            statuses = wait_rounds(nodes, target, 120)
            digests = {s.global_digest for s in statuses}
            say(f"round {target}: {len(digests)} distinct global digest(s) across the three nodes")
            for node in nodes:
                node.signal(signal.SIGTERM)
            for node in nodes:
                node.wait(30)
            print_summary(nodes, receipt)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"done in {time.monotonic() - started:.0f} s; the temporary directory is removed")
    return 0
