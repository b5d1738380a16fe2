"""The butterfly all-reduce with client members (docs/design.md "Behind NAT") over real gRPC on loopback: a
client has no server at all here (nobody can dial it), sends its parts to the reducers and receives
every average, and a swarm of clients with one reachable node averages through that node alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_allreduce import assert_identical, group, random_deltas, run, start_node, weighted_average

from swarmnode.swarm.averaging import allreduce as averaging
from swarmnode.swarm.averaging.allreduce import AllReduceResult
from swarmnode.swarm.averaging.reducer import AveragingServicer
from swarmnode.swarm.averaging.wire import Member

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(("reachable", "clients"), [(2, 1), (1, 3)])
def test_client_members_average_exactly_without_being_dialled(reachable: int, clients: int) -> None:
    n, size = 100_003, reachable + clients
    deltas, weights = random_deltas(size, n), [100.0 * (i + 1) for i in range(size)]

    async def scenario() -> list[AllReduceResult]:
        servers = [await start_node(f"{i + 1:02x}") for i in range(reachable)]
        client_servicers = [AveragingServicer(f"{reachable + i + 1:02x}") for i in range(clients)]
        members = [s.member for s in servers] + [
            Member(c.node_id, "", reachable=False) for c in client_servicers
        ]
        servicers = [s.servicer for s in servers] + client_servicers
        spec = group(members)
        try:
            return list(
                await asyncio.gather(
                    *(
                        averaging.butterfly_allreduce(servicer, spec, i, deltas[i], weights[i])
                        for i, servicer in enumerate(servicers)
                    )
                )
            )
        finally:
            for s in servers:
                await s.stop()

    results = run(scenario())
    assert_identical(results)
    expected = weighted_average(deltas, weights)
    for k, result in enumerate(results):
        assert result.averaged.covered == ((0, n),) and result.averaged.coverage == 1.0
        assert result.delivered == frozenset(range(size))  # every member's work is in every part
        assert result.contributors == (size,) * reachable + (0,) * clients
        assert torch.allclose(result.averaged.delta, expected, rtol=0, atol=1e-6)
        if k >= reachable:  # a client sends its whole Δ (every part is a reducer's) and no result
            assert result.bytes_sent == pytest.approx(4 * n, abs=8)
