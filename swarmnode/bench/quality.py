"""DiLoCo vs synchronous data parallel on the default corpus with the `tiny` preset, simulated without
a network (part of `swarmnode bench train`): each side trains in one worker process, the two at once.

DiLoCo: W `DilocoTrainer`s, worker k on shard k of W, H inner AdamW steps each, then the plain mean of
their pseudo-gradients as every worker's outer step (Nesterov, the paper's defaults). Synchronous DP: one
model whose every AdamW step takes the W workers' batches together (the mean loss over the global batch:
the average of the workers' gradients, as an all-reduce every step would give), H·R steps, so both see the
same global batch and the same tokens. Bytes communicated per worker: DiLoCo 2 × params × 4 bytes (fp32)
per outer step, DP the same per step; so DP sends H times as many.

Beside blocking DiLoCo, at equal tokens: `overlap`, the overlapped outer step of `--overlap on` with
the average landing `OVERLAP_SHARE`·H inner steps into the next round (`outer_step_overlapped`); and
`int4`, every Δ and every average through the 4-bit wire codec, as the butterfly sends them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmnode.bench.runner import BenchResult
from swarmnode.core.data import Batch, Corpus, ShardLoader, default_corpus
from swarmnode.core.diloco import AveragedDelta, DilocoConfig, DilocoTrainer
from swarmnode.core.model import build_model, count_parameters
from swarmnode.core.presets import preset
from swarmnode.swarm import codecs
from swarmnode.util.procs import Worker

PRESET = "tiny"
BATCH_SIZE = 8
SEQ_LEN = 128
HELDOUT_BATCHES = 16
FP32_BYTES = 4
TIMEOUT_S = 3600.0
OVERLAP_SHARE = 0.25
"""Inner steps the overlapped all-reduce takes, as a share of H (a slow link's round)."""
VARIANTS = ("overlap", "int4")


@dataclass(frozen=True)
class QualityRun:
    workers: int
    inner_steps: int
    outer_steps: int


def add_quality(result: BenchResult, run: QualityRun, log_dir: Path) -> None:
    """Adds the held-out losses and bytes of DiLoCo and of synchronous DP, and their ratios. The two
    train at once, each in a worker process with one torch thread (tiny tensors: one thread is as
    fast as two, and immune to the stalls other load causes in a two-thread fork/join)."""
    request = {"workers": run.workers, "inner_steps": run.inner_steps, "outer_steps": run.outer_steps}
    with contextlib.ExitStack() as stack:
        sides = [
            stack.enter_context(Worker(log_dir, "quality", side)) for side in ("diloco", "dp", *VARIANTS)
        ]
        for side in sides:
            side.read(TIMEOUT_S)  # started
            side.send(request)
        d, p, *variants = (side.read(TIMEOUT_S) for side in sides)
    per_exchange = 2 * d["params"] * FP32_BYTES * run.workers
    diloco_bytes = per_exchange * run.outer_steps
    dp_bytes = per_exchange * run.outer_steps * run.inner_steps
    tokens = run.workers * run.inner_steps * run.outer_steps * BATCH_SIZE * SEQ_LEN
    setup = f"{run.workers} workers, H={run.inner_steps}, {run.outer_steps} outer steps, {tokens} tokens"
    label = f"quality ({PRESET}):"
    result.add(f"{label} DiLoCo held-out loss", d["loss"], "nats", f"{setup}; {d['seconds']:.0f} s")
    result.add(f"{label} sync DP held-out loss", p["loss"], "nats", f"same tokens; {p['seconds']:.0f} s")
    result.add(f"{label} DiLoCo bytes communicated", diloco_bytes / 1e6, "MB", "fp32, all workers")
    result.add(f"{label} sync DP bytes communicated", dp_bytes / 1e6, "MB", "fp32, all workers")
    result.ratio("DiLoCo loss / sync DP loss", d["loss"] / p["loss"], "target ≤ 1.02")
    result.ratio("sync DP bytes / DiLoCo bytes", dp_bytes / diloco_bytes, "target ≥ 100")
    for name, v in zip(VARIANTS, variants, strict=True):
        result.add(
            f"{label} DiLoCo {name} held-out loss", v["loss"], "nats", f"same tokens; {v['seconds']:.0f} s"
        )
        result.ratio(f"DiLoCo {name} loss / DiLoCo loss", v["loss"] / d["loss"], "target ≤ 1.01")


def train_side(side: str, run: QualityRun) -> dict[str, float]:
    """Trains one side ("diloco" or "dp") with one torch thread; its held-out loss, params, seconds."""
    torch.set_num_threads(1)
    corpus = default_corpus()
    heldout = _loader(corpus, 0, run.workers).heldout_batches(HELDOUT_BATCHES)
    started = time.perf_counter()
    if side == "dp":
        trainer = _data_parallel(corpus, run)
    else:
        overlap = int(OVERLAP_SHARE * run.inner_steps) if side == "overlap" else 0
        trainer = _diloco(corpus, run, "int4" if side == "int4" else "fp32", overlap)
    loss = trainer.evaluate(heldout, use_global=side != "dp")
    params = count_parameters(trainer.model)
    return {"loss": loss, "params": params, "seconds": time.perf_counter() - started}


def _loader(corpus: Corpus, shard: int, workers: int) -> ShardLoader:
    return ShardLoader(corpus, shard, workers, BATCH_SIZE, SEQ_LEN, seed=0)


def _trainer(corpus: Corpus) -> DilocoTrainer:
    """A fresh trainer; every one starts from the same weights (seed 0), like a run's nodes."""
    model = build_model(preset(PRESET, corpus.vocab_size), 0, torch.device("cpu"))
    return DilocoTrainer(model, DilocoConfig(), torch.device("cpu"))


def _diloco(corpus: Corpus, run: QualityRun, wire: str = "fp32", overlap: int = 0) -> DilocoTrainer:
    """Worker 0 after the outer steps (every worker then holds the same θ_g). `wire`: the codec every
    Δ and the average pass through; `overlap` > 0: each round's average lands that many inner steps
    into the next round (the last one after the last round), as with `--overlap on`."""
    trainers = [_trainer(corpus) for _ in range(run.workers)]
    loaders = [_loader(corpus, k, run.workers) for k in range(run.workers)]
    pending: tuple[AveragedDelta, list[torch.Tensor]] | None = None
    for _ in range(run.outer_steps):
        for trainer, loader in zip(trainers, loaders, strict=True):
            for _ in range(overlap if pending else 0):
                trainer.inner_step(loader.next_batch())
        if pending is not None:
            _land(trainers, *pending)
        for trainer, loader in zip(trainers, loaders, strict=True):
            for _ in range(run.inner_steps - (overlap if pending else 0)):
                trainer.inner_step(loader.next_batch())
        deltas = [t.pseudo_gradient().clone() for t in trainers]
        mean = _through(torch.stack([_through(d, wire) for d in deltas]).mean(dim=0), wire)
        pending = (AveragedDelta(mean, ((0, mean.numel()),), run.workers), deltas)
        if not overlap:
            _land(trainers, *pending, blocking=True)
            pending = None
    if pending is not None:
        _land(trainers, *pending)
    return trainers[0]


def _land(
    trainers: list[DilocoTrainer], averaged: AveragedDelta, deltas: list[torch.Tensor], blocking: bool = False
) -> None:
    for trainer, delta in zip(trainers, deltas, strict=True):
        if blocking:
            trainer.outer_step(averaged)
        else:
            trainer.outer_step_overlapped(averaged, delta)


def _through(x: torch.Tensor, wire: str) -> torch.Tensor:
    """`x` as a member decodes it after the wire codec (fp32: `x` itself)."""
    return x if wire == "fp32" else codecs.decode(codecs.encode(x.contiguous(), wire), wire, x.numel())


def _data_parallel(corpus: Corpus, run: QualityRun) -> DilocoTrainer:
    """One model trained on the workers' batches together, H·R steps (its local θ is the model)."""
    trainer = _trainer(corpus)
    loaders = [_loader(corpus, k, run.workers) for k in range(run.workers)]
    for _ in range(run.outer_steps * run.inner_steps):
        batches = [loader.next_batch() for loader in loaders]
        inputs = torch.cat([b.inputs for b in batches])
        targets = torch.cat([b.targets for b in batches])
        trainer.inner_step(Batch(inputs, targets, batches[0].epoch, batches[0].position))
    return trainer
