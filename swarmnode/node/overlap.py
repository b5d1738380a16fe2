"""`--overlap on`: the outer step of round r overlaps round r+1's inner phase (docs/design.md
"Overlapped outer step"; Streaming DiLoCo, Douillard et al. 2025, §2.2).

At the end of round r's inner phase the node takes Δ_r = θ_g − θ_r as before and starts the round's
matchmaking and all-reduce on the event loop, while the training thread goes on with round r+1's
inner steps from θ_r. When the average arrives, the inner phase pauses at its next step boundary and
the outer step is applied there (`DilocoTrainer.outer_step_overlapped`):

    θ_g' = θ_g − lr·(Δ̄ + μ·m'),  m' = μ·m + Δ̄           (the same Nesterov step as blocking DiLoCo)
    θ    ← θ + (1 − α)·(θ_g' − θ_r)                        (covered ranges whose average holds our Δ_r)

so θ = α·θ_r + (1 − α)·θ_g' + δ: where the blocking step (with its merge, α = --outer-mix) would
have put θ_r, plus δ, the overlap's own inner progress, which the next round's Δ carries; then the
inner phase goes on to its H steps. Invariants:
- one round in flight at most: round r+1's Δ is taken only after round r's step was applied, so the
  members' digests agree after every outer step as in blocking mode;
- the ledger: round r's range is opened when its Δ is taken and settled when its step is applied,
  before round r+1's is opened; the overlap's batches are round r+1's (its range starts at the
  cursor where round r ended), so none is counted twice or lost;
- snapshots are taken only where no round is in flight: a hot snapshot that falls due during the
  overlap waits until the step is applied (a snapshot with a round in flight would restore θ with
  the round's work in it while the swarm's θ_g also holds it: counted twice). So a node killed
  mid-overlap restarts from a consistent point, a round behind the swarm at most, and catches up
  from a peer as any straggler does;
- SIGTERM lets the round in flight finish (within --allreduce-timeout) before the final snapshot.
A landed round that says this node is behind or astray stops the inner phase: the catch-up runs
before any further step (the overlap's steps are then trained again from the adopted state).
With --fragments the round in flight is one fragment's (core/fragments.py): its all-reduce has the
next fragment round's H/K steps to land in, and the merge above applies on that fragment's range only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from swarmnode.core.training import RoundStart
from swarmnode.node.progress import Phase
from swarmnode.node.round_loop import RoundSteps, phase_before_round
from swarmnode.swarm.averaging.rounds import RoundResult

logger = logging.getLogger(__name__)


class OverlappedRounds:
    """The round loop of a node with `--overlap on` (the blocking one is `round_loop.BlockingRounds`)."""

    def __init__(self, steps: RoundSteps) -> None:
        self.steps = steps
        self.pending: asyncio.Task[tuple[RoundStart, RoundResult]] | None = None
        self.pending_steps = 0
        """Inner steps of the round in flight: until it lands they still count in the round's steps."""
        self.last: RoundResult | None = None
        self.verdict = False
        """A landed round says this node is behind or astray: the catch-up must look before more steps."""
        self.deadline = steps.round_deadline()
        """The --inner-seconds time box of the round now training: taken once, when the round begins,
        so a round landing mid-phase does not give it a second one."""

    @property
    def in_flight(self) -> bool:
        """A round's all-reduce runs beside the inner phase."""
        return self.pending is not None

    def _wanted(self) -> int:
        """Inner steps of the round now training (the one after the round in flight), plus the steps of
        the round in flight, which still count in the trained steps until it lands."""
        steps = self.steps
        return steps.round_steps(steps.outer_step() + int(self.in_flight)) + self.pending_steps

    async def run(self) -> None:
        steps = self.steps
        try:
            while not steps.finished():
                steps.set_phase(phase_before_round(self.last))
                self.verdict = False
                if self.pending is None and await steps.catch_up(self.last):
                    await steps.rejoin(self._wanted())
                else:
                    if steps.steps_trained() < self._wanted():
                        steps.set_phase(Phase.INNER)  # (a held round's steps are done: it goes on holding)
                    await self._train()
                if steps.stop.is_set():
                    break
                if self.pending is not None:  # the inner phase ended before the average came
                    steps.set_phase(Phase.OUTER)
                    await self._land()
                    continue
                if self.verdict or steps.finished():  # it landed mid-phase: back to the catch-up first
                    continue  # (or that was the last step: no round begins after --max-outer-steps)
                start = await steps.begin_round()
                self.pending = asyncio.create_task(self._average(start), name=f"round-{start.outer_step}")
                self.pending_steps = start.steps
                self.deadline = steps.round_deadline()  # the next round trains from here
        finally:
            if self.pending is not None:
                await self._land()

    async def _average(self, start: RoundStart) -> tuple[RoundStart, RoundResult]:
        return start, await self.steps.average_round(start)

    async def _train(self) -> None:
        """The inner phase; the round in flight is applied at the step boundary after it arrives."""
        steps = self.steps
        while True:
            interrupt = threading.Event()
            if self.pending is not None:
                self.pending.add_done_callback(_setter(interrupt))
            await steps.train((steps.stop, interrupt), self.deadline, self._wanted(), self.in_flight)
            if self.pending is None or not self.pending.done() or steps.stop.is_set():
                return
            await self._land()
            if steps.finished() or self.verdict:
                return  # the catch-up decides before any further step

    async def _land(self) -> None:
        """Waits for the round in flight and applies its outer step; a failure is logged, counted and
        survived (its work stays local progress), as in blocking mode. Then the hot snapshot that fell
        due meanwhile, if one did."""
        steps, pending = self.steps, self.pending
        assert pending is not None
        self.pending, self.pending_steps = None, 0
        try:
            start, result = await pending
            self.last = await steps.finish_round(start, result, overlapped=True)
            self.verdict = self.last.missed or bool(self.last.repair_from)
        except Exception:
            await steps.round_failed()
            self.last = None
        await steps.snapshot_if_due()


def _setter(event: threading.Event) -> Callable[[object], None]:
    return lambda _: event.set()
