"""Matchmaking between real `Matchmaker`s over an in-memory DHT (one dict, the protocol's merge rule:
one entry per publisher, the higher seq wins) and direct proposals instead of gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time

from swarmnode.net.dht_records import DHTEntry
from swarmnode.swarm.averaging.matchmaking import (
    MAX_NO_SHOW_ROUNDS,
    PROPOSE_TIMEOUT_S,
    Matchmaker,
    Offer,
    Outcome,
    round_key,
)
from swarmnode.swarm.averaging.reducer import SILENT_GRACE_MIN_S, silent_grace
from swarmnode.swarm.averaging.wire import GroupSpec, Member

RUN_DIGEST = "ab" * 32
GLOBAL_DIGEST = "cd" * 32


class MemoryDHT:
    def __init__(self) -> None:
        self.records: dict[str, dict[str, DHTEntry]] = {}
        self.seq = itertools.count(1)
        self.issued: set[bytes] = set()  # every entry a publisher "signed" (stands in for signatures)
        self.reads_stalled = False  # look-ups take longer than a proposal may wait


class NodeView:
    """One node's handle on the shared MemoryDHT, as `SwarmDHT` gives it."""

    def __init__(self, shared: MemoryDHT, node_id: str) -> None:
        self.shared, self.node_id = shared, node_id

    async def publish(self, key: str, value: dict, ttl_s: float) -> bool:
        await asyncio.sleep(0)
        seq = next(self.shared.seq)
        signed = json.dumps([key, self.node_id, value, seq]).encode()
        self.shared.issued.add(signed)
        entry = DHTEntry(self.node_id, dict(value), seq, 1e12, signed)
        self.shared.records.setdefault(key, {})[self.node_id] = entry
        return True

    def verify(self, key: str, signed: bytes) -> DHTEntry | None:
        """Only what a publisher issued under `key` verifies, as with real signatures."""
        if signed not in self.shared.issued:
            return None
        signed_key, node_id, value, seq = json.loads(signed)
        return DHTEntry(node_id, value, seq, 1e12, signed) if signed_key == key else None

    async def get(self, key: str) -> dict[str, DHTEntry]:
        await asyncio.sleep(0)
        while self.shared.reads_stalled:
            await asyncio.sleep(0.05)
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
    from swarmnode.swarm.averaging import matchmaking
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


def test_an_offer_over_the_runs_weight_cap_is_left_out_of_the_group_and_counted_once() -> None:
    """A member declaring 1e6 tokens where the run allows 2,560 a round is grouped with nobody; an
    honest node that carried rounds into this one offers the cap, not more."""

    async def scenario() -> tuple[list[Outcome], list[str]]:
        nodes, refused = proposals_under_test(3)
        for node in nodes:
            node.timeout_s, node.max_weight = 1.0, 2560.0
        honest, other, heavy = nodes
        heavy.max_weight = 1e9  # (an attacker runs no cap of its own)
        cursor = {"shard": 0, "epoch": 0, "position": 0}
        everyone = frozenset(n.node_id for n in nodes)
        outcomes = await asyncio.gather(
            honest.form_group(4, 3 * 2560.0, GLOBAL_DIGEST, cursor, everyone - {honest.node_id}),
            other.form_group(4, 2560.0, GLOBAL_DIGEST, cursor, everyone - {other.node_id}),
            heavy.form_group(4, 1e6, GLOBAL_DIGEST, cursor, everyone - {heavy.node_id}),
        )
        return list(outcomes), refused

    (honest, other, heavy), refused = asyncio.run(scenario())
    assert honest.group is not None and honest.group == other.group
    assert [m.node_id for m in honest.group.members] == ["01" * 20, "02" * 20]
    assert all(m.weight == 2560.0 for m in honest.group.members)
    assert refused.count("over_weight") == 2  # each honest node counted it once, however often it read


