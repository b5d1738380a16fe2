"""The two-level average of a grouped round (swarmnode.swarm.averaging.twolevel) over real gRPC servers on
loopback: every member of every group applies the same values, the token-weighted mean of everyone's
Δ, or — when a group's own average is not whole — nobody applies anything."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from test_allreduce import Node, assert_identical, random_deltas, run, swarm, weighted_average

from swarmnode.swarm.averaging.allreduce import AllReduceResult
from swarmnode.swarm.averaging.grouping import RoundPlan, grouped_id
from swarmnode.swarm.averaging.twolevel import two_level_allreduce
from swarmnode.swarm.averaging.wire import GroupSpec, Member

pytestmark = pytest.mark.timeout(90)


def round_spec(
    nodes: Sequence[Node], weights: Sequence[float], group_size: int, wire_dtype: str, timeout_s: float = 10.0
) -> GroupSpec:
    members = tuple(Member(n.servicer.node_id, n.address, w) for n, w in zip(nodes, weights, strict=True))
    group_id = grouped_id("7-leader", group_size, len(members))
    return GroupSpec("run", 7, group_id, members, wire_dtype, timeout_s)


async def grouped_allreduce(
    nodes: Sequence[Node], spec: GroupSpec, deltas: Sequence[torch.Tensor], absent: Sequence[int] = ()
) -> list[AllReduceResult]:
    plan = RoundPlan.of(spec)
    assert plan is not None
    for node in nodes:  # as an accepted proposal does
        assert node.servicer.expect(spec)
    return list(
        await asyncio.gather(
            *(
                two_level_allreduce(node.servicer, plan, delta, spec.members[i].weight)
                for i, (node, delta) in enumerate(zip(nodes, deltas, strict=True))
                if i not in absent
            )
        )
    )


@pytest.mark.parametrize(("size", "group_size"), [(7, 3), (5, 2), (6, 4)])
def test_two_level_fp32_average_is_the_weighted_mean_of_all_on_every_member(
    size: int, group_size: int
) -> None:
    n = 100_003
    deltas, weights = random_deltas(size, n, seed=size), [500.0 * (i + 1) for i in range(size)]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(size) as nodes:
            return await grouped_allreduce(nodes, round_spec(nodes, weights, group_size, "fp32"), deltas)

    results = run(scenario())
    assert_identical(results)
    expected = weighted_average(deltas, weights)
    for result in results:
        assert result.averaged.covered == ((0, n),) and result.averaged.group_size == size
        assert result.delivered == frozenset(range(size))
        assert torch.allclose(result.averaged.delta, expected, rtol=0, atol=1e-5)


def test_two_level_bf16_average_is_bit_identical_across_groups_and_near_the_mean() -> None:
    size, n = 7, 50_001
    deltas, weights = random_deltas(size, n, seed=3), [1000.0] * size

    async def scenario() -> list[AllReduceResult]:
        async with swarm(size) as nodes:
            return await grouped_allreduce(nodes, round_spec(nodes, weights, 3, "bf16"), deltas)

    results = run(scenario())
    assert_identical(results)
    expected = weighted_average(deltas, weights)
    assert torch.allclose(results[0].averaged.delta, expected, rtol=0.02, atol=0.01)


def test_a_member_of_weight_zero_is_no_contributor_and_the_rest_still_apply() -> None:
    size, n = 6, 20_000
    deltas, weights = random_deltas(size, n, seed=4), [100.0, 0.0, 300.0, 100.0, 200.0, 50.0]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(size) as nodes:
            return await grouped_allreduce(nodes, round_spec(nodes, weights, 2, "fp32"), deltas)

    results = run(scenario())
    assert_identical(results)
    assert results[0].delivered == frozenset({0, 2, 3, 4, 5})
    kept = [k for k in range(size) if weights[k]]
    expected = weighted_average([deltas[k] for k in kept], [weights[k] for k in kept])
    assert torch.allclose(results[0].averaged.delta, expected, rtol=0, atol=1e-5)


def test_a_group_whose_member_never_comes_makes_nobody_apply_the_round() -> None:
    size, n = 6, 20_000
    deltas, weights = random_deltas(size, n, seed=5), [100.0] * size

    async def scenario() -> list[AllReduceResult]:
        async with swarm(size) as nodes:
            spec = round_spec(nodes, weights, 3, "fp32", timeout_s=1.5)
            return await grouped_allreduce(nodes, spec, deltas, absent=[4])

    results = run(scenario())
    assert len(results) == size - 1
    for result in results:
        assert result.averaged.covered == () and result.delivered == frozenset()


def test_a_grouped_topk_round_gives_every_member_the_weighted_mean_of_the_compressed_deltas() -> None:
    """The first level relays top-k contributions within each group; the leaders' level and the
    hand-off carry the group means as fp32 (they are no longer top-k): the swarm's exact mean."""
    from swarmnode.core import sparse

    size, n = 5, 60_000
    deltas = [sparse.compress(d, 41) for d in random_deltas(size, n, seed=9)]
    weights = [100.0 * (i + 1) for i in range(size)]

    async def scenario() -> list[AllReduceResult]:
        async with swarm(size) as nodes:
            spec = round_spec(nodes, weights, 2, sparse.wire_name(41))
            return await grouped_allreduce(nodes, spec, deltas)

    results = run(scenario())
    assert_identical(results)
    assert results[0].averaged.coverage == 1.0
    assert torch.allclose(results[0].averaged.delta, weighted_average(deltas, weights), atol=1e-6)
