"""Matchmaking between real `Matchmaker`s over an in-memory DHT (one dict, the protocol's merge rule:
one entry per publisher, the higher seq wins) and direct proposals instead of gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

from swarmnode.net.dht_records import DHTEntry
from swarmnode.swarm.matchmaking import Matchmaker, Offer, Outcome, round_key
from swarmnode.swarm.wire import GroupSpec, Member

RUN_DIGEST = "ab" * 32
GLOBAL_DIGEST = "cd" * 32


class MemoryDHT:
    def __init__(self) -> None:
        self.records: dict[str, dict[str, DHTEntry]] = {}
        self.seq = itertools.count(1)


class NodeView:
    """One node's handle on the shared MemoryDHT, as `SwarmDHT` gives it."""

    def __init__(self, shared: MemoryDHT, node_id: str) -> None:
        self.shared, self.node_id = shared, node_id

    async def publish(self, key: str, value: dict, ttl_s: float) -> bool:
        await asyncio.sleep(0)
        entry = DHTEntry(self.node_id, dict(value), next(self.shared.seq), 1e12)
        self.shared.records.setdefault(key, {})[self.node_id] = entry
        return True

    async def get(self, key: str) -> dict[str, DHTEntry]:
        await asyncio.sleep(0)
        return dict(self.shared.records.get(key, {}))


async def frozen_mark(shared: MemoryDHT) -> None:
    while not any(e.value.get("fz") for entries in shared.records.values() for e in entries.values()):
        await asyncio.sleep(0.01)


async def offers_in(nodes: list[Matchmaker], step: int, timeout_s: float = 5.0) -> None:
    """Until every one of `nodes` has its offer for round `step` in their shared MemoryDHT."""

    def there() -> bool:
        entries = nodes[0].dht.shared.records.get(round_key(nodes[0].run_id), {})
        offers = [Offer.from_entry(n.node_id, entries[n.node_id]) for n in nodes if n.node_id in entries]
        return len(offers) == len(nodes) and all(o is not None and o.outer_step == step for o in offers)

    async def poll() -> None:
        while not there():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


def swarm(count: int, timeout_s: float = 1.0) -> list[Matchmaker]:
    shared = MemoryDHT()
    by_address: dict[str, Matchmaker] = {}

    async def propose(address: str, spec: GroupSpec, timeout: float) -> bool:
        return await by_address[address].on_proposal(spec) is not None

    nodes = []
    for i in range(count):
        node_id, address = f"{i + 1:02x}" * 20, f"127.0.0.1:{5000 + i}"
        node = Matchmaker(
            NodeView(shared, node_id), node_id, address, "r", RUN_DIGEST, "fp32", timeout_s, 5.0, propose
        )
        by_address[address] = node
        nodes.append(node)
    return nodes


def offer(node: Matchmaker, step: int, expected: set[Matchmaker]) -> asyncio.Task[Outcome]:
    cursor = {"shard": 0, "epoch": 0, "position": 0}
    peers = frozenset(n.node_id for n in expected)
    return asyncio.ensure_future(node.form_group(step, 1.0, GLOBAL_DIGEST, cursor, peers))


def test_nodes_that_expect_each_other_form_one_group() -> None:
    async def scenario() -> list[Outcome]:
        a, b, c = swarm(3)
        return await asyncio.gather(offer(a, 4, {b, c}), offer(b, 4, {a, c}), offer(c, 4, {a, b}))

    outcomes = asyncio.run(scenario())
    spec = outcomes[0].group
    assert spec is not None and len(spec.members) == 3 and spec.round == 4
    assert all(o.group == spec for o in outcomes)


def test_a_late_comer_learns_the_group_closed_without_it() -> None:
    """A node that offers after the leader froze its group (a repaired node joining a round in
    progress) learns so from the leader's frozen mark and reports the round missed, instead of
    waiting out the leader's deadline and going on as if the swarm were gone."""

    async def scenario() -> tuple[Outcome, Outcome, Outcome]:
        a, b, late = swarm(3, timeout_s=3.0)
        first = await asyncio.gather(offer(a, 7, {b}), offer(b, 7, {a}))
        await asyncio.wait_for(frozen_mark(a.dht.shared), 5)  # published by the leader in the background
        return (*first, await offer(late, 7, {a, b}))

    first, second, late = asyncio.run(scenario())
    assert first.group is not None and first.group == second.group and len(first.group.members) == 2
    assert late.group is None and late.missed, late
    assert "closed the group without this node" in late.reason


