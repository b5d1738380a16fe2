"""`swarmnode bench swarm --nodes 8,16,32`: a swarm of N real `swarmnode run` processes on loopback, per N.

Each node trains the preset with `--threads 1` on a shard of its own, in groups of `--group-size`
(default 4 here, so every N above it averages in two levels). Once every node's last round held all
N nodes the bench takes each node's metrics, lets the swarm run `--rounds` more, takes them again, and
reports per N (means over the nodes, over those rounds): matchmaking seconds, all-reduce seconds, DHT
requests sent, rounds completed (outer steps applied) against rounds attempted (matchmakings), the wall
time of a round, and the peak RSS of the largest node. The round's *overhead* is matchmaking plus
all-reduce; its anchor, in the same run, is the round's wall time (the inner phase shares the machine's
cores with every other node, so N processes on a few cores slow everything alike: the overhead's share
of the round is the figure that compares across N). `--plot FILE.png` draws both against N, log-log.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from swarmnode.bench import procs
from swarmnode.bench.procs import ChildFailed, NodeProcess, wait_until
from swarmnode.bench.runner import BenchResult, load_note

DEFAULT_NODES = (8, 16, 32)


@dataclass(frozen=True)
class SwarmFigures:
    """One swarm size's means per node and round."""

    nodes: int
    matchmaking_s: float
    allreduce_s: float
    dht_requests: float
    completed: float
    attempted: float
    round_wall_s: float
    peak_rss_mb: float

    @property
    def overhead_s(self) -> float:
        return self.matchmaking_s + self.allreduce_s


def bench_swarm(
    preset_name: str,
    nodes: Sequence[int] | int = DEFAULT_NODES,
    rounds: int = 4,
    inner_steps: int = 10,
    group_size: int = 4,
    plot: str | Path | None = None,
) -> BenchResult:
    counts = (nodes,) if isinstance(nodes, int) else tuple(nodes)
    result = BenchResult("swarm", preset_name)
    measured = []
    for n in counts:
        try:
            measured.append(_measure(preset_name, n, rounds, inner_steps, group_size))
        except (ChildFailed, TimeoutError, OSError) as exc:  # one size failing leaves the others' figures
            result.add(f"N={n}: not measured", 0, "", str(exc).splitlines()[0][:200])
            continue
        _report(result, measured[-1], group_size)
    if len(measured) > 1:
        first, last = measured[0], measured[-1]
        growth = math.log(last.nodes / first.nodes)
        result.ratio(
            f"overhead share N={last.nodes} / N={first.nodes}",
            (last.overhead_s / last.round_wall_s) / (first.overhead_s / first.round_wall_s),
            f"ln(N ratio) = {growth:.2f}: at most logarithmic growth keeps this near or below 1 + it",
        )
    if plot is not None and measured:
        _plot(measured, group_size, plot)
        result.add("plot", 0, "", str(plot))
    return result


def _report(result: BenchResult, m: SwarmFigures, group_size: int) -> None:
    n = m.nodes
    result.add(f"N={n}: matchmaking per round", m.matchmaking_s, "s", f"groups of {group_size}")
    result.add(f"N={n}: all-reduce per round", m.allreduce_s, "s")
    result.add(f"N={n}: DHT requests per node per round", m.dht_requests, "req")
    result.add(
        f"N={n}: rounds completed / attempted",
        m.completed / max(m.attempted, 1e-9),
        "",
        (f"{m.completed:.1f} of {m.attempted:.1f} per node"),
    )
    result.add(f"N={n}: round wall time", m.round_wall_s, "s", load_note())
    result.add(f"N={n}: peak RSS of the largest node", m.peak_rss_mb, "MB")
    result.ratio(f"N={n}: overhead / round wall time", m.overhead_s / m.round_wall_s)


def _node_args(preset_name: str, count: int, index: int, inner_steps: int, group_size: int) -> list[str]:
    return [
        *("--model", preset_name, "--threads", "1", "--seq-len", "64", "--batch-size", "4"),
        *("--inner-steps", str(inner_steps), "--hot-every", "100000"),
        *("--cold-every", "1", "--keep-cold", "1"),
        *("--num-shards", str(count), "--shard", str(index), "--group-size", str(group_size)),
        *("--matchmaking-timeout", "10", "--allreduce-timeout", "30", "--wait-peers", str(min(count - 1, 7))),
        *("--run-id", f"bench-swarm-{count}", "--seed", "1"),
    ]


