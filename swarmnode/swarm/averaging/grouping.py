"""Bounded averaging groups: a round of more than --group-size members averages in two levels.

A butterfly over all N members of a round needs N² streams and waits for its slowest member. With
`--group-size G`, a leader that freezes a round of N > G members proposes one *round spec* (every
member, in a per-round order; its group id ends in `.g<G>`), and every member derives the same plan
from it (`RoundPlan`): the members cut into ⌈N/G⌉ groups of near-equal size, in order, each led by its
first member. The swarm still reaches one model, exactly (a two-level average, not Moshpit's
approximate one):

1. each group runs the butterfly over its members (`…/a<i>`): every member gets the group's
   token-weighted mean;
2. the group leaders run it over the group means (`…/top`), each weighted by its group's tokens: the
   leaders get Σ_g (W_g/W)·mean_g, the swarm's token-weighted mean of Δ;
3. each leader hands that mean to its members with one more butterfly of its group (`…/b<i>`): the
   leader contributes it with weight 1, the members with weight 0 (they send only a header), so each
   member reduces one part and passes it on, and every member of every group applies the same values
   (bf16 values travel as bf16, which keeps them exact; other wire dtypes travel as fp32 here; with a
   top-k wire, step 2 travels as fp32 too: a group's mean holds the union of its members' supports).

The digest invariant stays what it is for one group: every node that applied a round holds the same
global params after it.

Failure semantics, all or nothing per round: a leader hands the mean on (weight 1 in step 3) only when
its view of step 2 is whole — every part averaged, with every group of positive weight in it — and a
leader joins step 2 with its group's weight only when its group's step 1 was whole (every part, every
member of positive weight); otherwise it joins with weight 0, so no leader sees a whole step 2 and no
node applies anything that round (everyone keeps its Δ as local progress for the next round). A member
applies the round only if every part of step 3 reached it; a member that missed a part, or a group
whose leader lost a part of step 2, applies nothing while the rest applied the round: its digest is
then in the minority at the next matchmaking and it repairs from an up-to-date member (its batches
are in the swarm's model, as the lineage records).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from swarmnode.swarm.averaging.wire import MAX_TIMEOUT_S, GroupSpec, Member

MIN_GROUP_SIZE = 2
_GROUPED = re.compile(r"\.g([0-9]{1,3})$")


def grouped_id(base: str, group_size: int, members: int) -> str:
    """The round spec's group id: `base`, tagged with the group size when the round needs groups."""
    return f"{base}.g{group_size}" if members > group_size else base


def group_size_of(spec: GroupSpec) -> int | None:
    """The group size a round spec was cut with; None for one flat group."""
    match = _GROUPED.search(spec.group_id)
    if match is None:
        return None
    size = int(match.group(1))
    return size if MIN_GROUP_SIZE <= size < len(spec.members) else None


