"""Bounded groups (swarm/averaging/grouping.py): how a round of more than --group-size members is proposed and
cut into groups, and what each member averages in; plus the DHT answer that lets every node see a
round's offers when there are more than one answer holds."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_matchmaking import offer, swarm

from swarmnode.net.dht_records import dht_key, encode_value, sign_entry
from swarmnode.net.identity import Identity
from swarmnode.net.kademlia_adapter import MAX_ANSWER_ENTRY_BYTES, _sample_that_fit
from swarmnode.node.config import FLAG_BY_FIELD, parse_flag
from swarmnode.swarm.averaging.grouping import (
    RoundPlan,
    can_group,
    group_size_of,
    grouped_id,
    round_order,
    sub_specs,
)
from swarmnode.swarm.averaging.matchmaking import Outcome
from swarmnode.swarm.averaging.wire import GroupSpec, Member
from swarmnode.util.errors import ConfigError


def round_spec(count: int, group_size: int, wire_dtype: str = "bf16") -> GroupSpec:
    members = tuple(
        Member(f"{i + 1:02x}" * 20, f"127.0.0.1:{6000 + i}", 10.0 * (i + 1)) for i in range(count)
    )
    return GroupSpec("r", 3, grouped_id("3-lead", group_size, count), members, wire_dtype, 20.0)


def test_a_round_with_more_offers_than_the_group_size_is_proposed_as_groups() -> None:
    async def scenario() -> list[Outcome]:
        nodes = swarm(10, timeout_s=2.0)
        for node in nodes:
            node.group_size = 4
        everyone = set(nodes)
        return await asyncio.gather(*(offer(n, 5, everyone - {n}) for n in nodes))

    outcomes = asyncio.run(scenario())
    spec = outcomes[0].group
    assert spec is not None and all(o.group == spec for o in outcomes)
    assert spec.group_id.endswith(".g4") and len(spec.members) == 10
    plan = RoundPlan.of(spec)
    assert plan is not None and [len(g) for g in plan.groups] == [3, 3, 4]


def test_a_round_within_the_group_size_stays_one_flat_group() -> None:
    async def scenario() -> list[Outcome]:
        nodes = swarm(4, timeout_s=2.0)
        everyone = set(nodes)
        return await asyncio.gather(*(offer(n, 5, everyone - {n}) for n in nodes))

    spec = asyncio.run(scenario())[0].group
    assert spec is not None and RoundPlan.of(spec) is None
    assert [m.node_id for m in spec.members] == sorted(m.node_id for m in spec.members)


@pytest.mark.parametrize(
    ("count", "group_size", "sizes"),
    [(16, 4, [4, 4, 4, 4]), (32, 4, [4] * 8), (5, 2, [1, 2, 2]), (6, 4, [3, 3]), (17, 16, [8, 9])],
)
def test_groups_are_near_equal_and_never_over_the_group_size(
    count: int, group_size: int, sizes: list
) -> None:
    plan = RoundPlan.of(round_spec(count, group_size))
    assert plan is not None and [len(g) for g in plan.groups] == sizes
    assert sorted(k for g in plan.groups for k in g) == list(range(count))
    assert plan.leaders() == tuple(g[0] for g in plan.groups)


def test_each_member_averages_in_its_group_and_hand_off_and_a_leader_among_the_leaders() -> None:
    spec = round_spec(9, 3)
    plan = RoundPlan.of(spec)
    assert plan is not None
    leader, member = spec.members[plan.groups[1][0]], spec.members[plan.groups[1][1]]
    leader_specs = sub_specs(spec, leader.node_id)
    assert [s.group_id.rsplit("/", 1)[1] for s in leader_specs] == ["a1", "top", "b1"]
    assert [s.group_id.rsplit("/", 1)[1] for s in sub_specs(spec, member.node_id)] == ["a1", "b1"]
    top = leader_specs[1]
    assert [m.node_id for m in top.members] == [spec.members[k].node_id for k in plan.leaders()]
    assert leader_specs[2].timeout_s == 2 * spec.timeout_s  # the hand-off waits through step 2
    assert plan.group_weight(1) == sum(spec.members[k].weight for k in plan.groups[1])


@pytest.mark.parametrize(("wire_dtype", "handoff"), [("bf16", "bf16"), ("int8", "fp32"), ("fp32", "fp32")])
def test_the_hand_off_travels_in_a_dtype_that_keeps_the_mean_exact(wire_dtype: str, handoff: str) -> None:
    plan = RoundPlan.of(round_spec(6, 2, wire_dtype))
    assert plan is not None and plan.handoff_spec(0).wire_dtype == handoff
    assert plan.group_spec(0).wire_dtype == plan.leaders_spec().wire_dtype == wire_dtype


def test_a_size_tag_that_does_not_cut_the_round_means_one_flat_group() -> None:
    flat = round_spec(4, 4)
    assert group_size_of(flat) is None and sub_specs(flat, flat.members[0].node_id) == [flat]
    for tag in (".g1", ".g4", ".g9", ".gx"):  # too small, not fewer than the members, not a number
        spec = GroupSpec("r", 3, f"3-lead{tag}", flat.members, "bf16", 20.0)
        assert RoundPlan.of(spec) is None, tag


def test_the_round_order_is_the_same_everywhere_and_changes_from_round_to_round() -> None:
    members = list(round_spec(12, 4).members)
    assert round_order(members, 7, 4) == round_order(list(reversed(members)), 7, 4)
    assert round_order(members, 7, 4) != round_order(members, 8, 4)


def test_every_group_of_a_round_with_client_members_is_led_by_a_reachable_member() -> None:
    members = [
        dataclasses.replace(m, reachable=i in (2, 9, 11)) for i, m in enumerate(round_spec(12, 4).members)
    ]
    assert can_group(members, 4) and not can_group(members, 3)  # 3 groups of 4, or 4 groups of 3
    ordered = round_order(members, 7, 4)
    assert sorted(m.node_id for m in ordered) == sorted(m.node_id for m in members)
    spec = GroupSpec("r", 7, grouped_id("7-lead", 4, 12), tuple(ordered), "bf16", 20.0)
    plan = RoundPlan.of(spec)
    assert plan is not None and len(plan.groups) == 3
    for group in plan.groups:
        assert spec.members[group[0]].reachable, [spec.members[k].reachable for k in group]


def test_group_size_flag_takes_2_to_256() -> None:
    flag = FLAG_BY_FIELD["group_size"]
    assert parse_flag(flag, "8", "--group-size") == 8
    for bad in ("1", "257", "x"):
        with pytest.raises(ConfigError, match="--group-size"):
            parse_flag(flag, bad, "--group-size")


def test_answers_of_a_key_with_more_entries_than_fit_together_cover_all_of_them() -> None:
    """The round's leader offered first: with freshest-first answers its offer, among 40, would reach
    no reader that does not hold the key; k random samples cover every entry."""
    dkey = dht_key("swarmnode/r/round")
    value = encode_value({"addr": "127.0.0.1:5000", "g": "cd" * 32, "run": "ab" * 32, "w": 1.0, "o": 3})
    entries = [sign_entry(Identity.generate(), dkey, value, 1, 1e9 + i) for i in range(40)]
    answers = [_sample_that_fit(entries, MAX_ANSWER_ENTRY_BYTES) for _ in range(20)]
    assert all(len(a) < len(entries) for a in answers)
    seen = {blob for answer in answers for blob in answer}
    assert len(seen) == len(entries)
    few = entries[:3]  # all fit: every entry, freshest first, as before
    assert _sample_that_fit(few, MAX_ANSWER_ENTRY_BYTES) == _sample_that_fit(
        few[::-1], MAX_ANSWER_ENTRY_BYTES
    )


def test_a_long_all_reduce_budget_still_gives_a_valid_hand_off() -> None:
    spec = round_spec(6, 2)
    long = GroupSpec(spec.run_id, spec.round, spec.group_id, spec.members, "bf16", 400.0)
    plan = RoundPlan.of(long)
    assert plan is not None and plan.handoff_spec(0).timeout_s == 600.0  # capped at the wire's bound
    assert sub_specs(long, long.members[0].node_id)
