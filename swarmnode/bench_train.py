"""`swarmnode bench train`: tokens/s of a real node vs a bare training loop of the same model, and
(unless `--no-quality`) DiLoCo vs synchronous data parallel with the `tiny` preset (`bench_quality.py`).

The node is a single `swarmnode run` with its snapshots (hot every 50 inner steps, the default, or more
often when fewer steps are timed), DHT and metrics on, and JSON progress lines every 0.1 s that say when
each inner step was done. The bare loop is the same model, batch, AdamW and torch threads in this
process: forward, backward, clip, step; half its steps run before the node and half after.

Other work on a shared machine comes in bursts, so both are compared over their best window of one
snapshot period (the node's windows run from one snapshot to the next, so each holds one staging stall
and one whole background write); the rates over all steps are printed beside them.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from swarmnode.bench import BenchResult, load_note
from swarmnode.bench_procs import Node, json_lines, wait_until
from swarmnode.bench_quality import QualityRun, add_quality
from swarmnode.config import ConfigError
from swarmnode.data import ShardLoader, default_corpus
from swarmnode.ledger import LEDGER_FILE
from swarmnode.model import build_model, configure_determinism, preset
from swarmnode.recovery import RECEIPTS_FILE

BATCH_SIZE = 8
SEQ_LEN = 128
NODE_HOT_EVERY = 50
TIMEOUT_S = 900.0
WARMUP_STEPS = 5
"""Untimed first steps of the bare loop (a process's first steps are slow; the node's windows start
at its first snapshot, well after its own)."""
Samples = list[tuple[int, float]]
"""(inner steps done, seconds) pairs, in order."""


def bench_train(
    preset_name: str,
    steps: int = 150,
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
    bare = [bare_loop(preset_name, steps // 2, threads), None]
    node = node_steps(preset_name, steps, threads, window)
    bare[1] = bare_loop(preset_name, steps - steps // 2, threads)
    halves = [h for h in bare if h is not None]
    _report(result, node, halves, window, f"batch {BATCH_SIZE}×{SEQ_LEN}, {threads} threads")
    if quality:
        with tempfile.TemporaryDirectory() as tmp:
            add_quality(result, QualityRun(nodes, inner_steps, rounds), Path(tmp))
    return result


def _report(result: BenchResult, node: Samples, bare: list[Samples], window: int, setup: str) -> None:
    tokens = BATCH_SIZE * SEQ_LEN
    node_best = max(_aligned_rates(node, window), default=_rate(node[0], node[-1]))
    bare_best = max(r for half in bare for r in _sliding_rates(half, window))
    node_all = _rate(node[0], node[-1])
    bare_all = sum(len(h) - 1 for h in bare) / sum(h[-1][1] - h[0][1] for h in bare)
    note = f"best window of {window} steps; {setup}"
    result.add("node tokens/s (snapshots, DHT, metrics on)", node_best * tokens, "tok/s", note)
    result.add("bare training loop tokens/s", bare_best * tokens, "tok/s", note)
    result.add("node tokens/s, all steps", node_all * tokens, "tok/s", f"{node[-1][0] - node[0][0]} steps")
    result.add("bare loop tokens/s, all steps", bare_all * tokens, "tok/s", load_note())
    result.ratio("node / bare loop tokens/s", node_best / bare_best, "target ≥ 0.97 (best windows)")
    result.ratio("node / bare loop tokens/s, all steps", node_all / bare_all, "sensitive to other load")


def _rate(first: tuple[int, float], last: tuple[int, float]) -> float:
    return (last[0] - first[0]) / (last[1] - first[1])


def _sliding_rates(samples: Samples, window: int) -> list[float]:
    return [_rate(samples[i], samples[i + window]) for i in range(len(samples) - window)]


def _aligned_rates(samples: Samples, window: int) -> list[float]:
    """Rates between the first samples at or past consecutive multiples of `window` steps."""
    firsts: dict[int, tuple[int, float]] = {}
    for step, seconds in samples:
        firsts.setdefault(step // window, (step, seconds))
    marks = [firsts[k] for k in sorted(firsts) if k > 0]
    return [_rate(a, b) for a, b in zip(marks, marks[1:], strict=False)]


def bare_loop(preset_name: str, steps: int, threads: int) -> Samples:
    """When each of `steps` plain AdamW steps was done (perf_counter), after untimed warm-up steps."""
    corpus = default_corpus()
    configure_determinism(torch.device("cpu"), threads)  # the node's settings: the same kernels
    model = build_model(preset(preset_name, corpus.vocab_size), 0, torch.device("cpu"))
    loader = ShardLoader(corpus, 0, 16, BATCH_SIZE, SEQ_LEN, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)

    def step() -> None:
        batch = loader.next_batch()
        loss = model.loss(batch.inputs, batch.targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        opt.step()
        loss.item()

    for _ in range(WARMUP_STEPS):
        step()
    samples = [(0, time.perf_counter())]
    for k in range(1, steps + 1):
        step()
        samples.append((k, time.perf_counter()))
    return samples


def node_steps(preset_name: str, steps: int, threads: int, hot_every: int) -> Samples:
    """When a real node was done with each of its inner steps after its first (its progress lines),
    until `steps` more are done."""
    args = [
        *("--model", preset_name, "--threads", str(threads), "--run-id", "bench-train"),
        *("--batch-size", str(BATCH_SIZE), "--seq-len", str(SEQ_LEN), "--hot-every", str(hot_every)),
        *("--inner-steps", str(steps + 1), "--max-outer-steps", "1"),
        *("--log-format", "json", "--progress-interval", "0.1"),
    ]
    with tempfile.TemporaryDirectory() as tmp, Node(Path(tmp) / "node", args) as node:
        node.info(TIMEOUT_S)

        def done(path: Path, event: str | None) -> bool:
            if not node.alive():
                raise node.fail("the node exited")
            return any(event is None or e.get("event") == event for e in json_lines(path))

        receipts, ledger = node.data_dir / RECEIPTS_FILE, node.data_dir / LEDGER_FILE
        wait_until(lambda: done(receipts, None), TIMEOUT_S, "the node's first inner step")
        wait_until(lambda: done(ledger, "round"), TIMEOUT_S, "the node's inner phase to end")
        samples = [s for s in _progress(node.log_path) if s[0] >= 1]
    if len(samples) < 2:
        raise ConfigError(f"--steps: {steps} steps went by between two progress lines; time more steps")
    return samples


def _progress(log: Path) -> Samples:
    """(round step, time) at the first progress line that reports each step."""
    firsts: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event": "progress"' in line:
            sample = json.loads(line)
            firsts.setdefault(int(sample["step"]), float(sample["ts"]))
    return sorted(firsts.items())
