"""`swarmnode bench wan --nodes N --mbit R --model tiny|small`: real `swarmnode run` processes on a
bandwidth-capped test bed (`bench/netbed.py`), blocking outer step against `--overlap on`, same run.

Each node runs in a network namespace of its own, joined to one bridge by a veth pair whose both
directions are capped at R Mbit/s with `tc tbf` (this kernel has no `netem`: no added latency, only
the tbf queue's own, at most 50 ms). The bench starts N nodes (`--threads 1`, a shard each, bf16 on
the wire), waits for rounds that hold all N of them, skips one more as warm-up, and reads `--rounds`
rounds from the nodes' own records: their ledgers (the unix time of each round's `round` entry: its
inner phase ended and Δ was taken; of its `settle` entry: the outer step applied) and the log line
each all-reduce writes (its seconds). Then it stops them and does the same with `--overlap on`.

Per round, means over the nodes:
- inner phase: blocking mode's time from a round's settle to the next round's Δ (H inner steps, no
  traffic on the wire: every member trains at once). It is the anchor of both modes: with the overlap
  the inner phase and the all-reduce run at once, so it cannot be read apart from the round;
- all-reduce: the butterfly's own seconds (matchmaking not included), from the node's log;
- round wall: time between successive rounds' Δ (every second of the round: inner, matchmaking,
  all-reduce, applying the step);
- bytes per node: what each node sent in the last measured round (`swarmnode_allreduce_round_sent_bytes`);
- the nodes take a hot snapshot at the end of each inner phase (`--hot-every H`): its announcement
  is how the members know whom to expect, so matchmaking ends once they have all offered;
- the butterfly's bandwidth bound 2(N−1)/N · B / R, B the Δ's bytes on the wire: every node sends and
  receives (N−1)/N of Δ in each of its two phases over its own capped link, and the measured
  all-reduce against it.
Ratios: round wall / inner phase for each mode, and overlap's round wall / blocking's.
`--wire-dtype topk` instead runs the top-k wire, int4 and bf16, each blocking, and gives each one's
round wall / inner phase (its own inner phase: the same H, no traffic during it).
Root only (namespaces): without it the bench refuses with one line (exit 2).
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from swarmnode.bench import netbed
from swarmnode.bench.netbed import NetBed
from swarmnode.bench.procs import NodeProcess, samples, stop_all, wait_until
from swarmnode.bench.runner import BenchResult, load_note
from swarmnode.core.data import default_corpus
from swarmnode.core.ledger import read_ledger
from swarmnode.core.model import GPT, count_parameters
from swarmnode.core.presets import preset
from swarmnode.swarm.averaging import codecs
from swarmnode.util.errors import ConfigError

WIRE = "bf16"
DEFAULT_INNER_STEPS = {"tiny": 40, "small": 100}
"""H per model: `small` at the quality bench's H (100); per-round costs that are not communication (the
held-out loss after each step, the hot snapshot each round's announcement needs) weigh more at small H
(docs/benchmarks.md "On a capped network" has both)."""
_ROUND_LINE = re.compile(r"round (\d+): averaged with (\d+) members in ([0-9.]+) s")


@dataclass(frozen=True)
class Rounds:
    """One mode's means per round over the measured rounds and the nodes."""

    mode: str
    rounds: list[int]
    inner_s: float
    allreduce_s: float
    round_wall_s: float
    bytes_per_node: float
    per_round_wall_s: list[float]
    per_round_allreduce_s: list[float]