def test_a_refused_offer_counts_as_offered_so_nobody_waits_out_the_deadline_for_it() -> None:
    """Before: an over-weight offer was invisible, so the honest nodes, who expect its node, waited the
    whole --matchmaking-timeout every round for an offer they had already seen and refused."""

    async def scenario() -> tuple[Outcome, Outcome]:
        nodes, _ = proposals_under_test(3)
        for node in nodes:
            node.timeout_s, node.max_weight = 60.0, 2560.0
        honest, other, heavy = nodes
        heavy.max_weight = 1e9
        cursor = {"shard": 0, "epoch": 0, "position": 0}
        everyone = frozenset(n.node_id for n in nodes)
        heavy_task = asyncio.ensure_future(
            heavy.form_group(4, 1e6, GLOBAL_DIGEST, cursor, everyone - {heavy.node_id})
        )
        outcomes = await asyncio.wait_for(  # well inside the 60 s deadline
            asyncio.gather(
                honest.form_group(4, 2560.0, GLOBAL_DIGEST, cursor, everyone - {honest.node_id}),
                other.form_group(4, 2560.0, GLOBAL_DIGEST, cursor, everyone - {other.node_id}),
            ),
            20.0,
        )
        await cancel([heavy_task])
        # The next round, the heavy node is slow to offer at all (out of every group, it runs alone):
        # the others, who refused it last round, do not wait for it.
        later = await asyncio.wait_for(
            asyncio.gather(
                honest.form_group(5, 2560.0, GLOBAL_DIGEST, cursor, everyone - {honest.node_id}),
                other.form_group(5, 2560.0, GLOBAL_DIGEST, cursor, everyone - {other.node_id}),
            ),
            20.0,
        )
        return outcomes[0], later[0]

    outcome, later = asyncio.run(scenario())
    assert outcome.group is not None and len(outcome.group.members) == 2
    assert later.group is not None and len(later.group.members) == 2


def test_a_member_checks_a_proposal_by_the_signed_offers_it_carries_without_a_look_up() -> None:
    """A member that has not read the leader's offer yet, while look-ups stall (a table of departed
    contacts), accepts the leader's group from the offers the proposal carries, in well under the
    leader's proposal deadline; a carried offer its publisher never signed is of no use, and the member
    refuses once its bounded look-up gives up."""

    async def scenario() -> tuple[GroupSpec | None, GroupSpec | None, float, list[str]]:
        nodes, refused = proposals_under_test(3)
        pending = await offering(nodes, 4)
        entries = entries_of(nodes)
        leader = min(nodes, key=lambda n: (Offer.from_entry(n.node_id, entries[n]).deadline, n.node_id))
        member = next(n for n in nodes if n is not leader)
        member._round_offers.pop(leader.node_id, None)  # noqa: SLF001 (it has not read it yet)
        nodes[0].dht.shared.reads_stalled = True
        carried = tuple(e.signed for e in entries.values())
        unsigned = tuple(e.signed.replace(b"[", b"[ ", 1) for e in entries.values())
        forged = dataclasses.replace(their_group(nodes, 4), offers=unsigned)
        started = time.monotonic()
        refused_answer = await member.on_proposal(forged, leader.node_id)
        accepted = await member.on_proposal(dataclasses.replace(forged, offers=carried), leader.node_id)
        took_s = time.monotonic() - started
        nodes[0].dht.shared.reads_stalled = False
        await cancel(pending)
        return refused_answer, accepted, took_s, refused

    refused_answer, accepted, took_s, refused = asyncio.run(scenario())
    assert refused_answer is None and refused == ["not_offered"]
    assert accepted is not None and len(accepted.members) == 3
    assert took_s < PROPOSE_TIMEOUT_S  # the refusal's bounded look-up included


def test_a_member_that_delivered_nothing_sits_out_the_groups_its_leader_forms_for_a_while() -> None:
    """A leader that noted a member of its round-4 group as delivering nothing leaves it out of the
    groups it leads in rounds 5 and 6 (counted), and takes it again in round 7."""

    async def round_of(nodes: list[Matchmaker], step: int) -> list[Outcome]:
        everyone = set(nodes)
        return list(await asyncio.gather(*(offer(n, step, everyone - {n}) for n in nodes)))

    async def scenario() -> tuple[dict[int, tuple[str, ...]], list[str], str]:
        nodes = swarm(3)
        refused: list[str] = []
        for node in nodes:
            node.on_refused = refused.append
        first = (await round_of(nodes, 4))[0].group
        assert first is not None
        leader = next(n for n in nodes if first.group_id.endswith(n.node_id[:16]))
        silent = next(n for n in nodes if n is not leader)
        leader.note_no_shows([silent.node_id], 4)
        groups = {}
        for step in (5, 6, 7):
            outcomes = await round_of(nodes, step)
            spec = outcomes[nodes.index(leader)].group
            assert spec is not None
            groups[step] = tuple(sorted(m.node_id for m in spec.members))
        return groups, refused, silent.node_id

    groups, refused, silent = asyncio.run(scenario())
    assert silent not in groups[5] and silent not in groups[6] and len(groups[5]) == 2
    assert silent in groups[7] and len(groups[7]) == 3
    assert refused == ["no_show"]


