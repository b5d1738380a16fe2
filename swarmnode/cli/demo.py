"""`swarmnode demo`: a newcomer's first minute — a three-node swarm on loopback trains, one node is killed
and its snapshots wiped, it comes back from a neighbour's snapshot, and a summary table is printed.

Everything lives in one temporary directory and three child processes, all removed on every way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from swarmnode.bench.procs import LOOPBACK_ARGS, NodeProcess, stop_all, wait_until
from swarmnode.net import rpc, snapshot_client
from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
from swarmnode.snapshot.read import read_header
from swarmnode.swarm.recovery.restore import read_receipts

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
    "--progress-interval",
    "3600",
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
)
ROUNDS_BEFORE_CRASH = 3
ROUNDS_AFTER_RECOVERY = 2
T = TypeVar("T")


class DemoNode(NodeProcess):
    """One of the demo's nodes: the shared child-process harness, named, with a status call. No
    SWARMNODE_* setting of the user's reaches it (with SWARMNODE_PEERS it would join their real swarm);
    torch's compiler cache goes into the demo's own directory."""

    def __init__(self, name: str, data_dir: Path, args: list[str]) -> None:
        env = {"TORCHINDUCTOR_CACHE_DIR": str(data_dir.parent / "torch-cache")}
        super().__init__(data_dir, args, env=env, base_args=NODE_ARGS)
        self.name = name

    def status(self) -> rpc.NodeStatus | None:
        try:
            return asyncio.run(snapshot_client.get_status(self.grpc_address, timeout_s=3.0))
        except (rpc.PeerUnavailable, OSError):
            return None


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


@contextlib.contextmanager
def demo_swarm(workdir: Path) -> Iterator[list[DemoNode]]:
    nodes: list[DemoNode] = []
    try:
        yield nodes
    finally:
        stop_all([node for node in nodes if node.proc is not None], 20)


def start_nodes(workdir: Path, nodes: list[DemoNode]) -> None:
    for i in range(3):
        data_dir = workdir / f"node{i + 1}"
        data_dir.mkdir()
        nodes.append(DemoNode(f"node{i + 1}", data_dir, []))
    seed = nodes[0].start().wait_ready(60)
    for node in nodes[1:]:
        node.args += ["--peers", f"127.0.0.1:{seed['dht_port']}"]
        node.start()
    for node in nodes:
        node.wait_ready(60)
    say(f"three nodes listening (DHT seed 127.0.0.1:{seed['dht_port']}); data in {workdir}")


def wait_rounds(nodes: list[DemoNode], rounds: int, timeout_s: float) -> list[rpc.NodeStatus]:
    def reached() -> list[rpc.NodeStatus] | None:
        statuses = [node.status() for node in nodes]
        if all(s is not None and s.outer_step >= rounds for s in statuses):
            return statuses  # type: ignore[return-value]
        return None

    return wait_until(reached, timeout_s, f"round {rounds}", interval_s=0.5)


def crash_and_recover(victim: DemoNode) -> dict[str, Any]:
    say(f"SIGKILL {victim.name} and delete its snapshots (its identity key stays)")
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    shutil.rmtree(victim.data_dir / "snapshots", ignore_errors=True)
    started = time.monotonic()
    victim.start()
    receipt = wait_until(lambda: read_receipts(victim.data_dir)[1:], 90, f"{victim.name} to recover", 0.2)[0]
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
            for node, code in zip(nodes, stop_all(nodes, 30), strict=True):
                if code == -signal.SIGKILL:
                    raise node.fail("did not exit within 30 s")
            print_summary(nodes, receipt)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"done in {time.monotonic() - started:.0f} s; the temporary directory is removed")
    return 0