def bench_wan(
    preset_name: str,
    nodes: int = 4,
    mbit: float = 50.0,
    rounds: int = 4,
    inner_steps: int | None = None,
    wire_dtype: str | None = None,
) -> BenchResult:
    """`--wire-dtype topk`: the top-k wire, int4 and bf16, each blocking, in the same run (`bench_wires`);
    otherwise bf16 blocking against `--overlap on`."""
    if nodes < 2:
        raise ConfigError(f"--nodes: bench wan needs at least 2 nodes, got {nodes}")
    netbed.require_bed("bench wan", mbit)
    steps = inner_steps or DEFAULT_INNER_STEPS.get(preset_name, 30)
    if wire_dtype == "topk":
        return bench_wires(preset_name, nodes, mbit, rounds, steps)
    if wire_dtype not in (None, WIRE):
        raise ConfigError(
            f"--wire-dtype: bench wan takes topk (against int4 and bf16) or bf16, got {wire_dtype}"
        )
    n_values = _parameters(preset_name)
    delta_bytes = codecs.encoded_size(WIRE, n_values)
    bound_s = 2 * (nodes - 1) / nodes * delta_bytes * 8 / (mbit * 1e6)

    result = BenchResult("wan", preset_name)
    blocking = _measure(preset_name, nodes, mbit, rounds, steps, "off")
    overlapped = _measure(preset_name, nodes, mbit, rounds, steps, "on")
    anchor = blocking.inner_s
    result.add("nodes × link cap", nodes, "nodes", f"{mbit:g} Mbit/s each way per node (tc tbf, no latency)")
    result.add("inner steps per round (H)", steps, "steps", f"{n_values} parameters, {WIRE} on the wire")
    result.add("Δ on the wire (B)", delta_bytes / 1e6, "MB")
    result.add("butterfly bound 2(N-1)/N·B/R", bound_s, "s")
    for m in (blocking, overlapped):
        tag = f"{m.mode}:"
        result.add(
            f"{tag} inner phase per round",
            m.inner_s if m.mode == "blocking" else anchor,
            "s",
            "" if m.mode == "blocking" else "blocking mode's (the anchor)",
        )
        _add_rounds(result, tag, m)
        result.add(f"{tag} rounds measured", len(m.rounds), "", f"outer steps {m.rounds[0]}..{m.rounds[-1]}")
    result.add("load", os.getloadavg()[0], "", load_note())
    result.ratio("blocking: round wall / inner phase", blocking.round_wall_s / anchor)
    result.ratio(
        "overlap: round wall / inner phase",
        overlapped.round_wall_s / anchor,
        "the inner phase: blocking mode's",
    )
    result.ratio("overlap round wall / blocking round wall", overlapped.round_wall_s / blocking.round_wall_s)
    result.ratio("blocking: all-reduce / bandwidth bound", blocking.allreduce_s / bound_s)
    result.ratio(
        "overlap: all-reduce / bandwidth bound",
        overlapped.allreduce_s / bound_s,
        "the all-reduce shares the CPU with training",
    )
    result.series = {
        m.mode: {
            "rounds": m.rounds,
            "round_wall_s": m.per_round_wall_s,
            "allreduce_s": m.per_round_allreduce_s,
        }
        for m in (blocking, overlapped)
    }
    return result


def _add_rounds(result: BenchResult, tag: str, m: Rounds) -> None:
    """One measurement's all-reduce, round wall and bytes, each round's figures in the note."""
    result.add(f"{tag} all-reduce per round", m.allreduce_s, "s", _each(m.per_round_allreduce_s))
    result.add(f"{tag} round wall", m.round_wall_s, "s", _each(m.per_round_wall_s))
    result.add(f"{tag} bytes sent per node per round", m.bytes_per_node / 1e6, "MB")


def _each(values: Sequence[float]) -> str:
    return " ".join(f"{x:.2f}" for x in values)


TOPK_COMPARED = ("topk", "int4", "bf16")
TOPK_OVERLAPPED = "topk --overlap on"


def bench_wires(preset_name: str, nodes: int, mbit: float, rounds: int, steps: int) -> BenchResult:
    """The top-k wire, int4 and bf16 on the same bed, each with the blocking outer step: each one's
    round wall against its own inner phase (the same H; the inner phase carries no traffic); then the
    top-k wire with `--overlap on`, against the blocking top-k run's inner phase (with the overlap the
    two run at once and cannot be read apart)."""
    n_values = _parameters(preset_name)
    result = BenchResult("wan", preset_name)
    result.add("nodes × link cap", nodes, "nodes", f"{mbit:g} Mbit/s each way per node (tc tbf, no latency)")
    result.add("inner steps per round (H)", steps, "steps", f"{n_values} parameters, blocking outer step")
    measured = {}
    for index, wire_dtype in enumerate(TOPK_COMPARED):
        m = _measure(preset_name, nodes, mbit, rounds, steps, "off", wire_dtype, index)
        measured[wire_dtype] = m
        tag = f"{wire_dtype}:"
        result.add(f"{tag} Δ on the wire", codecs.encoded_size(wire_dtype, n_values) / 1e6, "MB")
        result.add(f"{tag} inner phase per round", m.inner_s, "s")
        _add_rounds(result, tag, m)
    overlapped = _measure(preset_name, nodes, mbit, rounds, steps, "on", "topk")
    tag = f"{TOPK_OVERLAPPED}:"
    result.add(f"{tag} inner phase per round", measured["topk"].inner_s, "s", "blocking top-k's (the anchor)")
    _add_rounds(result, tag, overlapped)
    result.add("load", os.getloadavg()[0], "", load_note())
    for wire_dtype, m in measured.items():
        target = "target ≤ 1.05" if wire_dtype == "topk" else ""
        result.ratio(f"{wire_dtype}: round wall / inner phase", m.round_wall_s / m.inner_s, target)
    result.ratio(
        f"{TOPK_OVERLAPPED}: round wall / inner phase",
        overlapped.round_wall_s / measured["topk"].inner_s,
        "the inner phase: blocking top-k's",
    )
    measured[TOPK_OVERLAPPED] = overlapped
    result.series = {
        w: {"rounds": m.rounds, "round_wall_s": m.per_round_wall_s, "allreduce_s": m.per_round_allreduce_s}
        for w, m in measured.items()
    }
    return result


def _parameters(preset_name: str) -> int:
    return count_parameters(GPT(preset(preset_name, default_corpus().vocab_size)))