def _measure(preset_name: str, count: int, rounds: int, inner_steps: int, group_size: int) -> SwarmFigures:
    with tempfile.TemporaryDirectory(prefix="swarmnode-bench-swarm-") as tmp:
        nodes: list[NodeProcess] = []
        try:
            first = NodeProcess(Path(tmp) / "n0", _node_args(preset_name, count, 0, inner_steps, group_size))
            nodes.append(first.start())
            peers = ["--peers", f"127.0.0.1:{first.wait_ready(300)['dht_port']}"]
            for i in range(1, count):
                args = [*_node_args(preset_name, count, i, inner_steps, group_size), *peers]
                nodes.append(NodeProcess(Path(tmp) / f"n{i}", args).start())
            for node in nodes:
                node.wait_ready(600)
            whole = _scrape_when_whole(nodes)
            before, started = whole, time.monotonic()
            after = _scrape_at_step(nodes, int(max(s["swarmnode_outer_step"] for s in whole)) + rounds)
            wall = (time.monotonic() - started) / rounds
            rss = max(procs.peak_rss_mb(node.proc.pid) for node in nodes if node.proc is not None)
        finally:
            procs.stop_all(nodes, 60)
        return _figures(count, before, after, wall, rss)


def _scrape_when_whole(nodes: list[NodeProcess]) -> list[dict[str, float]]:
    """Every node's metrics once each one's last round averaged with all of them. Nodes start
    training as soon as they know a few peers (`--wait-peers` counts routing contacts, and in a swarm
    of dozens a node may not know every other one for a while); the first ones to start run rounds
    among themselves and the others catch up and join, so the bench measures the whole swarm only."""

    def whole() -> list[dict[str, float]] | None:
        samples = [_metrics(node) for node in nodes]
        return samples if all(s.get("swarmnode_group_size", 0) >= len(nodes) for s in samples) else None

    return wait_until(whole, 300 + 20 * len(nodes), f"a round with all {len(nodes)} nodes", interval_s=0.5)


def _scrape_at_step(nodes: list[NodeProcess], outer_step: int) -> list[dict[str, float]]:
    """Every node's metrics, once every node's outer step has reached `outer_step`."""
    budget = 120 + 30 * len(nodes) * max(outer_step, 1)

    def all_there() -> list[dict[str, float]] | None:
        samples = [_metrics(node) for node in nodes]
        return samples if all(s.get("swarmnode_outer_step", 0) >= outer_step for s in samples) else None

    return wait_until(all_there, budget, f"{len(nodes)} nodes at outer step {outer_step}", interval_s=0.5)


def _metrics(node: NodeProcess) -> dict[str, float]:
    """The node's samples, labelled ones summed per name (0 for any the node cannot serve now)."""
    if not node.alive():
        raise node.fail("node exited during the bench")
    try:
        return procs.samples(node.metrics())
    except OSError:
        return {}


def _figures(
    count: int, before: list[dict[str, float]], after: list[dict[str, float]], wall: float, rss: float
) -> SwarmFigures:
    def per_node(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True)) / count

    attempted = per_node("swarmnode_matchmaking_seconds_count")
    allreduces = per_node("swarmnode_allreduce_seconds_count")
    return SwarmFigures(
        count,
        per_node("swarmnode_matchmaking_seconds_sum") / max(attempted, 1e-9),
        per_node("swarmnode_allreduce_seconds_sum") / max(allreduces, 1e-9),
        per_node("swarmnode_dht_requests_total") / max(attempted, 1e-9),
        per_node("swarmnode_outer_steps_total"),
        attempted,
        wall,
        rss,
    )


def _plot(measured: list[SwarmFigures], group_size: int, path: str | Path) -> None:
    """Left: seconds per round against N (log-log); right: the overhead's share of the round, the
    figure that compares across N on one machine, with 1 + ln(N/N₀) growth for reference."""
    from matplotlib.ticker import NullFormatter

    from swarmnode.bench.plotting import new_figure, save_png

    ns = [m.nodes for m in measured]
    fig, (ax, share) = new_figure(height=4, cols=2, width=10)
    ax.loglog(ns, [m.overhead_s for m in measured], "o-", label="overhead (matchmaking + all-reduce)")
    ax.loglog(ns, [m.matchmaking_s for m in measured], "s--", label="matchmaking")
    ax.loglog(ns, [m.allreduce_s for m in measured], "^--", label="all-reduce")
    ax.loglog(ns, [m.round_wall_s for m in measured], "x:", label="round wall time (anchor)")
    ax.set_ylabel("seconds per round")
    base = measured[0]
    shares = [m.overhead_s / m.round_wall_s for m in measured]
    share.loglog(ns, shares, "o-", label="overhead / round wall time")
    reference = [shares[0] * (1 + math.log(n / base.nodes)) for n in ns]
    share.loglog(ns, reference, "k-", lw=0.6, label=f"{shares[0]:.2f}·(1 + ln(N/{base.nodes}))")
    share.set_ylabel("share of the round")
    for a in (ax, share):
        a.set_xticks(ns, [str(n) for n in ns])
        a.xaxis.set_minor_formatter(NullFormatter())
        a.set_xlabel("nodes N")
        a.legend(fontsize=7)
    fig.suptitle(f"swarmnode bench swarm: groups of {group_size}, N processes on one machine")
    save_png(fig, Path(path))
