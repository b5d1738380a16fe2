"""`swarmnode bench`: what this machine does, each figure a ratio against an anchor measured in the same
run (shared machines are noisy: only ratios within one run mean anything). Absolute times are printed,
never asserted. Peak RSS is reported beside each figure.
"""

from __future__ import annotations

import gzip
import io
import json
import resource
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmnode.checkpointer import CheckpointerConfig, SpeculativeCheckpointer
from swarmnode.data import ShardLoader, default_corpus
from swarmnode.diloco import DilocoConfig
from swarmnode.metrics import Metrics
from swarmnode.model import preset
from swarmnode.snapshot import read_snapshot, write_snapshot
from swarmnode.training import RunIdentity, TrainingRun


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    note: str = ""


@dataclass
class BenchResult:
    bench: str
    preset: str
    figures: list[Figure] = field(default_factory=list)
    ratios: list[Figure] = field(default_factory=list)
    peak_rss_mb: float = 0.0

    def add(self, name: str, value: float, unit: str, note: str = "") -> None:
        self.figures.append(Figure(name, value, unit, note))

    def ratio(self, name: str, value: float, note: str = "") -> None:
        self.ratios.append(Figure(name, value, "x", note))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def table(self) -> str:
        lines = [f"swarmnode bench {self.bench} (preset {self.preset}, peak RSS {self.peak_rss_mb:.0f} MB)"]
        for f in self.figures:
            lines.append(f"  {f.name:<44} {f.value:>12.4g} {f.unit:<8} {f.note}")
        if self.ratios:
            lines.append("  ratios (same run):")
            for f in self.ratios:
                lines.append(f"  {f.name:<44} {f.value:>12.3f} {f.unit:<8} {f.note}")
        return "\n".join(lines)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    """Fastest of `repeats` timed calls (the least disturbed by the machine's other work)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def trained_run(preset_name: str, train_steps: int, seq_len: int, batch_size: int) -> TrainingRun:
    """A training run of the preset after a few inner steps, so weights and Adam moments are realistic."""
    corpus = default_corpus()
    model_cfg = preset(preset_name, corpus.vocab_size)
    loader = ShardLoader(corpus, 0, 16, batch_size, min(seq_len, model_cfg.context), seed=0)
    identity = RunIdentity("bench", "bench", "bench", corpus.digest, preset_name)
    run = TrainingRun(model_cfg, DilocoConfig(), loader, corpus, identity, 0, torch.device("cpu"), Metrics())
    run.inner_phase(train_steps, None, threading.Event(), lambda: None)
    return run


def bench_snapshot(preset_name: str, train_steps: int = 8, repeats: int = 3) -> BenchResult:
    """Hot-snapshot stall vs memcpy; write throughput and ratio of planes/plain vs gzip-6 and torch.save."""
    result = BenchResult("snapshot", preset_name)
    run = trained_run(preset_name, train_steps, 128, 8)
    tensors = run.state_tensors()
    meta = run.state_metadata()
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    result.add("state size", raw / 1e6, "MB", f"{len(tensors)} tensors")
    with tempfile.TemporaryDirectory() as tmp:
        _stall_vs_memcpy(result, tensors, meta, raw, Path(tmp), repeats)
        _layouts(result, tensors, meta, raw, Path(tmp))
        _zstd_settings(result, tensors, meta, raw, Path(tmp))
    result.peak_rss_mb = peak_rss_mb()
    return result


def _stall_vs_memcpy(
    result: BenchResult,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    raw: int,
    tmp: Path,
    repeats: int,
) -> None:
    source = np.empty(raw, dtype=np.uint8)
    target = np.empty(raw, dtype=np.uint8)
    source.fill(1)
    target.fill(0)
    memcpy = best_of(repeats + 2, lambda: np.copyto(target, source))
    metrics = Metrics()
    ckpt = SpeculativeCheckpointer(CheckpointerConfig(tmp / "stall", keep_hot=1), metrics)
    stalls = []
    try:
        for _ in range(repeats + 2):
            started = time.perf_counter()
            ckpt.snapshot(tensors, meta, "hot")
            stalls.append(time.perf_counter() - started)
            ckpt.wait_idle()
    finally:
        ckpt.close()
    stall = min(stalls[1:])  # the first call allocates the staging buffers once per process
    result.add("memcpy of the state bytes", memcpy * 1e3, "ms", f"{raw / memcpy / 1e9:.1f} GB/s")
    result.add("hot snapshot stall (training thread)", stall * 1e3, "ms", "staging copy_ into reused buffers")
    result.add("first hot snapshot stall (allocates buffers)", stalls[0] * 1e3, "ms")
    result.ratio("stall / memcpy", stall / memcpy, "target ≤ 1.5")


def _layouts(
    result: BenchResult, tensors: dict[str, torch.Tensor], meta: dict[str, Any], raw: int, tmp: Path
) -> None:
    speeds: dict[str, float] = {}
    for layout in ("planes", "plain"):
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


BENCHES: dict[str, Callable[..., BenchResult]] = {"snapshot": bench_snapshot}
