"""`swarmnode plot DATA_DIR... --out FILE.png`: training loss, held-out loss and tokens/s of one or more
nodes over time, for operators who prefer a picture to a dashboard.

The points come from each data dir's ledger (`ledger.jsonl`: every round and settle entry carries the
node's figures, `core.ledger.STATS`) and, where there are any, from JSON progress lines in the dir's
`*.log` files (`swarmnode run --log-format json 2> DATA_DIR/node.log`: one point per progress
interval). A dir without a ledger is a usage error (exit 2); a dir whose ledger predates the figures
plots nothing and says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmnode.core.ledger import LEDGER_FILE, read_ledger
from swarmnode.util.errors import ConfigError

PANELS = (("loss", "training loss"), ("heldout_loss", "held-out loss"), ("tokens_per_s", "tokens/s"))


@dataclass
class NodeSeries:
    """One node's points per figure: name -> [(unix seconds, value)]."""

    label: str
    points: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {k: [] for k, _ in PANELS})

    def add(self, ts: float, values: dict[str, Any]) -> None:
        for name, _ in PANELS:
            value = values.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
                self.points[name].append((ts, float(value)))

    @property
    def empty(self) -> bool:
        return not any(self.points.values())


def read_series(data_dir: Path) -> NodeSeries:
    """A data dir's points from its ledger and its JSON logs, in time order."""
    entries = read_ledger(data_dir)
    node = next((str(e["node_id"]) for e in entries if "node_id" in e), "?")
    series = NodeSeries(f"{data_dir.name} ({node[:8]})")
    for entry in entries:
        if entry.get("event") in ("round", "settle") and isinstance(entry.get("ts"), int | float):
            series.add(float(entry["ts"]), entry)
    for sample in _progress_lines(data_dir):
        series.add(float(sample["ts"]), sample)
    for points in series.points.values():
        points.sort()
    return series


def _progress_lines(data_dir: Path) -> Iterator[dict[str, Any]]:
    for log in sorted(data_dir.glob("*.log")):
        with log.open(errors="replace") as lines:  # a long run's log, a line at a time
            for line in lines:
                if not line.startswith("{") or '"progress"' not in line:
                    continue
                try:
                    sample = json.loads(line)
                except ValueError:
                    continue
                if sample.get("event") == "progress" and isinstance(sample.get("ts"), int | float):
                    yield sample


def plot_command(dirs: list[Path], out: Path) -> int:
    """Draws the nodes' figures into `out`; prints what it drew."""
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--out: must name a .png file, got {str(out)!r}")
    missing = [d for d in dirs if not (d / LEDGER_FILE).is_file()]
    if missing:
        raise ConfigError(f"{str(missing[0])!r} has no {LEDGER_FILE} (is it a node's --data-dir?)")
    nodes = [read_series(d) for d in dirs]
    for node in nodes:
        if node.empty:
            print(f"{node.label}: no figures in its ledger or logs (a node older than the figures?)")
    drawn = [n for n in nodes if not n.empty]
    if not drawn:
        return 1
    labels = draw(drawn, out)
    print(f"{out}: {len(labels)} node(s), {', '.join(labels)}")
    return 0


def draw(nodes: list[NodeSeries], out: Path) -> list[str]:
    from swarmnode.bench.plotting import new_figure, save_png

    figure, axes = new_figure(rows=len(PANELS), height=3.0)
    start = min(ts for n in nodes for points in n.points.values() for ts, _ in points[:1])
    for ax, (name, title) in zip(axes, PANELS, strict=True):
        for node in nodes:
            points = node.points[name]
            ax.plot([(ts - start) / 60 for ts, _ in points], [v for _, v in points], label=node.label)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[-1].set_xlabel("minutes")
    return save_png(figure, out)
