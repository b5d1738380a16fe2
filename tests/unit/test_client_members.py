"""Client members (docs/design.md "Behind NAT") in the group spec and in matchmaking: a client reduces no
part, never leads, is never sent a proposal and fetches the frozen group from its leader instead."""

from __future__ import annotations

import asyncio

import pytest
from test_matchmaking import GLOBAL_DIGEST, RUN_DIGEST, MemoryDHT, NodeView, offers_in

from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.announcements import Announcement
from swarmnode.swarm.averaging import wire
from swarmnode.swarm.averaging.matchmaking import Matchmaker, Offer, Outcome
from swarmnode.swarm.averaging.wire import GroupSpec, Member
from swarmnode.swarm.reachability import initial_mode
from swarmnode.util.labels import Reachability

SHA = "ef" * 32


def spec_of(*reachable: bool) -> GroupSpec:
    members = tuple(
        Member(f"{k + 1:02x}" * 20, f"127.0.0.1:{5000 + k}" if up else "", reachable=up)
        for k, up in enumerate(reachable)
    )
    return GroupSpec("run", 3, "g", members, "fp32", 10.0)


def test_only_reachable_members_reduce_and_their_parts_cover_everything() -> None:
    spec = spec_of(True, False, True, False)
    n = 1001
    assert spec.reducers == (0, 2)
    assert spec.part_range(1, n) == spec.part_range(3, n) == (0, 0)
    assert spec.part_range(0, n) == (0, 500) and spec.part_range(2, n) == (500, 1001)
    everyone = spec_of(True, True, True)
    assert [everyone.part_range(k, 9) for k in range(3)] == [(0, 3), (3, 6), (6, 9)]  # as before clients


def test_a_group_of_clients_only_is_refused_and_a_client_has_no_address() -> None:
    with pytest.raises(ValueError, match="no reachable member"):
        spec_of(False, False)
    with pytest.raises(ValueError):
        Member("aa" * 20, "")  # a reachable member must have an address


def test_the_client_flag_travels_in_the_proposal_and_old_dicts_read_as_reachable() -> None:
    spec = spec_of(True, False)
    assert wire.spec_from_pb(wire.spec_to_pb(spec)) == spec
    assert wire.spec_from_pb(pb.GroupProposal.FromString(wire.spec_to_pb(spec).SerializeToString())) == spec
    assert "reachable" not in spec.to_dict()["members"][0]
    assert GroupSpec.from_json(spec.to_json()) == spec


def test_a_contribution_to_a_client_is_refused() -> None:
    spec = spec_of(True, False)
    header = wire.contribution_header(spec, 0, 1, 1.0, 10)
    assert "is not part" in (wire.header_problem(header, spec, 1) or "")


def test_a_client_offer_and_announcement_carry_no_address() -> None:
    offer = Offer("aa" * 20, "", 1.0, RUN_DIGEST, GLOBAL_DIGEST, 1.0, None, 2, reachable=False)
    assert offer.to_value()["r"] is False and offer.to_value()["addr"] == ""
    assert "r" not in Offer("aa" * 20, "h:1", 1.0, RUN_DIGEST, GLOBAL_DIGEST, 1.0, None, 2).to_value()
    client = Announcement("aa" * 20, "", SHA, 1, 1, 1, "hot", 1.0, SHA, None, reachable=False)
    assert not client.serves
    assert Announcement.from_value("aa" * 20, client.to_value()) == client
    assert Announcement.from_value("aa" * 20, {**client.to_value(), "r": True}) is None  # no address


def test_initial_mode_is_client_when_joining_and_reachable_when_starting_a_swarm() -> None:
    assert initial_mode("auto", has_peers=True) == Reachability.CLIENT
    assert initial_mode("auto", has_peers=False) == Reachability.REACHABLE
    assert initial_mode("yes", has_peers=True) == Reachability.REACHABLE
    assert initial_mode("no", has_peers=False) == Reachability.CLIENT
    with pytest.raises(ValueError):
        initial_mode("maybe", has_peers=True)


def nat_swarm(reachable: list[bool], proposed: list[str]) -> list[Matchmaker]:
    """Matchmakers on one in-memory DHT; proposals and group fetches go straight to the addressee."""
    shared = MemoryDHT()
    by_address: dict[str, Matchmaker] = {}

    async def propose(address: str, spec: GroupSpec, timeout: float) -> bool:
        proposed.append(address)
        return await by_address[address].on_proposal(spec) is not None

    async def fetch_group(address: str, run_id: str, step: int, node_id: str, timeout: float):
        spec = await by_address[address].led_group(run_id, step, timeout)
        if spec is None:
            return None
        return spec if any(m.node_id == node_id for m in spec.members) else False

    nodes = []
    for i, up in enumerate(reachable):
        node_id, address = f"{i + 1:02x}" * 20, f"127.0.0.1:{5000 + i}"
        node = Matchmaker(
            *(NodeView(shared, node_id), node_id, address, "r", RUN_DIGEST, "fp32", 1.0, 5.0, propose),
            reachable=lambda up=up: up,
            fetch_group=fetch_group,
        )
        by_address[address] = node
        nodes.append(node)
    return nodes


def test_a_client_never_leads_is_never_proposed_to_and_fetches_the_group() -> None:
    proposed: list[str] = []

    async def scenario() -> list[Outcome]:
        client, a, b = nat_swarm([False, True, True], proposed)  # the client has the lowest id
        cursor = {"shard": 0, "epoch": 0, "position": 0}

        def go(node: Matchmaker, others: list[Matchmaker]) -> asyncio.Task[Outcome]:
            peers = frozenset(n.node_id for n in others)
            return asyncio.ensure_future(node.form_group(4, 1.0, GLOBAL_DIGEST, cursor, peers))

        first = go(client, [a, b])  # and the earliest deadline: it would lead, were it reachable
        await offers_in([client], 4)
        return await asyncio.gather(first, go(a, [client, b]), go(b, [client, a]))

    outcomes = asyncio.run(scenario())
    spec = outcomes[0].group
    assert spec is not None and all(o.group == spec for o in outcomes)
    assert [m.reachable for m in spec.members] == [False, True, True]
    assert spec.members[0].address == "" and spec.reducers == (1, 2)
    assert spec.group_id.endswith(("02" * 20)[:16]) or spec.group_id.endswith(("03" * 20)[:16])
    assert "127.0.0.1:5000" not in proposed and len(proposed) == 1  # the leader proposed to the other only


def test_clients_alone_form_no_group() -> None:
    async def scenario() -> list[Outcome]:
        x, y = nat_swarm([False, False], [])
        cursor = {"shard": 0, "epoch": 0, "position": 0}
        return await asyncio.gather(
            x.form_group(1, 1.0, GLOBAL_DIGEST, cursor, frozenset({y.node_id})),
            y.form_group(1, 1.0, GLOBAL_DIGEST, cursor, frozenset({x.node_id})),
        )

    for outcome in asyncio.run(scenario()):
        assert outcome.group is None and "no reachable member" in outcome.reason
