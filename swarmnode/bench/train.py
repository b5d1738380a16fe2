"""`swarmnode bench train`: tokens/s of a real node vs a bare training loop of the same model, and
(unless `--no-quality`) DiLoCo vs synchronous data parallel with the `tiny` preset (`bench_quality.py`).

The node is a single `swarmnode run` with its snapshots (hot every 50 inner steps, the default, or more
often when fewer steps are timed), DHT and metrics on, and JSON progress lines every 0.1 s that say how
far it is. The bare loop is what the node wraps — `TrainingRun.inner_phase` on a training thread, same
model, batch, AdamW, shard and `--threads` — in a worker process of its own session started like the
node, with nothing else (`bare_train`), warmed up for a whole window before the node starts: where the
kernel groups scheduling by session, a loop in the caller's session would share its session's CPU
share while the node had one of its own. Other work on a shared machine comes and goes, so the two take turns,
one snapshot period each: the node trains from one of its snapshots to the next (a window holds one staging
stall and one whole background write), then waits stopped (SIGSTOP) while the bare loop trains as many steps.
Each node window is compared with the bare window beside it, and the ratio is the median of those
pairs: a window that met a burst of other load moves one pair, not the figure; single windows vary
widely even on an idle machine, and twelve pairs (600 steps, the default) steady the median. Before each bare
window, with the node stopped, the bench flushes the page cache (`os.sync()`, timed in neither
window): a node's snapshot leaves its size in dirty pages that the kernel writes back some seconds
later, with the discard of the blocks retention freed, and unflushed that work would land in the bare
window. The writeback's own kernel CPU is thus charged to neither side (docs/benchmarks.md "How the
train bench's anchor is measured" has the figures behind each of these choices).
The best windows' ratio is printed beside it.

A third anchor, the *plain loop*, takes a window after each bare one in the same worker: the model the
spec builds, `torch.optim.AdamW` with the same groups, clip and learning rate, the same batches, and
nothing of swarmnode's around it (no `TrainingRun`, no trainer) — what a user would write for the
model without us. `node / plain loop` is the seam's whole cost, for a preset or an `hf:`/`py:` model
(`--model hf:DIR`; the quality part compares presets only, so `--no-quality` with one).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmnode.bench.mfu import matmul_flops_per_s, training_flops_per_token
from swarmnode.bench.procs import NodeProcess, Worker, wait_until
from swarmnode.bench.quality_sim import QualityRun, add_quality
from swarmnode.bench.runner import BenchResult, load_note, median, trained_run
from swarmnode.bench.worker_lines import answer_requests, say
from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.model import configure_determinism, count_parameters, select_device
from swarmnode.core.model_spec import ModelSpec, load_model_spec
from swarmnode.core.precision import MixedPrecision, Precision, resolve_precision
from swarmnode.util.threads import TrainingThread

BATCH_SIZE = 8
SEQ_LEN = 128
GPU_BATCH_SIZE = 32
"""On a GPU a batch of 8 leaves the device waiting on kernel launches: 32 sequences measure the device."""
NODE_HOT_EVERY = 50
GPU_HOT_EVERY = 200
"""On a GPU, steps are ~100× faster: the windows (from one hot snapshot to the next) are longer, so the
node's progress lines (every PROGRESS_S) time them closely."""
TIMEOUT_S = 900.0
PROGRESS_S = 0.1
"""The node's progress interval: when each window ends is known to within this."""


@dataclass(frozen=True)
class TrainSetup:
    """Where and how both sides train: the device, its precision and the batch."""

    device: torch.device
    precision: Precision
    batch_size: int
    hot_every: int

    @classmethod
    def on(cls, device_choice: str, precision_choice: str) -> TrainSetup:
        device = select_device(device_choice)  # (ConfigError naming --device or --precision)
        on_gpu = device.type == "cuda"
        return cls(
            device,
            resolve_precision(precision_choice, device),
            GPU_BATCH_SIZE if on_gpu else BATCH_SIZE,
            GPU_HOT_EVERY if on_gpu else NODE_HOT_EVERY,
        )

    @property
    def tokens(self) -> int:
        return self.batch_size * SEQ_LEN

    def args(self) -> tuple[str, ...]:
        """Its values as the worker's and the node's arguments."""
        return (str(self.device), str(self.precision), str(self.batch_size))