def test_a_lone_node_is_not_told_it_missed_a_round() -> None:
    async def scenario() -> Outcome:
        (alone,) = swarm(1, timeout_s=0.3)
        return await offer(alone, 0, set())

    outcome = asyncio.run(scenario())
    assert outcome.group is None and not outcome.missed and "no partner" in outcome.reason


def test_a_node_whose_peers_offer_for_a_later_round_knows_at_once_it_missed_its_round() -> None:
    """A repaired node that adopted a round the swarm has since closed (its peers' offers are for the
    next one) reports the round missed within a poll, rather than wait out its deadline alone and
    fall further behind: in a fast swarm that wait is several rounds."""

    async def scenario() -> tuple[Outcome, float]:
        a, b, late = swarm(3, timeout_s=30.0)
        pending = [offer(a, 6, {b, late}), offer(b, 6, {a, late})]
        await offers_in([a, b], 6)
        started = asyncio.get_running_loop().time()
        outcome = await offer(late, 5, {a, b})
        elapsed = asyncio.get_running_loop().time() - started
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return outcome, elapsed

    outcome, elapsed = asyncio.run(scenario())
    assert outcome.group is None and outcome.missed, outcome
    assert "already offer for round 6" in outcome.reason
    assert elapsed < 5.0, f"waited {elapsed:.1f} s of a 30 s deadline"


def test_one_peer_offering_for_a_later_round_does_not_end_the_others_round() -> None:
    """One peer (a node that went on alone, or a forged offer) ahead of the round is not the swarm: the
    others still form their group."""

    async def scenario() -> list[Outcome]:
        a, b, c, ahead = swarm(4, timeout_s=1.0)
        pending_ahead = offer(ahead, 9, {a, b, c})
        await offers_in([ahead], 9)
        everyone = {a, b, c, ahead}
        outcomes = await asyncio.gather(*(offer(n, 4, everyone - {n}) for n in (a, b, c)))
        await pending_ahead
        return outcomes

    outcomes = asyncio.run(scenario())
    assert not any(o.missed for o in outcomes), outcomes
    spec = outcomes[0].group
    assert spec is not None and len(spec.members) == 3 and all(o.group == spec for o in outcomes)


def test_a_leader_that_offered_and_went_silent_is_passed_over(monkeypatch) -> None:
    """The first-ranked offer's node stops right after offering (SIGSTOP, a crash): the others do not
    each go on alone with their own Δ; they pass it over at one deadline and the next in rank leads."""
    from swarmnode.swarm import matchmaking
    from swarmnode.util import clock

    monkeypatch.setattr(matchmaking, "PROPOSE_TIMEOUT_S", 0.5)

    async def scenario() -> list[Outcome]:
        silent, b, c = swarm(3, timeout_s=1.0)
        cursor = {"shard": 0, "epoch": 0, "position": 0}
        first = Offer(
            silent.node_id,
            silent.address,
            round(clock.now() + 0.5, 3),
            RUN_DIGEST,
            GLOBAL_DIGEST,
            1.0,
            cursor,
            3,
        )
        await silent.dht.publish(round_key("r"), first.to_value(), 60)  # ...and nothing more from it
        return await asyncio.gather(offer(b, 3, {silent, c}), offer(c, 3, {silent, b}))

    outcomes = asyncio.run(scenario())
    spec = outcomes[0].group
    assert spec is not None and all(o.group == spec for o in outcomes), outcomes
    assert [m.node_id for m in spec.members] == ["02" * 20, "03" * 20]  # the pair, led by the next in rank
    assert spec.group_id.endswith("02" * 8)


def test_a_leader_whose_proposal_every_member_refuses_knows_it_missed_the_round() -> None:
    """A leader that was stopped after offering (the others passed it over and went on) proposes when
    it is back: everyone refuses (they are in another round). It must catch up, not average alone in a
    group whose other members never take part (its ledger would claim their batches were left out)."""

    async def scenario() -> Outcome:
        leader, b, c = swarm(3, timeout_s=0.3)
        cursor = {"shard": 0, "epoch": 0, "position": 0}
        for other in (b, c):  # offers of the round, made by nodes that have since moved on
            late = Offer(other.node_id, other.address, 1e10, RUN_DIGEST, GLOBAL_DIGEST, 1.0, cursor, 2)
            await other.dht.publish(round_key("r"), late.to_value(), 60)
        return await offer(leader, 2, {b, c})

    outcome = asyncio.run(scenario())
    assert outcome.group is None and outcome.missed, outcome
    assert "every member refused" in outcome.reason


