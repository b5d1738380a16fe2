"""One outer step across the swarm: matchmaking, the butterfly all-reduce, and the coverage policy.

`SwarmRounds.average` turns this node's pseudo-gradient into what the outer step may apply:
- a group formed: the token-weighted average over the parts the all-reduce covered (a round of more
  than --group-size members averages in two levels, all or nothing: `grouping.py`); below
  --min-coverage nothing is applied (every part stays local progress, carried by the next Δ). Only the
  members whose contributions are in every covered part (`RoundResult.included`) have their cursors
  recorded in the lineage: a member left out of a part (it died, or its part came late) has batches
  that are not wholly in the model, so the lineage keeps its previous record (a dead member trains
  them again; a live one carries its Δ there, see `AveragedDelta.carried`, and delivers it next round);
- no partner in time: this node goes on alone (its own Δ), and says so;
- this node's global params disagree with the majority of the round's offers: nothing is applied and
  the node must repair itself from an up-to-date member before its next inner phase.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from swarmnode.core.diloco import AveragedDelta
from swarmnode.net.rpc import ChannelCache
from swarmnode.swarm.averaging.allreduce import butterfly_allreduce
from swarmnode.swarm.averaging.grouping import RoundPlan
from swarmnode.swarm.averaging.matchmaking import Matchmaker, Offer
from swarmnode.swarm.averaging.reducer import AveragingServicer
from swarmnode.swarm.averaging.twolevel import two_level_allreduce
from swarmnode.swarm.averaging.wire import GroupSpec
from swarmnode.util.metrics import Metrics

logger = logging.getLogger(__name__)

HOLD_ROUNDS = 3
"""Rounds a swarm member holds its outer step without a group before it goes on alone."""


@dataclass(frozen=True)
class RoundResult:
    """What one round decided, for the outer step, the snapshot metadata and the status."""

    averaged: AveragedDelta | None  # None: apply nothing this round (held, or a repair pending)
    group: tuple[str, ...] = ()  # node ids, in the group's order
    cursors: dict[str, dict[str, int]] = field(default_factory=dict)  # members' cursors after the phase
    coverage: float = 1.0
    seconds: float = 0.0
    bytes_sent: int = 0
    repair_from: tuple[Offer, ...] = ()
    note: str = ""
    weights: dict[str, float] = field(default_factory=dict)  # members' token weights
    held: bool = False  # no group: the outer step is held (not applied, round counter unchanged)
    missed: bool = False  # the group formed without this node: it is behind and should catch up
    included: tuple[str, ...] = ()  # members whose contributions are in every covered part
    groups: int = 1  # the groups the round averaged in (more than one: the two-level average)
    matchmaking_seconds: float = 0.0  # of `seconds`, what matchmaking took

    def info(self) -> dict[str, object]:
        """The round as it is kept in snapshot metadata."""
        return {
            "group": list(self.group),
            "included": list(self.included),
            "weights": self.weights,
            "coverage": self.coverage,
            "seconds": round(self.seconds, 4),
            "bytes_sent": self.bytes_sent,
            "note": self.note,
            "groups": self.groups,
            "matchmaking_seconds": round(self.matchmaking_seconds, 4),
        }


class SwarmRounds:
    """The swarm's averaging for one node: matchmaking plus butterfly all-reduce."""

    def __init__(
        self,
        matchmaker: Matchmaker,
        servicer: AveragingServicer,
        node_id: str,
        min_coverage: float,
        metrics: Metrics,
        channels: ChannelCache | None = None,
    ) -> None:
        """`channels`: the node's cached channels to its peers (None: one per call)."""
        self.matchmaker, self.servicer, self.node_id = matchmaker, servicer, node_id
        self.min_coverage, self.metrics, self.channels = min_coverage, metrics, channels
        self._held = 0

    async def average(
        self,
        delta: torch.Tensor,
        weight: float,
        outer_step: int,
        global_digest: str,
        cursor: dict[str, int],
        expected_peers: frozenset[str] | None,
        in_swarm: bool,
    ) -> RoundResult:
        """`expected_peers` None: nobody in the routing table. `in_swarm`: this node's lineage holds
        other nodes' work, so rounds without them are held rather than applied alone (see `_alone`)."""
        started = time.perf_counter()
        weight = min(weight, self.matchmaker.max_weight)  # (rounds carried into this one included)
        if expected_peers is None:
            if in_swarm:  # nobody to ask: don't race ahead of a swarm that may only be out of reach
                await asyncio.sleep(self.matchmaker.timeout_s)
            return self._alone(delta, weight, outer_step, cursor, started, "no peer known", in_swarm)
        outcome = await self.matchmaker.form_group(outer_step, weight, global_digest, cursor, expected_peers)
        matchmaking_s = time.perf_counter() - started
        self.metrics.matchmaking_seconds.observe(matchmaking_s)
        if outcome.repair_from:
            self.metrics.round_failures.labels("digest_mismatch").inc()
            logger.warning(
                "round %d: %s; skipping the outer step and repairing from a peer", outer_step, outcome.reason
            )
            return RoundResult(None, repair_from=outcome.repair_from, note=outcome.reason)
        if outcome.missed:  # the swarm is here and a step ahead: hold, catch up, never go alone
            self.metrics.round_failures.labels("no_partners").inc()
            logger.warning("round %d: %s; holding the outer step and catching up", outer_step, outcome.reason)
            return self._hold(outcome.reason, started, missed=True)
        if outcome.group is None:
            return self._alone(delta, weight, outer_step, cursor, started, outcome.reason, in_swarm)
        self._held = 0
        result = await self._allreduce(outcome.group, delta, weight, started)
        return dataclasses.replace(result, matchmaking_seconds=matchmaking_s)

    def reset_hold(self) -> None:
        """After a repair this node is with the swarm again: a later round without a group holds first."""
        self._held = 0

    def _alone(
        self,
        delta: torch.Tensor,
        weight: float,
        outer_step: int,
        cursor: dict[str, int],
        started: float,
        reason: str,
        in_swarm: bool,
    ) -> RoundResult:
        """No group this round. A member of a swarm first holds its outer step for up to HOLD_ROUNDS
        rounds — its work stays local progress, its round counter stays with the swarm's — since a
        node applying steps alone forks the swarm's model and must later repair (its work then
        trained again); after that, or in a swarm of one, it goes on alone."""
        self.metrics.round_failures.labels("no_partners").inc()
        if in_swarm and self._held < HOLD_ROUNDS:
            self._held += 1
            logger.warning(
                "round %d: %s; holding the outer step (%d of %d) until the swarm is back",
                outer_step,
                reason,
                self._held,
                HOLD_ROUNDS,
            )
            return self._hold(reason, started)
        logger.info("round %d: %s; going on alone", outer_step, reason)
        return self._solo(delta, weight, cursor, started, reason)

    def _hold(self, reason: str, started: float, missed: bool = False) -> RoundResult:
        """Nothing applied this round: the node's work stays local progress, carried by its next Δ."""
        seconds = time.perf_counter() - started
        return RoundResult(
            None, (self.node_id,), coverage=0.0, seconds=seconds, note=reason, held=True, missed=missed
        )

    def _solo(
        self, delta: torch.Tensor, weight: float, cursor: dict[str, int], started: float, note: str
    ) -> RoundResult:
        solo = AveragedDelta(delta, ((0, delta.numel()),), 1)
        seconds = time.perf_counter() - started
        return RoundResult(
            solo,
            (self.node_id,),
            {self.node_id: cursor},
            1.0,
            seconds,
            note=note,
            weights={self.node_id: weight},
            included=(self.node_id,),
        )

    async def _allreduce(
        self, spec: GroupSpec, delta: torch.Tensor, weight: float, started: float
    ) -> RoundResult:
        self.servicer.expect(spec)
        plan = RoundPlan.of(spec)
        if plan is None:
            me = spec.index_of(self.node_id)
            result = await butterfly_allreduce(self.servicer, spec, me, delta, weight, self.channels)
        else:
            result = await two_level_allreduce(self.servicer, plan, delta, weight, self.channels)
        averaged = result.averaged
        coverage = averaged.coverage
        members = tuple(m.node_id for m in spec.members)
        delivered = [m for k, m in enumerate(spec.members) if k in result.delivered]
        if plan is None:
            self._note_no_shows(spec, result.included, result.screened)
        cursors = {m.node_id: m.cursor for m in delivered if m.cursor is not None}
        self._count(result.seconds, result.bytes_sent, len(members), coverage)
        note = ""
        if coverage < self.min_coverage:
            self.metrics.round_failures.labels("low_coverage").inc()
            note = f"coverage {coverage:.2f} below --min-coverage {self.min_coverage}: outer step skipped"
            logger.warning("round %d: %s; local progress is kept for the next round", spec.round, note)
            averaged = AveragedDelta(averaged.delta, (), averaged.group_size)
            delivered, cursors = [], {}
        elif coverage < 1.0 or len(delivered) < len(members):
            self.metrics.round_failures.labels("partial").inc()
            note = (
                f"coverage {coverage:.2f}, {len(delivered)} of {len(members)} members in every part: "
                "un-averaged work stays local progress"
            )
            logger.warning("round %d: %s", spec.round, note)
        logger.info(
            "round %d: averaged with %d members in %.2f s (coverage %.2f, %.1f MB sent)",
            spec.round,
            len(members),
            result.seconds,
            coverage,
            result.bytes_sent / 1e6,
        )
        weights = {m.node_id: m.weight for m in spec.members}
        seconds = time.perf_counter() - started
        return RoundResult(
            averaged,
            members,
            cursors,
            coverage,
            seconds,
            result.bytes_sent,
            note=note,
            weights=weights,
            included=tuple(m.node_id for m in delivered),
            groups=1 if plan is None else len(plan.groups),
        )

    def _note_no_shows(
        self, spec: GroupSpec, included: tuple[frozenset[int], ...], screened: frozenset[int]
    ) -> None:
        """Members of positive weight in none of the parts this node holds, while others are, and whose
        contributions no reducer screened out: they accepted the group and delivered nothing (a member
        that broke, or one that takes the group's time on purpose)."""
        heard = frozenset().union(*included) | screened
        if len(heard - {spec.index_of(self.node_id)}) == 0:
            return  # nothing came from anyone: this node's own link, not theirs
        silent = [m.node_id for k, m in enumerate(spec.members) if k not in heard and m.weight > 0]
        delivered = [m.node_id for k, m in enumerate(spec.members) if k in heard]
        self.matchmaker.note_no_shows(silent, spec.round, delivered)

    def _count(self, seconds: float, bytes_sent: int, group_size: int, coverage: float) -> None:
        m = self.metrics
        m.allreduce_seconds.observe(seconds)
        m.allreduce_sent_bytes.inc(bytes_sent)
        m.allreduce_round_sent_bytes.set(bytes_sent)
        m.group_size.set(group_size)
        m.coverage.set(coverage)
