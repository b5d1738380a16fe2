"""The inner learning-rate schedule (no torch: the CLI's flag table reads its names).

As in DiLoCo (Douillard et al. 2023, §3) and OpenDiLoCo: a linear warm-up, then a cosine decay over the
run's planned inner steps — or, for a run of unknown length, the peak for good after the warm-up. The
schedule's position is the trainer's `schedule_step`, part of the training state (snapshots carry it
in their optimizer metadata, so restores continue it exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class LrSchedule(StrEnum):
    CONSTANT = "constant"
    """Linear warm-up, then the peak learning rate for good (a run of unknown length)."""
    COSINE = "cosine"
    """Linear warm-up, then a cosine decay to `final_fraction` of the peak at `total_steps`, held there
    after it."""


LR_SCHEDULES = tuple(LrSchedule)
DEFAULT_FINAL_FRACTION = 0.0
"""Where a cosine ends by default, as a fraction of the peak: zero, as in "Straight to Zero" (Bergsma
et al. 2025): in `swarmnode bench quality` it beat Chinchilla's and nanoGPT's 10% for every side
(docs/benchmarks.md "The cosine's floor"). A run that goes on past its cosine's end learns nothing more at
zero."""


@dataclass(frozen=True)
class InnerSchedule:
    """The inner learning rate over the lineage's inner steps, as in DiLoCo (Douillard et al. 2023,
    §3: linear warm-up, then cosine decay). Position t is the schedule step about to be taken: every
    worker of a round is at the same t, so one swarm follows one schedule."""

    kind: LrSchedule = LrSchedule.CONSTANT
    warmup_steps: int = 0
    """Inner steps of the linear warm-up from peak/warmup_steps to the peak."""
    total_steps: int | None = None
    """Inner steps over which the cosine decays (its end: the run's planned length); cosine only."""
    final_fraction: float = DEFAULT_FINAL_FRACTION
    """The learning rate at and after `total_steps`, as a fraction of the peak; cosine only."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warm-up steps must be ≥ 0, got {self.warmup_steps}")
        if not 0.0 <= self.final_fraction <= 1.0:
            raise ValueError(f"the final learning-rate fraction must be in [0, 1], got {self.final_fraction}")
        if self.kind is LrSchedule.COSINE and (self.total_steps or 0) <= self.warmup_steps:
            raise ValueError(
                f"a cosine schedule needs total steps beyond its {self.warmup_steps} warm-up steps, "
                f"got {self.total_steps}"
            )

    def factor(self, step: int) -> float:
        """The learning rate of schedule step `step` (0-based) as a fraction of the peak."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind is LrSchedule.CONSTANT:
            return 1.0
        assert self.total_steps is not None
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        floor = self.final_fraction
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def describe(self) -> dict[str, Any]:
        """The schedule as JSON (snapshot metadata, the run digest)."""
        described: dict[str, Any] = {
            "kind": str(self.kind),
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
        }
        if self.kind is LrSchedule.COSINE:  # (a constant schedule has no end to name)
            described["final_fraction"] = self.final_fraction
        return described
