"""`swarmnode bench train`: tokens/s of a real node vs a bare training loop of the same model, and
(unless `--no-quality`) DiLoCo vs synchronous data parallel with the `tiny` preset (`bench_quality.py`).

The node is a single `swarmnode run` with its snapshots (hot every 50 inner steps, the default, or
more often when fewer steps are timed), DHT and metrics on; it is timed from its first inner step (its
start receipt appears) to the end of its inner phase (the round's ledger line appears), `steps` steps
later. The bare loop is the same model, batch, AdamW and torch threads in this process: forward,
backward, clip, step. Half the bare steps run before the node and half after, so a drift in the
machine's other load weighs on both alike.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from swarmnode.bench import BenchResult, load_note
from swarmnode.bench_procs import Node, json_lines, wait_until
from swarmnode.bench_quality import QualityRun, add_quality
from swarmnode.data import ShardLoader, default_corpus
from swarmnode.ledger import LEDGER_FILE
from swarmnode.model import build_model, configure_determinism, preset
from swarmnode.recovery import RECEIPTS_FILE

BATCH_SIZE = 8
SEQ_LEN = 128
NODE_HOT_EVERY = 50
TIMEOUT_S = 900.0


def bench_train(
    preset_name: str,
    steps: int = 100,
    nodes: int = 4,
    inner_steps: int = 100,
    rounds: int = 8,
    quality: bool = True,
) -> BenchResult:
    """`steps`: timed training steps (node and bare loop each); `nodes`, `inner_steps`, `rounds`: the
    quality run's workers, H and outer steps; `quality`: run it."""
    result = BenchResult("train", preset_name)
    threads = torch.get_num_threads()
    tokens = steps * BATCH_SIZE * SEQ_LEN
    bare_first = bare_loop_seconds(preset_name, steps // 2, threads)
    node_s = node_seconds(preset_name, steps, threads)
    bare_s = bare_first + bare_loop_seconds(preset_name, steps - steps // 2, threads)
    setup = f"batch {BATCH_SIZE}×{SEQ_LEN}, {threads} threads, {steps} steps"
    result.add("node tokens/s (snapshots, DHT, metrics on)", tokens / node_s, "tok/s", setup)
    result.add("bare training loop tokens/s", tokens / bare_s, "tok/s", load_note())
    result.ratio("node / bare loop tokens/s", bare_s / node_s, "target ≥ 0.97")
    if quality:
        with tempfile.TemporaryDirectory() as tmp:
            add_quality(result, QualityRun(nodes, inner_steps, rounds), Path(tmp))
    return result


def bare_loop_seconds(preset_name: str, steps: int, threads: int) -> float:
    """Seconds of `steps` plain AdamW steps after one untimed warm-up step."""
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

    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - started


def node_seconds(preset_name: str, steps: int, threads: int) -> float:
    """Seconds a real node takes for `steps` inner steps after its first one."""
    hot_every = min(NODE_HOT_EVERY, max(1, steps // 2))
    args = [
        *("--model", preset_name, "--threads", str(threads), "--run-id", "bench-train"),
        *("--batch-size", str(BATCH_SIZE), "--seq-len", str(SEQ_LEN)),
        *("--inner-steps", str(steps + 1), "--max-outer-steps", "1", "--hot-every", str(hot_every)),
    ]
    with tempfile.TemporaryDirectory() as tmp, Node(Path(tmp) / "node", args) as node:
        node.info(TIMEOUT_S)

        def has(read: object) -> bool:
            if not node.alive():
                raise node.fail("the node exited")
            return bool(read)

        receipts = node.data_dir / RECEIPTS_FILE
        wait_until(lambda: has(json_lines(receipts)), TIMEOUT_S, "the node's first inner step")
        started = time.perf_counter()
        wait_until(lambda: has(_rounds(node.data_dir)), TIMEOUT_S, "the node's inner phase to end")
        return time.perf_counter() - started


def _rounds(data_dir: Path) -> list[dict[str, object]]:
    return [e for e in json_lines(data_dir / LEDGER_FILE) if e.get("event") == "round"]
