"""Progress for people: one compact line per interval, a live bar on a terminal, JSON for machines."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TextIO

BAR_WIDTH = 20


class Phase(StrEnum):
    """What a node is doing, as its progress line and its status say."""

    STARTING = "starting"
    WAITING_FOR_PEERS = "waiting for peers"  # --wait-peers
    RECOVERING = "recovering"  # the restore at start
    INNER = "inner"  # training the round's inner steps
    OUTER = "outer"  # matchmaking, the all-reduce and the outer step
    HOLDING = "holding"  # the last round found no group: its outer step is held until the next try
    WAITING_FOR_SWARM = "waiting for the swarm"  # it missed a round (or lost the digest vote): waits
    # for a member to announce the step the swarm took, to repair from it
    REPAIRING = "repairing"  # adopting an up-to-date member's snapshot, then training its round
    STOPPING = "stopping"


@dataclass(frozen=True)
class ProgressSample:
    round: int
    step: int
    steps_per_round: int
    loss: float | None
    heldout_loss: float | None
    tokens_per_s: float
    peers: int
    snapshot_age_s: float | None
    phase: str


class ProgressReporter:
    """Writes samples as a redrawn bar (`bar`), plain lines (`lines`) or JSON lines (`json`)."""

    def __init__(self, stream: TextIO, mode: str) -> None:
        self.stream, self.mode = stream, mode

    @classmethod
    def for_stream(cls, stream: TextIO, log_format: str) -> ProgressReporter:
        if log_format == "json":
            return cls(stream, "json")
        return cls(stream, "bar" if stream.isatty() else "lines")

    @property
    def interval_s(self) -> float | None:
        """A bar redraws every second; lines and JSON use the configured interval (None)."""
        return 1.0 if self.mode == "bar" else None

    def report(self, sample: ProgressSample) -> None:
        if self.mode == "json":
            self.stream.write(
                json.dumps({"ts": round(time.time(), 3), "event": "progress", **asdict(sample)}) + "\n"
            )
        elif self.mode == "bar":
            self.stream.write("\r\x1b[2K" + self.bar(sample))
        else:
            self.stream.write(time.strftime("%H:%M:%S ", time.gmtime()) + format_line(sample) + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()

    def bar(self, sample: ProgressSample) -> str:
        done = min(sample.step / max(sample.steps_per_round, 1), 1.0)
        filled = int(done * BAR_WIDTH)
        return f"round {sample.round} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] " + format_line(
            sample, with_round=False
        )


def format_line(sample: ProgressSample, with_round: bool = True) -> str:
    loss = "-" if sample.loss is None else f"{sample.loss:.4f}"
    heldout = "" if sample.heldout_loss is None else f" heldout {sample.heldout_loss:.4f}"
    age = "none" if sample.snapshot_age_s is None else f"{sample.snapshot_age_s:.0f}s ago"
    head = f"round {sample.round} " if with_round else ""
    return (
        f"{head}step {sample.step}/{sample.steps_per_round} loss {loss}{heldout} "
        f"tok/s {sample.tokens_per_s:.0f} peers {sample.peers} snapshot {age} [{sample.phase}]"
    )