def test_a_no_show_is_not_waited_for_until_it_delivers_again() -> None:
    """Left out in rounds 5 and 6 for delivering nothing in round 4, the member is taken again when it
    offers in time, but rounds 7 and 8, in which it lags, do not wait the matchmaking timeout for its
    offer (a no-show that stays behind would cost every round that much); once it delivered in a group
    (noted in round 8), round 9 waits for it again."""

    async def scenario() -> tuple[dict[int, float], dict[int, int]]:
        a, b, silent = swarm(3, timeout_s=30.0)
        for node in (a, b):
            node.note_no_shows([silent.node_id], 4)
        took, sizes = {}, {}
        for step in (7, 8):
            started = time.monotonic()
            outcomes = await asyncio.gather(offer(a, step, {b, silent}), offer(b, step, {a, silent}))
            took[step] = time.monotonic() - started
            sizes[step] = len(outcomes[0].group.members) if outcomes[0].group else 1
        for node in (a, b):
            node.note_no_shows([], 8, delivered=[silent.node_id])
        waiting = offer(a, 9, {b, silent}), offer(b, 9, {a, silent})
        done, _ = await asyncio.wait(waiting, timeout=2.0)
        sizes[9] = len(done)  # nothing decided yet: they wait for the member that offered nothing
        await cancel(list(waiting))
        return took, sizes

    took, sizes = asyncio.run(scenario())
    assert sizes == {7: 2, 8: 2, 9: 0}
    assert all(seconds < 10.0 for seconds in took.values()), took  # not the 30 s matchmaking timeout


def test_a_reducer_waits_for_a_silent_member_longer_than_members_can_begin_apart() -> None:
    """The leader begins its all-reduce once every member answered its proposal (up to
    PROPOSE_TIMEOUT_S after the first follower began): a reducer's grace for a member that has not
    called yet must outlast that, or an honest leader would be cut off as a no-show."""
    assert SILENT_GRACE_MIN_S > PROPOSE_TIMEOUT_S
    assert silent_grace(0.0) == SILENT_GRACE_MIN_S and silent_grace(60.0) == 60.0


def test_a_member_that_keeps_delivering_nothing_is_left_out_longer_each_time() -> None:
    """Two rounds for a link that broke once; a member that does it again within as many rounds of
    coming back is left out twice as long, up to MAX_NO_SHOW_ROUNDS; a lapse long after starts over."""
    node, silent = swarm(2)[0], "ab" * 20
    refused: list[str] = []
    node.on_refused = refused.append
    spans = []
    for step in (4, 7, 12, 21, 38, 71, 136, 201, 500):
        node.note_no_shows([silent], step)
        spans.append(node.left_out_until(silent) - step)
    assert spans == [2, 4, 8, 16, 32, 64, MAX_NO_SHOW_ROUNDS, MAX_NO_SHOW_ROUNDS, 2]
    assert refused == ["no_show"] * 9


def test_a_member_left_out_for_delivering_nothing_does_not_lead_either() -> None:
    """Were the no-show first in rank, the others would follow it into another empty round: they pass
    it over as a leader and refuse its proposal (`no_show`), and a group without it from the next in
    rank is taken."""

    async def scenario() -> tuple[GroupSpec | None, GroupSpec | None, list[str]]:
        nodes, refused = proposals_under_test(3)
        pending = await offering(nodes, 4)
        entries = entries_of(nodes)
        ranked = sorted(nodes, key=lambda n: (Offer.from_entry(n.node_id, entries[n]).deadline, n.node_id))
        silent, next_in_rank, other = ranked
        other.note_no_shows([silent.node_id], 3)
        refused.clear()
        by_silent = await other.on_proposal(their_group(nodes, 4), silent.node_id)
        without = their_group([next_in_rank, other], 4)
        by_next = await other.on_proposal(without, next_in_rank.node_id)
        await cancel(pending)
        return by_silent, by_next, refused

    by_silent, by_next, refused = asyncio.run(scenario())
    assert by_silent is None and refused == ["no_show"]
    assert by_next is not None and len(by_next.members) == 2
