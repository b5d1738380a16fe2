"""The two-level exact average of a grouped round (the plan and its failure semantics: `grouping.py`).

One member's side: its group's butterfly, then — a leader only — the leaders' butterfly over the
group means, then the hand-off butterfly of its group, composed from `allreduce.butterfly_allreduce`.
The result is an `AllReduceResult` over the round spec's members: either the swarm's mean over the
whole of Δ, with every member of positive weight included, or nothing covered.
"""

from __future__ import annotations

import logging
import time

import torch

from swarmnode.core.diloco import AveragedDelta
from swarmnode.net import rpc
from swarmnode.swarm.averaging.allreduce import AllReduceResult, butterfly_allreduce
from swarmnode.swarm.averaging.grouping import RoundPlan
from swarmnode.swarm.averaging.reducer import AveragingServicer

logger = logging.getLogger(__name__)


def _whole(result: AllReduceResult, must: frozenset[int]) -> bool:
    """Every part averaged, each with every member of `must` in it (a client member's own part is
    empty: it reduces nothing, so only the parts that exist count)."""
    return not must or (result.averaged.coverage == 1.0 and must <= result.delivered)


def _positive(plan: RoundPlan, indices: tuple[int, ...]) -> frozenset[int]:
    """Positions (within `indices`) of the members of positive weight."""
    members = plan.spec.members
    return frozenset(i for i, k in enumerate(indices) if members[k].weight > 0)


async def two_level_allreduce(
    servicer: AveragingServicer,
    plan: RoundPlan,
    delta: torch.Tensor,
    weight: float,
    channels: rpc.ChannelCache | None = None,
) -> AllReduceResult:
    """This node's side of the round's two-level average of its flat fp32 Δ (weight: its tokens)."""
    started = time.monotonic()
    me = plan.spec.index_of(servicer.node_id)
    g = plan.group_of(me)
    group = plan.groups[g]
    inner = plan.group_spec(g)
    first = await butterfly_allreduce(servicer, inner, group.index(me), delta, weight, channels)
    sent = first.bytes_sent
    share, handoff_weight = delta, 0.0  # weight 0: only its header travels, its values are not read
    if group[0] == me:
        share, handoff_weight, top_sent = await _lead_group(servicer, plan, g, first, channels)
        sent += top_sent
    handoff = plan.handoff_spec(g)
    last = await butterfly_allreduce(servicer, handoff, group.index(me), share, handoff_weight, channels)
    sent += last.bytes_sent
    # A group of one hands nothing on: its butterfly returns the share as it is, weight or not.
    applied = _whole(last, frozenset({0})) and (len(group) > 1 or handoff_weight > 0)
    n = delta.numel()
    if applied:
        averaged = AveragedDelta(last.averaged.delta, ((0, n),), len(plan.spec.members))
        included = (_positive(plan, tuple(range(len(plan.spec.members)))),)
    else:
        averaged = AveragedDelta(last.averaged.delta, (), len(plan.spec.members))  # nothing covered
        included = (frozenset(),)
        logger.warning(
            "round %d: group %d of %d did not get the swarm's whole mean; nothing is applied here",
            *(plan.spec.round, g, len(plan.groups)),
        )
    return AllReduceResult(averaged, sent, time.monotonic() - started, included)


async def _lead_group(
    servicer: AveragingServicer,
    plan: RoundPlan,
    g: int,
    first: AllReduceResult,
    channels: rpc.ChannelCache | None,
) -> tuple[torch.Tensor, float, int]:
    """A leader's step 2: its group's mean into the leaders' butterfly (with its group's weight when
    step 1 was whole, else 0); returns what it hands on in step 3, with its weight, and bytes sent."""
    group_whole = _whole(first, _positive(plan, plan.groups[g]))
    weight = plan.group_weight(g) if group_whole else 0.0
    if not group_whole:
        logger.warning("round %d: group %d's average is not whole: no node applies it", plan.spec.round, g)
    leaders = plan.leaders()
    top = plan.leaders_spec()
    means = first.averaged.delta
    mine = leaders.index(plan.groups[g][0])
    second = await butterfly_allreduce(servicer, top, mine, means, weight, channels)
    weighty = frozenset(i for i in range(len(leaders)) if plan.group_weight(i) > 0)
    if group_whole and _whole(second, weighty):
        return second.averaged.delta, 1.0, second.bytes_sent
    logger.warning("round %d: the leaders' average is not whole: group %d applies none", plan.spec.round, g)
    return means, 0.0, second.bytes_sent  # weight 0: its values are not read
