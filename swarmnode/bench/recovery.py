"""`swarmnode bench recovery`: kill -9 → trained again, split into stages, vs each stage alone.

Two real `swarmnode run` nodes on loopback (one torch thread each) train and write hot snapshots, B every
`steps` inner steps, A less often. Once the DHT shows B's announcement and A has just written one, B is
SIGKILLed, its snapshots are wiped (its identity stays) and it is restarted: its restart receipt
(DATA_DIR/receipts.jsonl, written after its first inner step) gives the recovery's seconds by stage, and
the wall clock gives kill → first inner step. Each stage then runs alone on a copy of the snapshot B
recovered from: a DHT look-up (before the kill, every node alive; repeated after the restart to show
what a dead address costs), a gRPC fetch from a worker process, sha256, zstd decompression, decoding
into tensors (`read_snapshot`: the node's "verify" stage) and loading into a model (its "load" stage).

With `--peers K` (or `--mbit R`) it measures recovery from one peer against recovery from K peers at
once on a capped bed instead (`recovery_peers.py`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from swarmnode.bench.fetch import grpc_fetch
from swarmnode.bench.procs import ChildFailed, NodeProcess, Worker, free_port, json_lines
from swarmnode.bench.recovery_peers import bench_recovery_peers
from swarmnode.bench.runner import BenchResult, timed, trained_run
from swarmnode.net.dht import DHTConfig, SwarmDHT
from swarmnode.net.identity import Identity
from swarmnode.snapshot.checkpointer import read_local_snapshot
from swarmnode.snapshot.format import iter_snapshot_files, sha256_file
from swarmnode.snapshot.metadata import SnapshotMetadata
from swarmnode.snapshot.read import read_snapshot
from swarmnode.swarm.announcements import snapshots_key
from swarmnode.swarm.recovery.restore import RECEIPTS_FILE

RUN_ID = "bench-recovery"
TIMEOUT_S = 300.0
REPEATS = 3
A_SNAPSHOT_SPACING = 4
"""A writes snapshots this many times less often than B, and B is killed just after one of A's: so
A's writer is idle while B recovers (two nodes share this machine's cores; in a swarm they would not)."""


@dataclass
class Restart:
    """What B's restart took, from the kill on (perf_counter seconds)."""

    listening_s: float = 0.0
    trained_s: float = 0.0
    receipt: dict[str, Any] = field(default_factory=dict)
    snapshot: Path | None = None
    """A copy of the snapshot file B recovered from."""
    lookup_s: list[float] = field(default_factory=list)
    """DHT look-ups of the run's announcements before the kill, every node alive."""
    lookup_after_s: list[float] = field(default_factory=list)
    """The same once B runs again (its peers may still know it at its old address)."""


def bench_recovery(
    preset_name: str, steps: int = 5, peers: int | None = None, mbit: float | None = None
) -> BenchResult:
    """`steps`: inner steps between the nodes' hot snapshots. `peers` (or `mbit`): instead, one peer
    against `peers` (default 3) on a bed capped at `mbit` (default 50) Mbit/s (`recovery_peers.py`)."""
    if peers is not None or mbit is not None:
        return bench_recovery_peers(
            preset_name, 3 if peers is None else peers, 50.0 if mbit is None else mbit
        )
    for noisy in ("rpcudp", "kademlia"):  # this process's DHT client: a killed peer's timeouts are expected
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    result = BenchResult("recovery", preset_name)
    with tempfile.TemporaryDirectory() as tmp:
        restart = asyncio.run(_kill_and_restart(preset_name, steps, Path(tmp)))
        if restart.snapshot is None:
            raise ChildFailed(f"B did not recover from a peer: receipt {restart.receipt}")
        stages = _isolated_stages(preset_name, restart.snapshot, Path(tmp))
    stages["DHT look-up"] = min(restart.lookup_s)  # the stage's own cost: every node alive
    _report(result, restart, stages)
    return result


def _node_args(preset_name: str, hot_every: int) -> list[str]:
    return [
        *("--model", preset_name, "--threads", "1", "--run-id", RUN_ID),
        *("--inner-steps", "1000000", "--hot-every", str(hot_every), "--keep-hot", "8"),
    ]


async def _kill_and_restart(preset_name: str, steps: int, tmp: Path) -> Restart:
    a_dht = f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"  # so that A and B can start together
    a_args = [*_node_args(preset_name, A_SNAPSHOT_SPACING * steps), "--dht-port", a_dht.split(":")[1]]
    dht = SwarmDHT(Identity.generate(), DHTConfig(host="127.0.0.1", port=0))
    with (
        NodeProcess(tmp / "a", a_args) as a,
        NodeProcess(tmp / "b", [*_node_args(preset_name, steps), "--peers", a_dht]) as b,
    ):
        await asyncio.to_thread(a.wait_ready, TIMEOUT_S)
        b_id = (await asyncio.to_thread(b.wait_ready, TIMEOUT_S))["node_id"]
        await dht.start([a_dht])
        try:
            await _until(lambda: _announced(dht, b_id), "B's snapshot announcement")
            alive = [await _timed_lookup(dht) for _ in range(REPEATS)]
            newest = _newest(a.snapshot_dir)
            await _until(lambda: _newest(a.snapshot_dir) not in (None, newest), "a fresh snapshot of A")
            restart = await _restart(b)
            restart.lookup_s = alive
            restart.lookup_after_s = [await _timed_lookup(dht)]  # once: it may wait out a timeout
        finally:
            await dht.stop()
        restart.snapshot = _keep_copy(a.snapshot_dir, restart.receipt, tmp / "copy")
    return restart


