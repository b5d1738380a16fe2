"""`swarmnode bench train`: tokens/s of a real node vs a bare training loop of the same model, and
(unless `--no-quality`) DiLoCo vs synchronous data parallel with the `tiny` preset (`bench_quality.py`).

The node is a single `swarmnode run` with its snapshots (hot every 50 inner steps, the default, or more
often when fewer steps are timed), DHT and metrics on, and JSON progress lines every 0.1 s that say how
far it is. The bare loop is the same model, batch, AdamW and torch threads in this process: forward,
backward, clip, step. Other work on a shared machine comes and goes, so the two take turns, one snapshot
period each: the node trains from one of its snapshots to the next (a window holds one staging stall and
one whole background write), then waits stopped (SIGSTOP) while the bare loop trains as many steps.
The best windows are compared, and the medians printed beside them.
"""

from __future__ import annotations

import json
import signal
import tempfile
import time
from pathlib import Path

import torch

from swarmnode.bench.quality import QualityRun, add_quality
from swarmnode.bench.runner import BenchResult, load_note, median
from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.model import build_model, configure_determinism
from swarmnode.core.presets import preset
from swarmnode.util.procs import NodeProcess, wait_until

BATCH_SIZE = 8
SEQ_LEN = 128
NODE_HOT_EVERY = 50
TIMEOUT_S = 900.0
TOKENS = BATCH_SIZE * SEQ_LEN
PROGRESS_S = 0.1
"""The node's progress interval: when each window ends is known to within this."""
WARMUP_STEPS = 5
"""Untimed first steps of the bare loop (a process's first steps are slow; the node's windows start
at its first snapshot, well after its own)."""


def bench_train(
    preset_name: str,
    steps: int = 100,
    nodes: int = 4,
    inner_steps: int = 100,
    rounds: int = 6,
    quality: bool = True,
) -> BenchResult:
    """`steps`: timed training steps (node and bare loop each); `nodes`, `inner_steps`, `rounds`: the
    quality run's workers, H and outer steps; `quality`: run it."""
    result = BenchResult("train", preset_name)
    threads = torch.get_num_threads()
    window = min(NODE_HOT_EVERY, max(1, steps // 2))
    node, bare = alternate(preset_name, threads, window, max(1, steps // window))
    result.add("node tokens/s (snapshots, DHT, metrics on)", max(node) * TOKENS, "tok/s", _note(node, window))
    result.add("bare training loop tokens/s", max(bare) * TOKENS, "tok/s", _note(bare, window))
    result.ratio("node / bare loop tokens/s", max(node) / max(bare), "target ≥ 0.97 (best windows)")
    result.ratio("node / bare loop tokens/s (medians)", median(node) / median(bare), load_note())
    if quality:
        with tempfile.TemporaryDirectory() as tmp:
            add_quality(result, QualityRun(nodes, inner_steps, rounds), Path(tmp))
    return result


def _note(rates: list[float], window: int) -> str:
    return f"best of {len(rates)} windows of {window} steps, median {median(rates) * TOKENS:.0f}"


def alternate(preset_name: str, threads: int, window: int, windows: int) -> tuple[list[float], list[float]]:
    """Steps per second of the node and of the bare loop, window by window: the node trains a window
    (from one of its snapshots to the next), is stopped (SIGSTOP) while the bare loop trains one,
    then goes on; so both meet the machine's other load alike."""
    bare = BareLoop(preset_name, threads)
    args = [
        *("--model", preset_name, "--threads", str(threads), "--run-id", "bench-train"),
        *("--batch-size", str(BATCH_SIZE), "--seq-len", str(SEQ_LEN), "--hot-every", str(window)),
        *("--inner-steps", "1000000", "--log-format", "json", "--progress-interval", str(PROGRESS_S)),
    ]
    node_rates, bare_rates = [], []
    with tempfile.TemporaryDirectory() as tmp, NodeProcess(Path(tmp) / "node", args) as node:
        progress = ProgressTail(node)
        start = progress.wait_for(window)
        for k in range(2, windows + 2):
            node.signal(signal.SIGSTOP)
            stopped = time.time()
            bare_rates.append(window / bare.run(window))
            node.signal(signal.SIGCONT)
            paused = time.time() - stopped
            end = progress.wait_for(k * window)
            node_rates.append((end[0] - start[0]) / (end[1] - start[1] - paused))
            start = end
    return node_rates, bare_rates


class BareLoop:
    """The same model, batch, AdamW and threads as the node, trained in this process (warmed up)."""

    def __init__(self, preset_name: str, threads: int) -> None:
        corpus = default_corpus()
        configure_determinism(torch.device("cpu"), threads)  # the node's settings: the same kernels
        self.model = build_model(preset(preset_name, corpus.vocab_size), 0, torch.device("cpu"))
        self.loader = ShardLoader(corpus, 0, 16, BATCH_SIZE, SEQ_LEN, seed=0)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False
        )
        self.run(WARMUP_STEPS)

    def run(self, steps: int) -> float:
        """Seconds of `steps` steps: forward, backward, clip, AdamW."""
        started = time.perf_counter()
        for _ in range(steps):
            batch = self.loader.next_batch()
            loss = self.model.loss(batch.inputs, batch.targets)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=False)
            self.opt.step()
            loss.item()
        return time.perf_counter() - started


class ProgressTail:
    """The node's JSON progress lines as they come: (inner step of the round, unix time)."""

    def __init__(self, node: NodeProcess) -> None:
        self.node, self.offset = node, 0
        self.samples: list[tuple[int, float]] = []

    def wait_for(self, step: int) -> tuple[int, float]:
        """The first progress sample at or past `step` (waiting for it)."""

        def reached() -> tuple[int, float] | None:
            if not self.node.alive():
                raise self.node.fail("the node exited")
            self._read()
            return next((s for s in self.samples if s[0] >= step), None)

        return wait_until(reached, TIMEOUT_S, f"the node's inner step {step}")

    def _read(self) -> None:
        with self.node.log_path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith("{") and '"event": "progress"' in line:
                sample = json.loads(line)
                self.samples.append((int(sample["step"]), float(sample["ts"])))