def proposals_under_test(count: int) -> tuple[list[Matchmaker], list[str]]:
    """`count` nodes whose refusals are recorded in the returned list."""
    nodes, refused = swarm(count, timeout_s=30.0), []
    for node in nodes:
        node.on_refused = refused.append
    return nodes, refused


async def offering(nodes: list[Matchmaker], step: int) -> list[asyncio.Task[Outcome]]:
    everyone = set(nodes)
    pending = [offer(n, step, everyone - {n}) for n in nodes]
    await offers_in(nodes, step)  # (a node reads the offers again when a proposal needs it)
    return pending


def entries_of(nodes: list[Matchmaker]) -> dict[Matchmaker, DHTEntry]:
    entries = nodes[0].dht.shared.records[round_key(nodes[0].run_id)]
    return {n: entries[n.node_id] for n in nodes}


async def cancel(pending: list[asyncio.Task[Outcome]]) -> None:
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def their_group(
    nodes: list[Matchmaker], step: int, *, extra: tuple[Member, ...] = (), timeout_s=5.0
) -> GroupSpec:
    offers = {n: Offer.from_entry(n.node_id, e) for n, e in entries_of(nodes).items()}
    members = tuple(offers[n].member() for n in nodes) + extra
    return GroupSpec("r", step, f"{step}-forged", members, "fp32", timeout_s)


def test_a_strangers_group_is_refused_and_counted() -> None:
    """Someone who never offered proposes the round's members plus itself (as a client member, so it
    reduces nothing but is averaged in): every member refuses it, whoever signed it."""
    stranger = Member("ee" * 20, "", 1e6, None, GLOBAL_DIGEST, reachable=False)

    async def scenario() -> tuple[list[GroupSpec | None], list[str]]:
        nodes, refused = proposals_under_test(3)
        pending = await offering(nodes, 4)
        spec = their_group(nodes, 4, extra=(stranger,))
        answers = [
            await n.on_proposal(spec, proposer)
            for n in nodes
            for proposer in (stranger.node_id, nodes[0].node_id)
        ]
        await cancel(pending)
        return answers, refused

    answers, refused = asyncio.run(scenario())
    assert answers == [None] * 6
    assert refused == ["not_offered"] * 6


def test_a_proposal_from_a_member_the_rule_does_not_designate_is_refused() -> None:
    """Five offerers: only the first in rank (and the next MAX_LEADER_FAILOVERS, who take over from a
    silent one) may lead; the last one's group, though every member in it offered, is refused."""

    async def scenario() -> tuple[GroupSpec | None, GroupSpec | None, list[str]]:
        nodes, refused = proposals_under_test(5)
        pending = await offering(nodes, 4)
        ranked = sorted(
            nodes, key=lambda n: (Offer.from_entry(n.node_id, entries_of(nodes)[n]).deadline, n.node_id)
        )
        spec = their_group(nodes, 4)
        by_last = await ranked[1].on_proposal(spec, ranked[-1].node_id)
        by_first = await ranked[1].on_proposal(spec, ranked[0].node_id)
        await cancel(pending)
        return by_last, by_first, refused

    by_last, by_first, refused = asyncio.run(scenario())
    assert by_last is None and refused == ["not_leader"]
    assert by_first is not None and len(by_first.members) == 5


def test_a_group_that_changes_what_a_member_offered_is_refused() -> None:
    """The leader may not raise a member's weight (or move its cursor) beyond what that member signed."""

    async def scenario() -> tuple[GroupSpec | None, list[str]]:
        nodes, refused = proposals_under_test(3)
        pending = await offering(nodes, 4)
        spec = their_group(nodes, 4)
        inflated = dataclasses.replace(spec.members[2], weight=spec.members[2].weight * 100)
        forged = dataclasses.replace(spec, members=(*spec.members[:2], inflated))
        answer = await nodes[1].on_proposal(forged, None)
        await cancel(pending)
        return answer, refused

    answer, refused = asyncio.run(scenario())
    assert answer is None and refused == ["not_offered"]


def test_a_member_runs_the_all_reduce_with_its_own_budget_whatever_the_proposal_says() -> None:
    async def scenario() -> GroupSpec | None:
        nodes, _ = proposals_under_test(3)
        pending = await offering(nodes, 4)
        accepted = await nodes[1].on_proposal(their_group(nodes, 4, timeout_s=600.0), None)
        await cancel(pending)
        return accepted

    accepted = asyncio.run(scenario())
    assert accepted is not None and accepted.timeout_s == 5.0  # the node's --allreduce-timeout