def _newest(snapshot_dir: Path) -> Path | None:
    return next(iter_snapshot_files(snapshot_dir), None)


async def _announced(dht: SwarmDHT, node_id: str) -> bool:
    return node_id in await dht.get(snapshots_key(RUN_ID))


async def _timed_lookup(dht: SwarmDHT) -> float:
    started = time.perf_counter()
    await dht.get(snapshots_key(RUN_ID))
    return time.perf_counter() - started


async def _until(predicate: Any, what: str, interval_s: float = 0.02) -> None:
    """Awaits `predicate()` (a coroutine function or a plain one) until it is truthy."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise ChildFailed(f"timed out after {TIMEOUT_S:.0f} s waiting for {what}")
        await asyncio.sleep(interval_s)


async def _restart(b: NodeProcess) -> Restart:
    """SIGKILL B, wipe its snapshots, start it again; times until it listens and until it trained."""
    receipts_file = b.data_dir / RECEIPTS_FILE
    receipts = len(json_lines(receipts_file))
    killed = time.perf_counter()
    b.kill()
    shutil.rmtree(b.snapshot_dir)
    b.start()
    restart = Restart()

    def listening() -> bool:
        if not b.alive():
            raise b.fail("B exited after its restart")
        return (b.data_dir / "node.json").exists()

    await _until(listening, "B to listen after its restart")
    restart.listening_s = time.perf_counter() - killed
    await _until(lambda: listening() and len(json_lines(receipts_file)) > receipts, "B's restart receipt")
    restart.trained_s = time.perf_counter() - killed
    restart.receipt = json_lines(receipts_file)[-1]
    return restart


def _keep_copy(snapshot_dir: Path, receipt: dict[str, Any], directory: Path) -> Path | None:
    """A copy of the snapshot B recovered from (A's newest if A rotated it out), or None if B did not
    recover from a peer."""
    if receipt.get("source") != "peer":
        return None
    files = list(iter_snapshot_files(snapshot_dir))
    same = [p for p in files if receipt["snapshot_id"] in p.name]
    directory.mkdir()
    source = (same or files)[0]
    return Path(shutil.copy2(source, directory / source.name))


def _isolated_stages(preset_name: str, path: Path, tmp: Path) -> dict[str, float]:
    info = read_local_snapshot(path, None).info
    run = trained_run(preset_name, 0, 128, 8)
    template = run.template()
    loaded = read_snapshot(path, expected_id=info.snapshot_id, template=template)
    meta = SnapshotMetadata.parse(loaded.metadata)
    with Worker(tmp, "serve", str(path)) as server:
        address = f"127.0.0.1:{server.read(TIMEOUT_S)['grpc']}"
        fetch = min(grpc_fetch(address, info, tmp / "fetched") for _ in range(REPEATS))
    return {
        "fetch": fetch,
        "sha256": _best(lambda: sha256_file(path)),
        "zstd decompress": _best(lambda: _decompress(path)),
        "decode into tensors": _best(
            lambda: read_snapshot(path, expected_id=info.snapshot_id, template=template)
        ),
        "load into the model": _best(lambda: run.restore_from_peer(loaded, meta, None, (0, 0))),
    }


def _best(fn: Any) -> float:
    return min(timed(fn) for _ in range(REPEATS))


def _decompress(path: Path) -> None:
    with path.open("rb") as f:
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        while reader.read(1 << 22):
            pass


def _report(result: BenchResult, restart: Restart, stages: dict[str, float]) -> None:
    receipt = restart.receipt
    recovery = float(receipt["seconds"])
    result.add("kill → trained again (first inner step)", restart.trained_s, "s", "wall clock")
    result.add("kill → restarted node listens", restart.listening_s, "s", "process start, imports, build")
    result.add("recovery (restart receipt)", recovery, "s", f"{receipt['bytes'] / 1e6:.1f} MB from a peer")
    rest = restart.trained_s - restart.listening_s - recovery
    result.add("listening → first inner step, less recovery", rest, "s", "catch-up look-up, first step")
    for stage, seconds in sorted(receipt["stages_s"].items()):
        result.add(f"  receipt stage: {stage}", seconds, "s")
    for stage, seconds in stages.items():
        result.add(f"  alone: {stage}", seconds, "s", f"best of {REPEATS}")
    after = min(restart.lookup_after_s)
    stale = "a peer still hands out B's dead address: a request timeout" if after > 1 else ""
    result.add("  DHT look-up once B runs again", after, "s", stale)
    node_stages = ("DHT look-up", "fetch", "decode into tensors", "load into the model")
    serial = sum(stages[s] for s in node_stages)
    slowest = max(stages, key=lambda s: stages[s])
    result.ratio("recovery / slowest stage", recovery / stages[slowest], f"target ≤ 1.5 (slowest: {slowest})")
    unstale = recovery - receipt["stages_s"].get("lookup", 0.0) + stages["DHT look-up"]
    result.ratio("same, look-up as when all alive", unstale / stages[slowest], "without the dead address")
    result.ratio("recovery / sum of its stages alone", recovery / serial, "look-up + fetch + decode + load")
    result.ratio("kill → trained / recovery", restart.trained_s / recovery)