def group_bounds(members: int, group_size: int) -> list[int]:
    """Where a round of `members` cut into groups of at most `group_size` starts each group (and ends)."""
    count = -(-members // group_size)
    return [i * members // count for i in range(count + 1)]


def can_group(members: list[Member], group_size: int) -> bool:
    """Whether a round of `members` can be cut into groups that each have a reachable leader: a client
    member (docs/design.md "Behind NAT") reduces nothing, so a group needs at least one reachable member."""
    groups = len(group_bounds(len(members), group_size)) - 1
    return sum(m.reachable for m in members) >= groups


def round_order(members: list[Member], outer_step: int, group_size: int) -> list[Member]:
    """The members in the round's order for a grouped round: by sha256(round, node id), so groups and
    their leaders change from round to round (no node leads every round), the same on every node. The
    reachable members are dealt out first, one to each group in turn, so that every group starts with
    one (its leader) and has one to reduce; the clients fill the remaining places (`can_group`)."""

    def key(m: Member) -> bytes:
        return hashlib.sha256(f"{outer_step}:{m.node_id}".encode()).digest()

    bounds = group_bounds(len(members), group_size)
    slots: list[list[Member]] = [[] for _ in range(len(bounds) - 1)]
    reachable = sorted((m for m in members if m.reachable), key=key)
    clients = sorted((m for m in members if not m.reachable), key=key)
    rest = reachable[len(slots) :] + clients
    for g, leader in enumerate(reachable[: len(slots)]):
        slots[g].append(leader)
    g = 0
    for member in rest:  # dealt in turns over the groups that still have room
        while len(slots[g]) == bounds[g + 1] - bounds[g]:
            g = (g + 1) % len(slots)
        slots[g].append(member)
        g = (g + 1) % len(slots)
    return [m for group in slots for m in group]


@dataclass(frozen=True)
class RoundPlan:
    """The groups of one grouped round, as every member derives them from the round spec."""

    spec: GroupSpec
    groups: tuple[tuple[int, ...], ...]
    """Member indices (in the round spec) of each group, in order; a group's first is its leader."""

    @classmethod
    def of(cls, spec: GroupSpec) -> RoundPlan | None:
        """The plan of a grouped round spec; None for one flat group."""
        size = group_size_of(spec)
        if size is None:
            return None
        bounds = group_bounds(len(spec.members), size)
        return cls(spec, tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1)))

    def group_of(self, index: int) -> int:
        return next(g for g, members in enumerate(self.groups) if index in members)

    def leaders(self) -> tuple[int, ...]:
        return tuple(members[0] for members in self.groups)

    def _sub(
        self,
        suffix: str,
        indices: tuple[int, ...],
        wire_dtype: str,
        timeout_s: float,
        weights: Sequence[float] | None = None,
    ) -> GroupSpec:
        """A sub-group's spec; `weights`: the most each of its members' contributions may weigh there
        (default: what each offered for the round; a reducer refuses a heavier one)."""
        s = self.spec
        members = tuple(s.members[k] for k in indices)
        if weights is not None:
            members = tuple(dataclasses.replace(m, weight=w) for m, w in zip(members, weights, strict=True))
        return GroupSpec(s.run_id, s.round, f"{s.group_id}/{suffix}", members, wire_dtype, timeout_s)

    def group_spec(self, g: int) -> GroupSpec:
        """Step 1: group g's own butterfly."""
        return self._sub(f"a{g}", self.groups[g], self.spec.wire_dtype, self.spec.timeout_s)

    def leaders_spec(self) -> GroupSpec:
        """Step 2: the leaders' butterfly over the group means."""
        weights = [self.group_weight(g) for g in range(len(self.groups))]  # each leader brings its group's
        # A top-k group's mean holds the union of its members' supports: no longer top-k, it goes as fp32.
        dtype = "fp32" if self.spec.sparse else self.spec.wire_dtype
        return self._sub("top", self.leaders(), dtype, self.spec.timeout_s, weights)

    def handoff_spec(self, g: int) -> GroupSpec:
        """Step 3: group g's butterfly that passes the swarm's mean on. Its budget spans step 2 too,
        since a member starts it as soon as its step 1 is over."""
        dtype = "bf16" if self.spec.wire_dtype == "bf16" else "fp32"
        weights = [1.0] + [0.0] * (len(self.groups[g]) - 1)  # the leader hands the swarm's mean on
        budget = min(2 * self.spec.timeout_s, MAX_TIMEOUT_S)
        return self._sub(f"b{g}", self.groups[g], dtype, budget, weights)

    def group_weight(self, g: int) -> float:
        return sum(self.spec.members[k].weight for k in self.groups[g])

    def local_specs(self, node_id: str) -> list[GroupSpec]:
        """Every sub-group spec this node takes part in (so it can hold early calls for each)."""
        index = self.spec.index_of(node_id)
        g = self.group_of(index)
        specs = [self.group_spec(g), self.handoff_spec(g)]
        if self.groups[g][0] == index:
            specs.insert(1, self.leaders_spec())
        return specs


def sub_specs(spec: GroupSpec, node_id: str) -> list[GroupSpec]:
    """The specs this node averages in for a round spec: its sub-groups', or the spec itself."""
    plan = RoundPlan.of(spec)
    return [spec] if plan is None else plan.local_specs(node_id)
