"""The quality bench's picture: each side's held-out loss against the tokens each worker trained.

The PNG carries its series' labels in a text chunk (`swarmnode:series`, one per line), so a script
(or a test) can tell what it shows without reading pixels.
"""

from __future__ import annotations

from pathlib import Path

from swarmnode.bench.plotting import new_figure, save_png
from swarmnode.bench.quality_sim import Comparison, Curve


def plot_comparison(comparison: Comparison, path: Path) -> list[str]:
    """Draws the three curves into `path` (PNG); returns their labels."""
    figure, ax = new_figure()
    d = comparison.diloco.job
    for curve in comparison.curves():
        ax.plot([t / 1e6 for t in curve.tokens], curve.losses, label=curve.label, marker=".", markersize=3)
    ax.set_xlabel("tokens per worker (millions)")
    ax.set_ylabel("held-out loss (nats/token)")
    title = f"{d.model}: {d.workers} workers, H={d.inner_steps}, {d.rounds} rounds, outer lr {d.outer_lr:g}"
    ax.set_title(title)
    ax.set_ylim(top=min(max(c.losses[1] for c in comparison.curves()) + 0.2, max(comparison.single.losses)))
    ax.grid(alpha=0.3)
    ax.legend()
    return save_png(figure, path)


def plot_curves(curves: list[Curve], path: Path, title: str) -> list[str]:
    """Draws any curves into `path` (PNG) from their second point on; returns their labels."""
    figure, ax = new_figure()
    for curve in curves:
        tokens = [t / 1e6 for t in curve.tokens[1:]]
        ax.plot(tokens, curve.losses[1:], label=curve.label, marker=".", markersize=3)
    ax.set_xlabel("tokens per worker (millions)")
    ax.set_ylabel("held-out loss (nats/token)")
    d = curves[0].job
    ax.set_title(f"{title}: {d.model}, {d.workers} workers, H={d.inner_steps}, {d.rounds} rounds")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_png(figure, path)