def _node_args(
    preset_name: str, count: int, index: int, steps: int, overlap: str, host: str, wire_dtype: str = WIRE
) -> list[str]:
    return [
        *("--host", host, "--model", preset_name, "--threads", "1", "--seq-len", "64", "--batch-size", "4"),
        *(
            "--inner-steps",
            str(steps),
            "--hot-every",
            str(steps),
            "--keep-hot",
            "1",
            "--cold-every",
            "100000",
        ),
        *(
            "--num-shards",
            str(count),
            "--shard",
            str(index),
            "--wire-dtype",
            wire_dtype,
            "--overlap",
            overlap,
        ),
        *("--matchmaking-timeout", "15", "--allreduce-timeout", "180", "--wait-peers", str(count - 1)),
        *("--run-id", f"bench-wan-{count}-{overlap}-{wire_dtype}", "--seed", "1"),
    ]


def _measure(
    preset_name: str,
    count: int,
    mbit: float,
    rounds: int,
    steps: int,
    overlap: str,
    wire_dtype: str = WIRE,
    index: int = 0,
) -> Rounds:
    net = 100 + os.getpid() % 100
    subnet = f"10.{net}.{60 + (overlap == 'on') + 2 * index}"
    with NetBed() as bed, tempfile.TemporaryDirectory(prefix="swarmnode-bench-wan-") as tmp:
        wan = bed.bridge(f"{subnet}.0/24")
        spaces = []
        for i in range(count):
            ns = bed.namespace(f"n{i}")
            bed.attach(ns, wan, f"{subnet}.{10 + i}", rate_mbit=mbit)
            spaces.append((ns, f"{subnet}.{10 + i}"))
        procs: list[NodeProcess] = []
        try:
            for i, (ns, host) in enumerate(spaces):
                args = _node_args(preset_name, count, i, steps, overlap, host, wire_dtype)
                if procs:
                    args += ["--peers", f"{spaces[0][1]}:{procs[0].info['dht_port']}"]
                procs.append(NodeProcess(Path(tmp) / f"n{i}", args, prefix=ns.prefix).start())
                if i == 0:
                    procs[0].wait_ready(300)
            for p in procs:
                p.wait_ready(300)
            budget = 600 + 60 * rounds * (1 + (preset_name != "tiny") * 4)
            window = wait_until(
                lambda: _window(procs, rounds), budget, f"{rounds} rounds of all {count}", interval_s=1.0
            )
            sent = statistics.mean(_metric(p, "swarmnode_allreduce_round_sent_bytes") for p in procs)
            return _figures("blocking" if overlap == "off" else "overlap", procs, window, sent)
        finally:
            stop_all(procs, 120)


def _timeline(p: NodeProcess) -> tuple[dict[int, float], dict[int, tuple[float, int]]]:
    """outer step -> unix time of its `round` entry; -> (time, group size) of its `settle` entry."""
    starts: dict[int, float] = {}
    settles: dict[int, tuple[float, int]] = {}
    for e in read_ledger(p.data_dir):
        if "ts" not in e:
            continue
        if e["event"] == "round":
            starts[int(e["outer_step"])] = float(e["ts"])
        elif e["event"] == "settle":
            settles[int(e["outer_step"])] = (float(e["ts"]), int(e["group_size"]))
    return starts, settles


def _window(procs: list[NodeProcess], rounds: int) -> list[int] | None:
    """The outer steps to measure, once every node has them: after the first round of all N and one more
    (warm-up), `rounds` rounds of all N each followed by the next round's Δ (which ends its wall)."""
    for p in procs:
        if not p.alive():
            raise p.fail("node exited during the bench")
    lines = [_timeline(p) for p in procs]
    full = [{o for o, (_, size) in settles.items() if size == len(procs)} for _, settles in lines]
    common = sorted(set.intersection(*full))
    if len(common) < rounds + 1:
        return None
    chosen = common[1 : rounds + 1]
    if not all(o + 1 in starts for o in chosen for starts, _ in lines):
        return None
    return chosen


def _allreduce_seconds(p: NodeProcess) -> dict[int, float]:
    found = {}
    for match in _ROUND_LINE.finditer(p.log()):
        found[int(match.group(1))] = float(match.group(3))
    return found


def _figures(mode: str, procs: list[NodeProcess], window: list[int], sent: float) -> Rounds:
    lines = [_timeline(p) for p in procs]
    allreduces = [_allreduce_seconds(p) for p in procs]
    walls, inners, reduces = [], [], []
    for o in window:
        walls.append(statistics.mean(starts[o + 1] - starts[o] for starts, _ in lines))
        inners.append(statistics.mean(starts[o + 1] - settles[o][0] for starts, settles in lines))
        reduces.append(statistics.mean(a[o] for a in allreduces if o in a))
    return Rounds(
        mode,
        window,
        statistics.mean(inners),
        statistics.mean(reduces),
        statistics.mean(walls),
        sent,
        walls,
        reduces,
    )


def _metric(p: NodeProcess, name: str) -> float:
    return samples(p.metrics(timeout_s=20)).get(name, 0.0)
