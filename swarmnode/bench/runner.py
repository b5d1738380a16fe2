"""`swarmnode bench`: what this machine does, each figure a ratio against an anchor measured in the same
run (shared machines are noisy: only ratios within one run mean anything). Absolute times are printed,
never asserted. Peak RSS is reported beside each figure.

This module holds the report format, the shared helpers and the registry; each bench lives in
`bench_<name>.py` and is imported only when it runs:

| bench | figure | anchor |
| --- | --- | --- |
| `snapshot` | hot-snapshot stall of the training thread | memcpy of the same bytes |
| `fetch` | gRPC snapshot fetch throughput | raw loopback TCP of the same bytes |
| `recovery` | kill -9 → trained again; `--peers K`: from K peers | each stage alone; from one peer |
| `allreduce` | butterfly all-reduce of a pseudo-gradient | gloo `all_reduce`; 2(N−1)/N · bytes / raw TCP |
| `train` | tokens/s of a real node; DiLoCo quality | a bare training loop; synchronous DP |
| `quality` | DiLoCo's held-out loss over a run; a sweep of its settings | synchronous DP; one worker |
| `swarm` | per swarm size N: matchmaking, all-reduce, DHT requests, rounds, RSS | the round's wall time |
| `wan` | N nodes on links capped at R Mbit/s: blocking vs `--overlap on` | inner phase; 2(N−1)/N · B / R |
| `prepare` | `data prepare` tokens/s; its peak RSS on a ≥ 1 GB jsonl | the tokenizer's `encode_batch`; 1 GB |
| `attacks` | honest members' held-out loss beside a hostile one: screen only, robust | the honest alone |
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import resource
import statistics
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from swarmnode.bench.procs import largest_child_rss_mb
from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.model_choice import ModelKind, parse_model_choice
from swarmnode.core.model_spec import load_model_spec
from swarmnode.core.precision import Precision
from swarmnode.core.training import RunIdentity, TrainingRun, run_digest
from swarmnode.util.errors import ConfigError
from swarmnode.util.metrics import Metrics

KNOBS = (
    "rounds",
    "nodes",
    "workers",
    "steps",
    "inner_steps",
    "quality",
    "plot",
    "sweep",
    "trust",
    "group_size",
    "swarm",
    "variants",
    "mbit",
    "peers",
    "input_gb",
    "device",
    "precision",
    "topk_sweep",
    "topk_outer_lr",
    "wire_dtype",
)
"""Size knobs a bench may take (`--rounds`, `--nodes`, …); each bench names the ones it accepts."""


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
    series: dict[str, Any] = field(default_factory=dict)
    """Curves behind the figures (the quality bench's held-out losses), for plots and scripts."""

    def add(self, name: str, value: float, unit: str, note: str = "") -> None:
        self.figures.append(Figure(name, value, unit, note))

    def ratio(self, name: str, value: float, note: str = "") -> None:
        self.ratios.append(Figure(name, value, "x", note))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def table(self) -> str:
        lines = [f"swarmnode bench {self.bench} (model {self.preset}, peak RSS {self.peak_rss_mb:.0f} MB)"]
        for f in self.figures:
            lines.append(f"  {f.name:<44} {f.value:>12.4g} {f.unit:<8} {f.note}")
        if self.ratios:
            lines.append("  ratios (same run):")
            for f in self.ratios:
                lines.append(f"  {f.name:<44} {f.value:>12.3f} {f.unit:<8} {f.note}")
        return "\n".join(lines)


PRESET_ONLY_BENCHES = ("allreduce", "wan")
"""Benches sized by a preset's parameter count; the others take any --model (hf:, py:)."""


def run_bench(name: str, preset_name: str, options: Mapping[str, Any]) -> BenchResult:
    """Runs bench `name` with the knobs in `options` that are set (not None); ConfigError for a knob the
    bench does not take or a value it refuses."""
    if name in PRESET_ONLY_BENCHES and parse_model_choice(preset_name).kind is not ModelKind.GPT:
        raise ConfigError(f"--model: bench {name} measures the GPT presets only, got {preset_name!r}")
    bench = getattr(importlib.import_module(f"swarmnode.bench.{name}"), f"bench_{name}")
    knobs = {k: options[k] for k in KNOBS if options.get(k) is not None}
    accepted = inspect.signature(bench).parameters
    hints = typing.get_type_hints(bench)
    for knob, value in list(knobs.items()):
        flag = "--" + knob.replace("_", "-")
        if knob not in accepted:
            raise ConfigError(f"{flag}: bench {name} has no such knob, got {value}")
        knobs[knob] = _knob_value(flag, value, many=_takes_many(hints.get(knob)))
    result: BenchResult = bench(preset_name, **knobs)
    result.peak_rss_mb = peak_rss_mb()
    children = largest_child_rss_mb()
    if children:
        result.add("peak RSS of the largest child process", children, "MB")
    return result


def _takes_many(annotation: Any) -> bool:
    """Whether a knob's annotation accepts a sequence (`nodes: Sequence[int] | int`: a list of counts)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = [typing.get_origin(a) or a for a in (typing.get_args(annotation) if union else (annotation,))]
    return any(isinstance(kind, type) and issubclass(kind, Sequence) and kind is not str for kind in kinds)


def _knob_value(flag: str, value: Any, many: bool) -> Any:
    """A knob's value, checked: counts at least 1; `--nodes` a list of counts only where `many`."""
    if isinstance(value, tuple):
        if len(value) > 1 and not many:
            raise ConfigError(f"{flag}: this bench takes one count, got {','.join(map(str, value))}")
        for count in value:
            _knob_value(flag, count, many)
        return value if many else value[0]
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        raise ConfigError(f"{flag}: must be at least 1, got {value}")
    return value


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median(values: list[float]) -> float:
    return statistics.median(values)


def load_note() -> str:
    """The machine's 1-minute load average against its cores: other work competing with the bench."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


CPU = torch.device("cpu")
BENCH_NODE_ID = "be" * 20
"""The node id of the benches' in-process training runs (a valid id, so their snapshots are sound)."""


def trained_run(
    model_name: str,
    train_steps: int,
    seq_len: int,
    batch_size: int,
    device: torch.device = CPU,
    precision: Precision = Precision.FP32,
) -> TrainingRun:
    """A training run of the model (a --model value) on `device` in `precision` after `train_steps`
    inner steps, so weights and Adam moments are realistic (0: none here, nor any call that needs the
    training thread; the caller may train it on its own)."""
    corpus = default_corpus()
    model = load_model_spec(model_name, corpus.vocab_size)
    loader = ShardLoader(corpus, 0, 16, batch_size, min(seq_len, model.context or seq_len), seed=0)
    diloco = DilocoConfig(precision=precision)
    digest = run_digest(model, loader.seq_len, 16, 0, diloco, corpus.digest)
    identity = RunIdentity("bench", BENCH_NODE_ID, digest, corpus.digest, model.label)
    run = TrainingRun(model, diloco, loader, corpus, identity, 0, device, Metrics())
    if train_steps > 0:
        run.inner_phase(train_steps, None, threading.Event(), lambda: None)
    return run
