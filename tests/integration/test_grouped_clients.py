"""A grouped round with client members (docs/design.md "Behind NAT"): the clients' own parts are empty, and
the round is still whole and applied by everyone (two_level_allreduce over real gRPC servers)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_allreduce import random_deltas, run, swarm, weighted_average

from swarmnode.swarm.averaging.grouping import RoundPlan, grouped_id, round_order
from swarmnode.swarm.averaging.twolevel import two_level_allreduce
from swarmnode.swarm.averaging.wire import GroupSpec, Member

pytestmark = pytest.mark.timeout(90)


def test_a_grouped_round_with_a_client_member_is_applied_by_every_member() -> None:
    size, n, group_size = 4, 1_000, 2
    deltas, weights = random_deltas(size, n, seed=4), [100.0 * (i + 1) for i in range(size)]

    async def scenario() -> tuple[list[Member], list]:
        async with swarm(size) as nodes:
            members = [
                Member(node.servicer.node_id, node.address, w, reachable=i != 3)
                for i, (node, w) in enumerate(zip(nodes, weights, strict=True))
            ]
            ordered = round_order(members, 7, group_size)
            spec = GroupSpec("run", 7, grouped_id("7-leader", group_size, size), tuple(ordered), "fp32", 10.0)
            plan = RoundPlan.of(spec)
            assert plan is not None and len(plan.groups) == 2
            by_id = {node.servicer.node_id: (node, deltas[i], weights[i]) for i, node in enumerate(nodes)}
            for node in nodes:
                assert node.servicer.expect(spec)
            results = await asyncio.gather(
                *(
                    two_level_allreduce(by_id[m.node_id][0].servicer, plan, by_id[m.node_id][1], m.weight)
                    for m in ordered
                )
            )
            return ordered, list(results)

    ordered, results = run(scenario())
    expected = weighted_average(deltas, weights)
    assert sum(not m.reachable for m in ordered) == 1
    for result in results:
        assert result.averaged.covered == ((0, n),), "a group holding a client must still be whole"
        assert result.delivered == frozenset(range(size))
        assert torch.allclose(result.averaged.delta, expected, rtol=0, atol=1e-5)
