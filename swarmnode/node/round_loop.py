"""The round loop: what a node does round after round, blocking (`BlockingRounds`) or with the outer
step overlapping the next inner phase (`overlap.OverlappedRounds`, --overlap on).

Both drive the node through one interface, `RoundSteps` (the daemon's `Node` implements it): catch up
with the swarm, train an inner phase, begin a round (Δ and its ledger range), average it, finish it
(apply the outer step, settle the ledger). A loop owns the rounds' order and the round in flight; the
node owns what each step does. One round's outcome (`RoundResult`) is what the next catch-up decides on.
"""

from __future__ import annotations

import threading
from typing import Protocol

from swarmnode.core.training import RoundStart
from swarmnode.node.progress import Phase
from swarmnode.swarm.averaging.rounds import RoundResult
from swarmnode.util.errors import RankFailed


class RoundSteps(Protocol):
    """The steps of a round, as a round loop calls them (all on the event loop)."""

    stop: threading.Event
    """Set when the node must stop: the inner phase ends after its current step."""

    def finished(self) -> bool:
        """Stopped, or past --max-outer-steps."""
        ...

    def set_phase(self, phase: Phase) -> None: ...

    def round_deadline(self) -> float | None:
        """The --inner-seconds time box of a round's inner phase starting now."""
        ...

    def round_steps(self, outer_step: int) -> int:
        """Inner steps of round `outer_step` (--fragments: they vary by round)."""
        ...

    def outer_step(self) -> int:
        """The outer step the node's global params are at."""
        ...

    def steps_trained(self) -> int:
        """Inner steps trained since the last round began (`TrainingSample.round_step`)."""
        ...

    async def catch_up(self, last: RoundResult | None) -> bool:
        """Repair from an up-to-date member when the last round says so; True when it did."""
        ...

    async def rejoin(self, max_steps: int) -> None:
        """After a repair: train the adopted round until its members offer for it."""
        ...

    async def train(
        self, stops: tuple[threading.Event, ...], deadline: float | None, max_steps: int, in_flight: bool
    ) -> None:
        """An inner phase until the round has `max_steps` steps or a stop is set; `in_flight`: a
        round's all-reduce runs meanwhile (no snapshot is taken until it lands)."""
        ...

    async def begin_round(self) -> RoundStart: ...

    async def average_round(self, start: RoundStart) -> RoundResult: ...

    async def finish_round(self, start: RoundStart, result: RoundResult, overlapped: bool) -> RoundResult: ...

    async def round_failed(self) -> None:
        """In a round's exception handler: logged, counted, its ledger range settled as held."""
        ...

    async def snapshot_if_due(self) -> None:
        """The hot snapshot that fell due while a round was in flight, now that it landed."""
        ...


def phase_before_round(last_round: RoundResult | None) -> Phase:
    """What a node does from the end of one round to its next inner phase: after a missed round (or a
    lost digest vote) the catch-up waits for the swarm's next step; after a round without a group it
    holds its outer step until the next try; otherwise it trains."""
    if last_round is not None and (last_round.missed or last_round.repair_from):
        return Phase.WAITING_FOR_SWARM
    if last_round is not None and last_round.held:
        return Phase.HOLDING
    return Phase.INNER


class BlockingRounds:
    """Inner phase, then the round's outer step, then the next inner phase (DiLoCo as published)."""

    in_flight = False
    """Never a round in flight beside an inner phase."""

    def __init__(self, steps: RoundSteps) -> None:
        self.steps = steps

    async def run(self) -> None:
        steps, last = self.steps, None
        while not steps.finished():
            steps.set_phase(phase_before_round(last))
            wanted = steps.round_steps(steps.outer_step())
            if await steps.catch_up(last):
                await steps.rejoin(steps.round_steps(steps.outer_step()))
            else:
                if steps.steps_trained() < wanted:
                    steps.set_phase(Phase.INNER)  # (a held round's steps are done: it goes on holding)
                await steps.train((steps.stop,), steps.round_deadline(), wanted, in_flight=False)
            if steps.stop.is_set():
                break
            steps.set_phase(Phase.OUTER)
            last = await self._outer_step_or_failure()

    async def _outer_step_or_failure(self) -> RoundResult | None:
        """The round's outer step; a round must never take the daemon down: a failure is logged with its
        traceback, counted, and its work stays local progress (None: nothing to decide on next). A
        rank of this node that broke (`RankFailed`) is not a round's failure: it ends the node."""
        steps = self.steps
        try:
            start = await steps.begin_round()
            result = await steps.average_round(start)
            return await steps.finish_round(start, result, overlapped=False)
        except RankFailed:
            raise
        except Exception:
            await steps.round_failed()
            return None
