"""`swarmnode bench fetch`: gRPC snapshot fetch throughput vs a raw TCP transfer of the same bytes.

A worker process serves a real snapshot of the preset's state twice: with `snapshot_server.start_server`, and
as a plain socket sender (`sendfile`). This process fetches it with `snapshot_client.fetch_snapshot` (stream,
sha256, write, fsync, rename) and with a plain socket receiver, once receiving only and once doing the
fetch's work too (sha256, write, fsync). The three are sampled in turn, `rounds` times each; the best of
each is compared. Destinations are on tmpfs when the machine has one, so the disk is not what is measured.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import tempfile
import time
from pathlib import Path

from swarmnode.bench.procs import Worker
from swarmnode.bench.runner import BenchResult, median, trained_run
from swarmnode.net import snapshot_client
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.snapshot.write import write_snapshot

RECV_BYTES = 1 << 20
WORKER_START_S = 120.0


def bench_fetch(preset_name: str, rounds: int = 5) -> BenchResult:
    """`rounds`: transfers per method."""
    result = BenchResult("fetch", preset_name)
    with tempfile.TemporaryDirectory() as served, tempfile.TemporaryDirectory(dir=_fast_dir()) as landing:
        info = _snapshot_file(preset_name, Path(served))
        result.add("snapshot size", info.size_bytes / 1e6, "MB", "planes, zstd-1")
        with Worker(Path(served), "serve", str(info.path)) as server:
            ports = server.read(WORKER_START_S)
            times = _sample(info, ports["grpc"], ports["tcp"], Path(landing), rounds)
    _report(result, info.size_bytes, times)
    return result


def _fast_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _snapshot_file(preset_name: str, directory: Path) -> SnapshotInfo:
    run = trained_run(preset_name, 8, 128, 8)
    info, _ = write_snapshot(directory, run.state_tensors(), run.state_metadata(), kind="hot", level=1)
    return info


def _sample(
    info: SnapshotInfo, grpc_port: int, tcp_port: int, landing: Path, rounds: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"grpc": [], "raw": [], "raw_work": []}
    for _ in range(rounds):
        times["grpc"].append(grpc_fetch(f"127.0.0.1:{grpc_port}", info, landing / "fetched"))
        times["raw"].append(raw_receive(tcp_port, 0, None)[0])
        seconds, digest = raw_receive(tcp_port, 0, landing / "raw")
        assert digest == info.snapshot_id, "raw transfer hashed to another id"
        times["raw_work"].append(seconds)
    return times


def grpc_fetch(address: str, info: SnapshotInfo, out: Path) -> float:
    """Seconds of one verified `fetch_snapshot` of `info` into `out` (removed afterwards)."""
    started = time.perf_counter()
    asyncio.run(snapshot_client.fetch_snapshot(address, out, snapshot_id=info.snapshot_id))
    seconds = time.perf_counter() - started
    out.unlink()
    return seconds


def raw_receive(port: int, wanted: int, out: Path | None) -> tuple[float, str]:
    """One raw TCP transfer from a `serve` worker (`wanted` 0: its file, else that many bytes). With
    `out`, the receiver also hashes, writes and fsyncs, as a fetch does; returns (seconds, sha256 hex)."""
    buffer = memoryview(bytearray(RECV_BYTES))
    digest = hashlib.sha256()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(wanted.to_bytes(8, "little"))
        sink = out.open("wb", buffering=0) if out is not None else None
        try:
            while count := conn.recv_into(buffer):
                if sink is not None:
                    digest.update(buffer[:count])
                    sink.write(buffer[:count])
            if sink is not None:
                os.fsync(sink.fileno())
        finally:
            if sink is not None:
                sink.close()
    seconds = time.perf_counter() - started
    if out is not None:
        out.unlink()
    return seconds, digest.hexdigest()


def _report(result: BenchResult, size: int, times: dict[str, list[float]]) -> None:
    rates = {name: size / min(values) for name, values in times.items()}
    labels = {
        "grpc": "gRPC fetch (stream, sha256, write, fsync)",
        "raw": "raw TCP, receive only",
        "raw_work": "raw TCP + sha256 + write + fsync",
    }
    for name, label in labels.items():
        note = f"best of {len(times[name])}; median {size / median(times[name]) / 1e9:.2f} GB/s"
        result.add(label, rates[name] / 1e9, "GB/s", note)
    result.ratio("fetch / raw (same work)", rates["grpc"] / rates["raw_work"], "target ≥ 0.6")
    result.ratio("fetch / raw (receive only)", rates["grpc"] / rates["raw"])
