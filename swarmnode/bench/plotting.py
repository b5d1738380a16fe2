"""matplotlib without a display (the Agg backend), and PNGs that name their series in a text chunk.

Imported only by the commands that draw (`swarmnode plot`, `swarmnode bench quality --plot`,
`swarmnode bench swarm --plot`), so nothing else pays for matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

SERIES_KEY = "swarmnode:series"
"""The PNG text chunk that lists the plotted series' labels, one per line."""


def new_figure(rows: int = 1, height: float = 4.5, cols: int = 1, width: float = 8.0) -> tuple[Any, Any]:
    """A figure `width` wide and its axes: one, or an array of `rows` stacked (`height` each) by `cols`
    side by side, all sharing x."""
    return plt.subplots(rows, cols, figsize=(width, height * rows), sharex=True)


def save_png(figure: Any, path: Path) -> list[str]:
    """Writes `figure` to `path` with its legend labels in the SERIES_KEY chunk; returns them."""
    labels = []
    for ax in figure.axes:
        for line in ax.get_lines():
            label = str(line.get_label())
            if not label.startswith("_") and label not in labels:
                labels.append(label)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110, metadata={SERIES_KEY: "\n".join(labels)})
    plt.close(figure)
    return labels