def bench_train(
    preset_name: str,
    steps: int | None = None,
    nodes: int = 4,
    inner_steps: int = 100,
    rounds: int = 6,
    quality: bool = True,
    device: str = "cpu",
    precision: str = "auto",
) -> BenchResult:
    """`steps`: timed training steps (node and bare loop each; default 600, on a GPU 2000); `nodes`,
    `inner_steps`, `rounds`: the quality run's workers, H and outer steps; `quality`: run it (on the
    CPU); `device`, `precision`: where and how the node and the loops train (as `run`'s flags)."""
    setup = TrainSetup.on(device, precision)
    steps = steps or (2000 if setup.device.type == "cuda" else 600)
    result = BenchResult("train", preset_name)
    threads = torch.get_num_threads()
    window = min(setup.hot_every, max(1, steps // 2))
    node, bare, plain = alternate(preset_name, threads, window, max(1, steps // window), setup)
    tokens = setup.tokens
    where = f"{setup.device} {setup.precision}, batch {setup.batch_size}x{SEQ_LEN}"
    node_note = f"{where}; {_note(node, window, tokens)}"
    result.add("node tokens/s (snapshots, DHT, metrics on)", max(node) * tokens, "tok/s", node_note)
    result.add("bare training loop tokens/s", max(bare) * tokens, "tok/s", _note(bare, window, tokens))
    paired = median([n / b for n, b in zip(node, bare, strict=True)])
    result.ratio(
        "node / bare loop tokens/s",
        paired,
        f"median of {len(node)} window pairs, target 0.95-1.02; {load_note()}",
    )
    result.add("plain torch loop tokens/s", max(plain) * tokens, "tok/s", _note(plain, window, tokens))
    result.ratio(
        "node / plain torch loop tokens/s",
        median([n / p for n, p in zip(node, plain, strict=True)]),
        f"median of {len(node)} window pairs, target >= 0.95",
    )
    result.ratio(
        "node / bare loop tokens/s (best windows)",
        max(node) / max(bare),
        "best node window / best bare window",
    )
    add_mfu(result, preset_name, setup, max(node) * tokens, max(bare) * tokens)
    if quality and setup.device.type == "cpu":
        with tempfile.TemporaryDirectory() as tmp:
            add_quality(result, QualityRun(nodes, inner_steps, rounds), Path(tmp))
    return result


def _note(rates: list[float], window: int, tokens: int) -> str:
    return f"best of {len(rates)} windows of {window} steps, median {median(rates) * tokens:.0f}"


def add_mfu(result: BenchResult, model_name: str, setup: TrainSetup, node: float, bare: float) -> None:
    """Model FLOPs utilisation of the node and the bare loop against this device's own matmul rate in
    the same precision, measured now (`mfu.py`)."""
    spec = load_model_spec(model_name, default_corpus().vocab_size)
    parameters = count_parameters(spec.build(0, torch.device("cpu")))
    per_token = training_flops_per_token(model_name, parameters, SEQ_LEN)
    peak = matmul_flops_per_s(setup.device, setup.precision)
    result.add("matmul rate measured", peak / 1e12, "TFLOP/s", f"{setup.precision} square matmul")
    result.ratio("node MFU", node * per_token / peak, f"{per_token / 1e6:.1f} MFLOP per token")
    result.ratio("bare loop MFU", bare * per_token / peak, "against the same matmul rate")


def alternate(
    preset_name: str, threads: int, window: int, windows: int, setup: TrainSetup
) -> tuple[list[float], list[float], list[float]]:
    """Steps per second of the node and of the bare loop, window by window: the node trains a window
    (from one of its snapshots to the next), is stopped (SIGSTOP) while the bare loop trains one,
    then goes on; so both meet the machine's other load alike. The bare worker warms up for a whole
    window first, as the node's first timed window starts after its first snapshot period. The plain
    loop trains a window right after each bare one, while the node is still stopped."""
    args = [
        *("--model", preset_name, "--threads", str(threads), "--run-id", "bench-train", "--shard", "0"),
        *("--batch-size", str(setup.batch_size), "--seq-len", str(SEQ_LEN), "--hot-every", str(window)),
        *("--device", str(setup.device), "--precision", str(setup.precision)),
        *("--inner-steps", "1000000", "--log-format", "json", "--progress-interval", str(PROGRESS_S)),
    ]
    node_rates, bare_rates, plain_rates = [], [], []
    bare_args = (preset_name, str(threads), str(window), *setup.args())
    with tempfile.TemporaryDirectory() as tmp, Worker(Path(tmp), "bare-train", *bare_args) as worker:
        worker.read(TIMEOUT_S)  # warmed up (alone: the node starts after it)
        with NodeProcess(Path(tmp) / "node", args) as node:
            progress = ProgressTail(node)
            start = progress.wait_for(window)
            for k in range(2, windows + 2):
                node.signal(signal.SIGSTOP)
                stopped = time.time()
                # The node's snapshot left ~its size in dirty pages, and the kernel writes them back
                # (and discards the blocks retention freed) some seconds later: in the bare window
                # unless flushed here, where neither window is timed.
                os.sync()
                bare_rates.append(window / float(worker.ask({"steps": window}, TIMEOUT_S)["seconds"]))
                plain = worker.ask({"steps": window, "plain": True}, TIMEOUT_S)
                plain_rates.append(window / float(plain["seconds"]))
                node.signal(signal.SIGCONT)
                paused = time.time() - stopped
                end = progress.wait_for(k * window)
                node_rates.append((end[0] - start[0]) / (end[1] - start[1] - paused))
                start = end
    return node_rates, bare_rates, plain_rates


async def bare_train(
    preset_name: str, threads: int, warmup_steps: int, device: str, precision: str, batch_size: int
) -> None:
    """The `bare-train` worker: `warmup_steps` untimed steps, then one timed window per request
    (`{"steps": n}`: the seconds of n inner steps, measured here; with `"plain": true`, n steps of the
    plain loop, `PlainLoop`).

    The anchor: the loop a node wraps — `TrainingRun.inner_phase` on a training thread — in a worker
    process of its own, started like the node (same interpreter, environment, `--threads`,
    deterministic kernels, model, batch, shard 0) but with no snapshots, DHT, gRPC or metrics server.
    While it trains, the node is stopped, and while the node trains, it waits on its stdin."""
    where, how = torch.device(device), Precision(precision)
    configure_determinism(where, threads)  # what `swarmnode run --threads` does
    run = trained_run(preset_name, 0, SEQ_LEN, batch_size, where, how)
    plain_run = trained_run(preset_name, 0, SEQ_LEN, batch_size, where, how)  # (its spec, loader, config)
    plain = PlainLoop(plain_run.model_spec, plain_run.loader, plain_run.trainer.cfg, where)
    training, stop = TrainingThread(), threading.Event()

    def steps(count: int) -> float:
        started = time.perf_counter()
        run.inner_phase(run.progress.round_step + count, None, stop, lambda: None)
        return time.perf_counter() - started

    try:
        await training.run(steps, warmup_steps)
        await training.run(plain.steps, warmup_steps)
        say({"bare": True})

        async def window(request: dict[str, Any]) -> dict[str, Any]:
            timed = plain.steps if request.get("plain") else steps
            return {"seconds": await training.run(timed, int(request["steps"]))}

        await answer_requests(window)
    finally:
        training.close()


class PlainLoop:
    """The model trained as a user would without swarmnode: `spec.build`, AdamW (decay on matrices),
    loss, backward, clip, step, on the loader's batches."""

    def __init__(self, spec: ModelSpec, loader: ShardLoader, cfg: DilocoConfig, device: torch.device) -> None:
        self.spec, self.loader, self.cfg, self.device = spec, loader, cfg, device
        self.module = spec.build(0, device)
        self.autocast = MixedPrecision(cfg.precision, device).autocast  # (torch.autocast, or nothing)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision is Precision.FP16)
        params = list(self.module.parameters())
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=cfg.inner_lr,
            betas=cfg.betas,
            foreach=False,
        )

    def steps(self, count: int) -> float:
        """Seconds of `count` training steps (each reads its loss, as a node's step does)."""
        started = time.perf_counter()
        self.module.train()
        for _ in range(count):
            batch = self.loader.next_batch()
            inputs, targets = batch.inputs.to(self.device), batch.targets.to(self.device)
            with self.autocast():
                loss = self.spec.loss(self.module, inputs, targets)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip, foreach=False)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            float(loss.item())
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
