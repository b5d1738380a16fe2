"""`swarmnode bench snapshot`: the hot-snapshot stall vs a memcpy of the same bytes; write throughput and
ratio of the two layouts vs gzip-6 and torch.save.

The stall is what the training thread waits in `SpeculativeCheckpointer.snapshot` (staging `copy_`
into reused buffers, then handing the job to the writer). When other processes keep the cores busy,
single samples of either reach far beyond their quiet values (descheduling), and a staging copy made
of many `copy_` calls, each a fork/join over torch's intra-op threads, suffers more (docs/benchmarks.md
"Component measurements"). Hence memcpy and stall are sampled in alternation, under the same load, and the
best of each is compared; the medians and a single-threaded staging copy are printed beside them to show the
contention.
"""

from __future__ import annotations

import gzip
import io
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmnode.bench.runner import BenchResult, load_note, median, timed, trained_run
from swarmnode.snapshot.checkpointer import CheckpointerConfig, SpeculativeCheckpointer
from swarmnode.snapshot.format import LAYOUTS
from swarmnode.snapshot.read import read_snapshot
from swarmnode.snapshot.staging import StagingBuffers
from swarmnode.snapshot.write import write_snapshot
from swarmnode.util.metrics import Metrics


def bench_snapshot(preset_name: str, rounds: int = 7, train_steps: int = 8) -> BenchResult:
    """`rounds`: alternating memcpy/stall samples (the best of each is compared)."""
    result = BenchResult("snapshot", preset_name)
    run = trained_run(preset_name, train_steps, 128, 8)
    tensors = run.state_tensors()
    meta = run.state_metadata()
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    result.add("state size", raw / 1e6, "MB", f"{len(tensors)} tensors")
    with tempfile.TemporaryDirectory() as tmp:
        _stall_vs_memcpy(result, tensors, meta, raw, Path(tmp), rounds)
        _layouts(result, tensors, meta, raw, Path(tmp))
        _zstd_settings(result, tensors, meta, raw, Path(tmp))
    return result


def _stall_vs_memcpy(
    result: BenchResult,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    raw: int,
    tmp: Path,
    rounds: int,
) -> None:
    source = np.ones(raw, dtype=np.uint8)
    target = np.zeros(raw, dtype=np.uint8)
    np.copyto(target, source)  # both arrays faulted in before the first timed copy
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp / "stall", keep_hot=1), Metrics())
    memcpy, stalls, cpu_shares = [], [], []
    try:
        first = _one_stall(ckpt, tensors, meta)[0]  # allocates the staging buffers (once per process)
        for _ in range(rounds):
            memcpy.append(timed(lambda: np.copyto(target, source)))
            stall, cpu = _one_stall(ckpt, tensors, meta)
            stalls.append(stall)
            cpu_shares.append(cpu / stall)
    finally:
        ckpt.close()
    best, best_memcpy = min(stalls), min(memcpy)
    result.add(
        "memcpy of the state bytes (best)", best_memcpy * 1e3, "ms", f"{raw / best_memcpy / 1e9:.1f} GB/s"
    )
    result.add("memcpy of the state bytes (median)", median(memcpy) * 1e3, "ms", load_note())
    result.add("hot snapshot stall (best)", best * 1e3, "ms", "staging copy_ into reused buffers")
    result.add(
        "hot snapshot stall (median)",
        median(stalls) * 1e3,
        "ms",
        f"process CPU / wall during stalls {median(cpu_shares):.2f} (< 1: waited for a core)",
    )
    result.add("first hot snapshot stall (allocates buffers)", first * 1e3, "ms")
    one_thread = _staging_one_thread(tensors, rounds)
    result.add("staging copy with 1 torch thread (best)", one_thread * 1e3, "ms", "diagnostic")
    result.ratio("stall / memcpy", best / best_memcpy, "target ≤ 1.5 (best of each, sampled alternately)")
    result.ratio("stall / memcpy (medians)", median(stalls) / median(memcpy), "sensitive to other load")
    result.ratio("1-thread staging / memcpy", one_thread / best_memcpy, "diagnostic")


def _one_stall(
    ckpt: SpeculativeCheckpointer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> tuple[float, float]:
    """(wall, process CPU) seconds of one hot snapshot call, with no write in flight before or after."""
    ckpt.wait_idle()
    cpu, started = time.process_time(), time.perf_counter()
    ckpt.snapshot(tensors, meta, "hot")
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    ckpt.wait_idle()
    return wall, cpu


def _staging_one_thread(tensors: dict[str, torch.Tensor], rounds: int) -> float:
    """Best time of `StagingBuffers.stage` into warm buffers with torch limited to one intra-op thread."""
    staging = StagingBuffers()
    staging.stage(tensors)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(timed(lambda: staging.stage(tensors)) for _ in range(rounds))
    finally:
        torch.set_num_threads(threads)


def _layouts(
    result: BenchResult, tensors: dict[str, torch.Tensor], meta: dict[str, Any], raw: int, tmp: Path
) -> None:
    speeds: dict[str, float] = {}
    for layout in LAYOUTS:
        started = time.perf_counter()
        info, _ = write_snapshot(tmp / layout, tensors, meta, kind="hot", layout=layout, level=1)
        seconds = time.perf_counter() - started
        speeds[layout] = raw / seconds
        result.add(
            f"write {layout} (zstd-1)", raw / seconds / 1e6, "MB/s", f"ratio {info.size_bytes / raw:.3f}"
        )
        started = time.perf_counter()
        read_snapshot(info.path, expected_id=info.snapshot_id)
        result.add(f"read+verify {layout}", raw / (time.perf_counter() - started) / 1e6, "MB/s")
    started = time.perf_counter()
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    gz = gzip.compress(buffer.getvalue(), compresslevel=6)
    gzip_seconds = time.perf_counter() - started
    result.add(
        "torch.save + gzip-6 (the seed's codec)",
        raw / gzip_seconds / 1e6,
        "MB/s",
        f"ratio {len(gz) / raw:.3f}",
    )
    started = time.perf_counter()
    torch.save(tensors, tmp / "state.pt")
    save_seconds = time.perf_counter() - started
    result.add("torch.save to a file (uncompressed)", raw / save_seconds / 1e6, "MB/s")
    result.ratio("planes write / gzip-6 write", speeds["planes"] * gzip_seconds / raw, "target ≥ 20")
    result.ratio("plain write / gzip-6 write", speeds["plain"] * gzip_seconds / raw)
    result.ratio("planes write / torch.save", speeds["planes"] * save_seconds / raw)


def _zstd_settings(
    result: BenchResult, tensors: dict[str, torch.Tensor], meta: dict[str, Any], raw: int, tmp: Path
) -> None:
    for level, threads in ((1, 0), (1, 2), (3, 0), (-1, 0)):
        started = time.perf_counter()
        info, _ = write_snapshot(
            tmp / f"z{level}-{threads}",
            tensors,
            meta,
            kind="hot",
            layout="planes",
            level=level,
            threads=threads,
        )
        seconds = time.perf_counter() - started
        result.add(
            f"planes zstd level {level}, threads {threads}",
            raw / seconds / 1e6,
            "MB/s",
            f"ratio {info.size_bytes / raw:.3f}",
        )
