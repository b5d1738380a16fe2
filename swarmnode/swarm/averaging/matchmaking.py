"""Forming a round's averaging group through the DHT (docs/design.md "The swarm", Matchmaking).

A node that finished its inner phase publishes an offer for round r under `swarmnode/<run>/round`: its
address, a deadline (now + --matchmaking-timeout), its run digest, the digest of its global params as of the
round's start, its token weight and its data cursor. It then reads the key until its deadline. The leader —
earliest deadline, then lowest node id, among the offers a node sees with its own run digest — freezes the
group at its deadline (or as soon as every node it expects has offered) and proposes it to every member over
gRPC, so all members agree on the group and its order. A member accepts the first proposal for the round
that includes it and that the round's signed offers bear out (`_proposal_refusal`): its signer is the leader
matchmaking's rule designates among them (or one of the next MAX_LEADER_FAILOVERS in rank, see below), and
each member it names published an offer for the round saying just what the group says of it. The leader
sends those offers with its proposal as their publishers signed them (`GroupSpec.offers`), so a member
checks the group without a DHT look-up of its own (look-ups may take seconds when the table holds departed
contacts); it reads the DHT only for an offer neither it nor the proposal has, within
PROPOSAL_READ_BUDGET_S. Anything else — a stranger's group, one that adds a member who never offered, or
changes a member's weight — is refused and counted. The all-reduce budget a member runs with is its own
--allreduce-timeout, whatever the proposal says. A leader that sends no proposal by its deadline plus a
grace period (stopped, crashed or cut off after it offered) is passed over: the next reachable offer in rank
leads the others, who all reach that conclusion at the same deadline (up to MAX_LEADER_FAILOVERS times a
round). A node that still gets no proposal goes on alone for that round, and says so. A round of more offers
than the leader's --group-size is proposed as one round spec that every member cuts into the same groups
(`grouping.py`).

Clients (docs/design.md "Behind NAT"): a node that peers cannot dial offers with `reachable` false and no
address. It is a member like any other (the leader waits for its offer in the DHT as for anyone's),
but it never leads (the leader is the first-ranked *reachable* offer), it is never sent a proposal
(it asks the leader for the frozen group, `AwaitGroup`), and it reduces no part (`GroupSpec`).

Digests: the leader groups only the offers whose global digest is the one most offers hold (on a tie,
the earliest-ranked side's). A node on the other side knows its global params went astray: it leaves
the round and repairs itself from an agreeing member's snapshot before its next inner phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from swarmnode.net.dht import DHTEntry
from swarmnode.net.dht_records import decode_typed_value
from swarmnode.swarm.averaging import grouping
from swarmnode.swarm.averaging.wire import MAX_WEIGHT, GroupSpec, Member
from swarmnode.util import clock, faults
from swarmnode.util.labels import AveragingReject
from swarmnode.util.validate import is_sha256_hex

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
FOLLOWER_POLL_S = 1.0
"""A node that has seen an offer ranked before its own looks the round up this often (`_poll_interval`)."""
PROPOSE_TIMEOUT_S = 3.0
FROZEN_GRACE_S = 1.0
DEFAULT_GROUP_SIZE = 8
"""--group-size's default (docs/design.md "The swarm at scale" has the measurement behind it)."""
MAX_LEADER_FAILOVERS = 2
"""Leaders a round passes over when they send no proposal, before its members give it up."""
MAX_PROPOSAL_READS = 2
PROPOSAL_READ_BUDGET_S = PROPOSE_TIMEOUT_S / 2
"""How long a member's look-up for a proposal may take: it must answer before the leader gives up."""
"""DHT reads of the round's offers that proposals may cause in one round (a flood of bad proposals
must not turn into a flood of look-ups)."""
MAX_REMEMBERED_REFUSALS = 4096
"""Offers refused for their weight that a node remembers, so it counts each once (bounded)."""
NO_SHOW_ROUNDS = 2
"""Rounds a leader leaves out a member that was in its last group and delivered nothing to it; doubled
for each time it does so again within as many rounds of coming back, up to MAX_NO_SHOW_ROUNDS."""
MAX_NO_SHOW_ROUNDS = 64
NOT_WAITED_ROUNDS = 2
"""A peer whose offer was over the weight cap in one of this many last rounds is not waited for."""
MAX_REMEMBERED_NO_SHOWS = 1024
CLOCK_SKEW_ALLOWANCE_S = 300.0
"""Offers outlive their round by this much, so a volunteer whose clock is minutes off (its entries
expire by its clock) is still seen by the others."""


def round_key(run_id: str) -> str:
    """The run's matchmaking key: each node's current offer, tagged with the round (outer step) it
    bids for; a new round's offer replaces the last (higher seq), so a node holds one key, not one
    per round, and a long TTL costs no DHT quota."""
    return f"swarmnode/{run_id}/round"


class Offer(msgspec.Struct, frozen=True):
    """One node's bid to average in round `outer_step`, as its DHT value (short wire names; the node id
    is the entry's signed publisher). Every field is checked when it is decoded (`from_entry`), so
    nothing can fail later when the group is built."""

    node_id: str = msgspec.field(name="node")
    address: str = msgspec.field(name="addr")
    deadline: float = msgspec.field(name="dl")
    """Unix seconds, rounded to the millisecond when the offer is made."""
    run_digest: str = msgspec.field(name="run")
    global_digest: str = msgspec.field(name="g")
    weight: float = msgspec.field(name="w")
    cursor: dict[str, int] | None = msgspec.field(name="cur")
    outer_step: int = msgspec.field(name="o")
    frozen: bool = msgspec.field(name="fz", default=False)
    """Set by a leader once it froze its group: late offers are too late."""
    reachable: bool = msgspec.field(name="r", default=True)
    """False: a client (no inbound path): never a leader or a reducer; its address is empty."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadline) and is_sha256_hex(self.run_digest)) or self.outer_step < 0:
            raise ValueError("bad deadline, run digest or round")
        self.member()  # validates the address, id, cursor, weight and digest as the group spec will

    def to_value(self) -> dict[str, Any]:
        value: dict[str, Any] = msgspec.to_builtins(self)
        del value["node"]
        if not self.frozen:
            del value["fz"]
        if self.reachable:
            del value["r"]
        return value

    @classmethod
    def from_entry(cls, node_id: str, entry: DHTEntry) -> Offer | None:
        """The offer in a peer's DHT entry, or None when any field is malformed."""
        return decode_typed_value(cls, node_id, entry.value)

    def member(self) -> Member:
        return Member(
            self.node_id, self.address, self.weight, self.cursor, self.global_digest, self.reachable
        )


@dataclass(frozen=True)
class _NoShow:
    until: int
    """The last round this node's groups leave the member out of."""
    rounds: int
    """How many rounds that was."""
    delivered_since: bool = False
    """Whether it delivered in a group of this node since: until it does, it is not waited for."""


@dataclass(frozen=True)
class Outcome:
    """What matchmaking decided: a group (possibly of one), or that this node must repair itself."""

    group: GroupSpec | None  # None: alone this round
    repair_from: tuple[Offer, ...] = ()  # non-empty: this node's global digest is in the minority
    reason: str = ""
    missed: bool = False  # the round's group formed without this node: the swarm is moving ahead


class Matchmaker:
    """Runs one node's matchmaking, round after round; also answers peers' proposals."""

    def __init__(
        self,
        dht: Any,
        node_id: str,
        address: str,
        run_id: str,
        run_digest: str,
        wire_dtype: str,
        timeout_s: float,
        allreduce_timeout_s: float,
        propose: Callable[[str, GroupSpec, float], Awaitable[bool]],
        reachable: Callable[[], bool] = lambda: True,
        fetch_group: FetchGroup | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        on_refused: Callable[[str], None] = lambda reason: None,
        max_weight: float = MAX_WEIGHT,
    ) -> None:
        """`reachable()`: this node's mode now (False: a client, see the module notes); `fetch_group`:
        how a client asks a leader for its frozen group (needed once `reachable()` may be False);
        `group_size`: a round this node leads with more members averages in groups of at most this
        many (`grouping.py`); `on_refused(reason)` counts the proposals and offers refused
        (`AveragingReject`); `max_weight`: the most tokens the run's configuration lets a member's
        contribution weigh in a round (`round_token_cap`): a heavier offer is left out of groups."""
        self.max_weight = max_weight
        self._over_weight: set[tuple[str, int]] = set()  # (node, round) of offers refused for weight
        self._no_shows: dict[str, _NoShow] = {}  # node → the rounds this node's groups leave it out of
        self.group_size = group_size
        self.dht, self.node_id, self.address = dht, node_id, address
        self.reachable, self.fetch_group = reachable, fetch_group
        self._led: dict[int, GroupSpec] = {}  # the groups this node led, by round (the last few)
        self._led_or_closed = asyncio.Event()
        """Set (and replaced) whenever this node freezes a group it leads or leaves a round."""
        self._offered_as_client = False  # this round's offer: a client's (it asks for the group)
        self.run_id, self.run_digest, self.wire_dtype = run_id, run_digest, wire_dtype
        self.timeout_s, self.allreduce_timeout_s, self.propose = timeout_s, allreduce_timeout_s, propose
        self._open_round: int | None = None
        self._proposal: asyncio.Future[GroupSpec] | None = None
        self._round_offers: dict[str, Offer] = {}
        """The offers of the round this node is matchmaking in, as it last read them (its own too)."""
        self._offer_reads = 0  # DHT reads a proposal caused this round (bounded: MAX_PROPOSAL_READS)
        self._signed_offers: dict[str, tuple[int, bytes]] = {}
        """Per node, the round and signed form of its offer as last read (sent along with proposals)."""
        self.on_refused = on_refused
        self._background: set[asyncio.Task[Any]] = set()
        self._offer_ttl_s = 2 * timeout_s + CLOCK_SKEW_ALLOWANCE_S

    # ----- the proposal side (called by the averaging servicer) -----

    async def on_proposal(self, spec: GroupSpec, proposer: str | None = None) -> GroupSpec | None:
        """Accept the first proposal that includes this node for the round it is matchmaking in, if
        the round's offers bear it out (see the module notes); returns the group as this node runs it
        (with its own all-reduce budget), None when it is not taken. `proposer`: the node that signed
        it (None: nobody proven, in-process tests; the leader is then not checked)."""
        future = self._proposal
        if (
            spec.round != self._open_round
            or future is None
            or future.done()
            or spec.run_id != self.run_id
            or spec.find(self.node_id) is None
        ):
            return None
        self._take_carried_offers(spec)
        refusal = await self._proposal_refusal(spec, proposer)
        if future.done():  # (another proposal, or this node's own lead, came meanwhile)
            return None
        if refusal is not None:
            self.on_refused(refusal)
            logger.warning(
                "round %d: refused group %s proposed by %s: %s",
                spec.round,
                spec.group_id,
                (proposer or "?")[:12],
                refusal,
            )
            return None
        accepted = dataclasses.replace(spec, timeout_s=self.allreduce_timeout_s)
        future.set_result(accepted)
        return accepted

    def _take_carried_offers(self, spec: GroupSpec) -> None:
        """Adds the offers a proposal carries (signed by their publishers, for its round, of its
        members) that this node has not read itself; the others are ignored."""
        names = {m.node_id for m in spec.members}
        for signed in spec.offers:
            entry = self.dht.verify(round_key(self.run_id), signed)
            offer = None if entry is None else self._valid_offer(entry.node_id, entry)
            if offer is not None and offer.outer_step == spec.round and offer.node_id in names:
                self._round_offers.setdefault(offer.node_id, offer)

    async def _proposal_refusal(self, spec: GroupSpec, proposer: str | None) -> str | None:
        """Why the round's offers do not bear this group out (None: they do). An offer this node has
        not seen yet makes it read the round's offers again, a bounded number of times a round and
        within PROPOSAL_READ_BUDGET_S."""
        left_out = self._left_out(spec.round)
        problem = _group_problem(spec, proposer, self._round_offers, self.node_id, left_out)
        if problem is not None and self._offer_reads < MAX_PROPOSAL_READS:
            self._offer_reads += 1
            with contextlib.suppress(asyncio.TimeoutError):
                current = await asyncio.wait_for(
                    self._current_offers(round_key(self.run_id)), PROPOSAL_READ_BUDGET_S
                )
                self._round_offers.update(_for_round(current, spec.round))
                problem = _group_problem(spec, proposer, self._round_offers, self.node_id, left_out)
        return problem

    # ----- the node's own matchmaking -----

    async def form_group(
        self,
        outer_step: int,
        weight: float,
        global_digest: str,
        cursor: dict[str, int] | None,
        expected_peers: frozenset[str],
    ) -> Outcome:
        """Publish this node's offer for `outer_step` and settle the round's group (`weight`: at most
        `max_weight`; see `rounds.SwarmRounds.average`)."""
        weight = min(weight, self.max_weight)  # (what SwarmRounds.average contributes too)
        if (lie := faults.find("lie", "weight")) is not None:  # test-only: an offer claiming more tokens
            weight *= lie.arg if lie.arg is not None else 100.0
        # Rounded as it travels, so that every node ranks this offer by the very same deadline.
        deadline = round(clock.now() + self.timeout_s, 3)
        reachable = self.reachable()
        self._offered_as_client = not reachable
        own = Offer(
            *(self.node_id, self.address if reachable else "", deadline, self.run_digest, global_digest),
            *(weight, cursor, outer_step),
            reachable=reachable,
        )
        self._open_round = outer_step
        self._proposal = asyncio.get_running_loop().create_future()
        self._round_offers, self._offer_reads, self._signed_offers = {own.node_id: own}, 0, {}
        key = round_key(self.run_id)
        try:
            started = time.monotonic()
            await self.dht.publish(key, own.to_value(), self._offer_ttl_s)
            logger.debug(
                "round %d: offer published in %.2f s; expecting %s",
                outer_step,
                time.monotonic() - started,
                sorted(p[:8] for p in expected_peers),
            )
            return await self._settle(key, own, expected_peers)
        finally:
            self._open_round, self._proposal = None, None
            self._signal_led()

    async def _settle(self, key: str, own: Offer, expected_peers: frozenset[str]) -> Outcome:
        assert self._proposal is not None
        offers = self._round_offers  # (the proposal side checks groups against them)
        # Stop early once every peer this node expects has offered (none expected: wait the deadline),
        # or once most of them offer for a later round: this one closed without this node.
        # A peer whose offer this round or a recent one was over the weight cap, or that is left out as
        # a no-show, is not waited for: waiting would not make it eligible, and its pace (alone, out
        # of every group) must not set the swarm's.
        while clock.now() < own.deadline and (
            not expected_peers or not expected_peers - self._not_waited_for(own.outer_step) <= offers.keys()
        ):
            if self._proposal.done():
                return Outcome(self._proposal.result())
            current = await self._current_offers(key)
            moved_on = sorted(
                o.outer_step
                for o in current.values()
                if o.node_id in expected_peers and o.outer_step > own.outer_step
            )
            if expected_peers and 2 * len(moved_on) > len(expected_peers):
                astray = _astray(own, list(offers.values()))
                if astray is not None:  # the round closed without it for its digest: say so
                    return astray
                reason = f"{len(moved_on)} of the peers it expects already offer for round {moved_on[-1]}"
                return Outcome(None, reason=reason, missed=True)
            offers.update(_for_round(current, own.outer_step))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._proposal), _poll_interval(own, offers))
        if self._proposal.done():
            return Outcome(self._proposal.result())
        offers.update(_for_round(await self._current_offers(key), own.outer_step))
        return await self._decide(own, list(offers.values()))

    async def peer_offers(self, outer_step: int) -> dict[str, Offer]:
        """The peers' current offers for round `outer_step` or a later one (of this run's configuration)."""
        current = await self._current_offers(round_key(self.run_id))
        return {node_id: o for node_id, o in current.items() if o.outer_step >= outer_step}

    async def _current_offers(self, key: str) -> dict[str, Offer]:
        """Each peer's current offer, whatever its round, of this run's configuration."""
        entries = await self.dht.get(key)
        offers = {}
        for node_id, entry in entries.items():
            offer = self._valid_offer(node_id, entry)
            if offer is None:
                continue
            if entry.signed:
                self._signed_offers[node_id] = (offer.outer_step, entry.signed)
            if node_id != self.node_id:
                offers[node_id] = offer
        return offers

    def _valid_offer(self, node_id: str, entry: DHTEntry) -> Offer | None:
        """The offer in `entry` if it is well formed, of this run's configuration and within the
        weight cap (an offer over it is counted and logged)."""
        offer = Offer.from_entry(node_id, entry)
        if offer is None or offer.run_digest != self.run_digest:
            return None
        if offer.weight > self.max_weight:
            self._refuse_weight(offer)
            return None
        return offer

    def note_no_shows(self, node_ids: Sequence[str], outer_step: int, delivered: Sequence[str] = ()) -> None:
        """Members of this node's group in round `outer_step` that delivered nothing to it: groups this
        node leads leave them out for the next NO_SHOW_ROUNDS rounds, twice as many each time a member
        does it again within as many rounds of coming back (a volunteer whose link broke once costs two
        rounds; one that takes the groups' time on purpose, a number of rounds logarithmic in the run's),
        and no round waits for their offers until they delivered in a group again (`delivered`: the
        members that did in this one). Counted and logged each time."""
        for node_id in delivered:
            no_show = self._no_shows.get(node_id)
            if no_show is not None and not no_show.delivered_since:
                self._no_shows[node_id] = dataclasses.replace(no_show, delivered_since=True)
        for node_id in node_ids:
            last = self._no_shows.pop(node_id, None)
            rounds = NO_SHOW_ROUNDS
            if last is not None and outer_step <= last.until + last.rounds:  # again, soon after
                rounds = min(2 * last.rounds, MAX_NO_SHOW_ROUNDS)
            self._no_shows[node_id] = _NoShow(outer_step + rounds, rounds)
            self.on_refused(AveragingReject.NO_SHOW)
            logger.warning(
                "round %d: %s was in the group and delivered nothing: left out of the groups this node "
                "leads for %d rounds",
                *(outer_step, node_id[:12], rounds),
            )
        while len(self._no_shows) > MAX_REMEMBERED_NO_SHOWS:
            del self._no_shows[next(iter(self._no_shows))]

    def _not_waited_for(self, outer_step: int) -> frozenset[str]:
        """Peers round `outer_step` does not wait for: no-shows until they delivered in a group again
        (an offer from one that is in time is taken once its leave-out is over, but one that lags or
        stays away must not cost each round the matchmaking timeout), and peers whose offers were over
        the weight cap in this round or one of the NOT_WAITED_ROUNDS before it."""
        recent = range(outer_step - NOT_WAITED_ROUNDS, outer_step + 1)
        heavy = {node_id for node_id, step in self._over_weight if step in recent}
        unproven = {n for n, no_show in self._no_shows.items() if not no_show.delivered_since}
        return self._left_out(outer_step) | unproven | heavy

    def _left_out(self, outer_step: int) -> frozenset[str]:
        """The members this node leaves out of round `outer_step` for delivering nothing (never itself)."""
        return frozenset(n for n, no_show in self._no_shows.items() if no_show.until >= outer_step)

    def left_out_until(self, node_id: str) -> int:
        """The last round this node's groups leave `node_id` out of for delivering nothing (−1: none)."""
        no_show = self._no_shows.get(node_id)
        return no_show.until if no_show is not None else -1

    def _refuse_weight(self, offer: Offer) -> None:
        """Counts and logs an offer over the weight cap, once per node and round."""
        if (offer.node_id, offer.outer_step) in self._over_weight:
            return
        if len(self._over_weight) >= MAX_REMEMBERED_REFUSALS:
            self._over_weight.clear()
        self._over_weight.add((offer.node_id, offer.outer_step))
        self.on_refused(AveragingReject.OVER_WEIGHT)
        logger.warning(
            "round %d: left out %s's offer: weight %g is over the %g tokens a round allows",
            *(offer.outer_step, offer.node_id[:12], offer.weight, self.max_weight),
        )

    async def _decide(self, own: Offer, offers: list[Offer]) -> Outcome:
        logger.debug(
            "round %d: deciding on %d offers: %s",
            own.outer_step,
            len(offers),
            sorted(o.node_id[:8] for o in offers),
        )
        astray = _astray(own, offers)
        if astray is not None:
            return astray
        reference = swarm_digest(offers)
        left_out = self._left_out(own.outer_step)  # (nor do they lead: `_group_problem`)
        members = [o for o in offers if o.global_digest == reference and o.node_id not in left_out]
        for _ in range(MAX_LEADER_FAILOVERS + 1):
            if len(members) == 1:
                return Outcome(None, reason="no partner offered in time")
            leader = _leader(members)
            if leader is None:
                return Outcome(None, reason="no reachable member offered to lead the round")
            if leader.node_id == own.node_id:
                await faults.ahit("lead_round")
                return await self._lead(own, members)
            outcome = await self._follow(leader)
            if outcome is not None:
                return outcome
            logger.warning(
                "round %d: no proposal from leader %s; the next member in rank leads",
                own.outer_step,
                leader.node_id[:12],
            )
            members = [o for o in members if o.node_id != leader.node_id]
        return Outcome(None, reason=f"no proposal from {MAX_LEADER_FAILOVERS + 1} leaders in turn")

    async def _lead(self, own: Offer, members: list[Offer]) -> Outcome:
        assert self._proposal is not None
        if self._proposal.done():  # another leader's proposal arrived first: follow it
            return Outcome(self._proposal.result())
        ordered = sorted(members, key=lambda o: o.node_id)  # (`_decide` left out the no-shows)
        spec = self._round_spec(own, ordered)
        self._proposal.set_result(spec)  # from now on this node refuses other proposals
        self._remember_led(spec)
        others = [o for o in ordered if o.node_id != own.node_id and o.reachable]  # clients ask for it
        logger.debug("round %d: proposing group %s to %d members", own.outer_step, spec.group_id, len(others))
        answers = await asyncio.gather(*(self.propose(o.address, spec, PROPOSE_TIMEOUT_S) for o in others))
        self._mark_frozen(own)
        refused = [o.node_id[:12] for o, ok in zip(others, answers, strict=True) if not ok]
        if others and len(refused) == len(ordered) - 1:  # no member took it, and none asks for it
            self._led.pop(own.outer_step, None)
            reason = "every member refused the proposal: the round went on without this node"
            return Outcome(None, reason=reason, missed=True)
        if refused:
            logger.warning(
                "round %d: %s refused or missed the proposal; their parts stay un-averaged",
                own.outer_step,
                ", ".join(refused),
            )
        return Outcome(spec)

    def _round_spec(self, own: Offer, ordered: list[Offer]) -> GroupSpec:
        """The group as proposed: one flat group of at most --group-size members, or a round spec
        cut into groups (its id tagged with the size, its members in the round's order)."""
        members = [o.member() for o in ordered]
        grouped = len(members) > self.group_size and grouping.can_group(members, self.group_size)
        if grouped:
            members = grouping.round_order(members, own.outer_step, self.group_size)
        elif len(members) > self.group_size:
            logger.info(
                "round %d: %d members but too few reachable ones to lead %d groups: one flat group",
                own.outer_step,
                len(members),
                len(grouping.group_bounds(len(members), self.group_size)) - 1,
            )
        return GroupSpec(
            self.run_id,
            own.outer_step,
            grouping.grouped_id(f"{own.outer_step}-{own.node_id[:16]}", self.group_size, len(members))
            if grouped
            else f"{own.outer_step}-{own.node_id[:16]}",
            tuple(members),
            self.wire_dtype,
            self.allreduce_timeout_s,
            tuple(
                signed
                for o in ordered
                for step, signed in [self._signed_offers.get(o.node_id, (-1, b""))]
                if step == own.outer_step
            ),
        )

    def _mark_frozen(self, own: Offer) -> None:
        """Tell late comers (in the background) that this round's group is closed, so that they stop
        waiting for a proposal that will not come."""
        frozen = msgspec.structs.replace(own, frozen=True)
        task = asyncio.create_task(
            self.dht.publish(round_key(self.run_id), frozen.to_value(), self._offer_ttl_s)
        )
        self._background.add(task)
        task.add_done_callback(self._published)

    def _published(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("frozen-group mark not published: %s", task.exception())

    def _remember_led(self, spec: GroupSpec) -> None:
        self._led[spec.round] = spec
        for old in sorted(self._led)[:-4]:
            del self._led[old]
        self._signal_led()

    def _signal_led(self) -> None:
        self._led_or_closed.set()
        self._led_or_closed = asyncio.Event()

    async def led_group(self, run_id: str, outer_step: int, wait_s: float) -> GroupSpec | None:
        """The group this node led in round `outer_step`, waiting up to `wait_s` while it is still
        matchmaking in that round; None when it did not lead it (or not yet)."""
        deadline = time.monotonic() + wait_s
        while run_id == self.run_id and outer_step not in self._led and self._open_round == outer_step:
            changed, remaining = self._led_or_closed, deadline - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
        return self._led.get(outer_step) if run_id == self.run_id else None

    async def _ask_leader(self, leader: Offer, give_up: float) -> Outcome | None:
        """A client's stand-in for a proposal: the leader's frozen group, asked for over gRPC. None:
        not known yet (ask again)."""
        assert self._proposal is not None and self.fetch_group is not None
        timeout_s = max(give_up - time.monotonic(), 0.1)
        answer = await self.fetch_group(
            leader.address, self.run_id, leader.outer_step, self.node_id, timeout_s
        )
        if answer is None:
            return None
        if answer is False or not (
            isinstance(answer, GroupSpec) and await self.on_proposal(answer, leader.node_id)
        ):
            reason = f"leader {leader.node_id[:12]} froze its group without this node"
            return Outcome(None, reason=reason, missed=True)
        logger.debug("round %d: fetched group %s from its leader", answer.round, answer.group_id)
        return Outcome(self._proposal.result())

    async def _follow(self, leader: Offer) -> Outcome | None:
        """Wait for the leader's proposal until its deadline plus a grace period, or until the leader
        is seen to have frozen its group (or moved to a later round) without proposing to this node.
        None: the leader was silent (no proposal, no frozen group): it is passed over."""
        assert self._proposal is not None
        # The leader's deadline is its own word: a follower waits for it at most its own timeout.
        wait_s = min(max(leader.deadline - clock.now(), 0.0), self.timeout_s)
        give_up = time.monotonic() + wait_s + PROPOSE_TIMEOUT_S + 1.0
        key, closed = round_key(self.run_id), False
        while time.monotonic() < give_up:
            if self._offered_as_client:  # the leader proposes to no client
                pulled = await self._ask_leader(leader, give_up)
                if pulled is not None:
                    return pulled
            with contextlib.suppress(asyncio.TimeoutError):
                return Outcome(await asyncio.wait_for(asyncio.shield(self._proposal), FOLLOWER_POLL_S))
            entry = (await self.dht.get(key)).get(leader.node_id)
            now = Offer.from_entry(leader.node_id, entry) if entry is not None else None
            closed = now is not None and (
                now.outer_step > leader.outer_step or (now.outer_step == leader.outer_step and now.frozen)
            )
            if closed:  # a proposal already sent is in flight: give it a moment
                give_up = min(give_up, time.monotonic() + FROZEN_GRACE_S)
        if self._proposal.done():
            return Outcome(self._proposal.result())
        if closed:
            reason = f"leader {leader.node_id[:12]} closed the group without this node"
            return Outcome(None, reason=reason, missed=True)
        return None


FetchGroup = Callable[[str, str, int, str, float], Awaitable["GroupSpec | bool | None"]]
"""`fetch_group(leader address, run id, round, node id, timeout_s)`: the leader's frozen group; False
when it froze one without this node; None when it has none (yet) or did not answer."""


def _poll_interval(own: Offer, offers: dict[str, Offer]) -> float:
    """How long until the next look-up: short while this node may lead the round (no offer it has seen
    ranks before its own), long once it knows it follows — the proposal comes to it over gRPC at once
    either way, so a follower's look-ups only notice a round that closed without it. This keeps a
    round's DHT requests per node near k·(timeout / FOLLOWER_POLL_S) for all but the leader."""
    leader = _leader(list(offers.values()))
    return POLL_INTERVAL_S if leader is not None and leader.node_id == own.node_id else FOLLOWER_POLL_S


def _leader(offers: Sequence[Offer]) -> Offer | None:
    """Who leads a round among these offers: the first-ranked reachable one (a client never leads)."""
    return min((o for o in offers if o.reachable), key=_rank, default=None)


def _group_problem(
    spec: GroupSpec,
    proposer: str | None,
    offers: dict[str, Offer],
    me: str,
    left_out: frozenset[str] = frozenset(),
) -> str | None:
    """Why `offers` (the round's, this node's own included) do not bear `spec` out: its proposer is not
    among the leaders the round's rule designates (the first-ranked reachable offer of this node's
    global digest, or one of the next MAX_LEADER_FAILOVERS that take over from a silent one), or a
    member it names has no offer for the round that says what the group says of it. Members this node
    leaves out for delivering nothing (`left_out`) neither lead nor count in the leaders' rank."""
    own = offers.get(me)
    if own is None:
        return AveragingReject.NOT_OFFERED
    for member in spec.members:
        offer = offers.get(member.node_id)
        if offer is None or offer.member() != member:
            return AveragingReject.NOT_OFFERED
    if proposer is not None:
        if proposer in left_out:
            return AveragingReject.NO_SHOW
        ranked = sorted(
            (
                o
                for o in offers.values()
                if o.reachable and o.global_digest == own.global_digest and o.node_id not in left_out
            ),
            key=_rank,
        )
        if proposer not in {o.node_id for o in ranked[: MAX_LEADER_FAILOVERS + 1]}:
            return AveragingReject.NOT_LEADER
    return None


def _for_round(offers: dict[str, Offer], outer_step: int) -> dict[str, Offer]:
    return {node_id: o for node_id, o in offers.items() if o.outer_step == outer_step}


def _rank(offer: Offer) -> tuple[float, str]:
    """Leadership order: earliest deadline, then lowest node id."""
    return offer.deadline, offer.node_id


def _astray(own: Offer, offers: Sequence[Offer]) -> Outcome | None:
    """The outcome of a round whose offers (own included) hold another global digest than this node's
    as the swarm's: repair from the members that hold it; None when this node holds the swarm's."""
    reference = swarm_digest(offers)
    if own.global_digest == reference:
        return None
    members = tuple(o for o in offers if o.global_digest == reference)
    return Outcome(None, repair_from=members, reason="global digest differs from the swarm's")


def swarm_digest(offers: Sequence[Offer]) -> str:
    """The global digest the round treats as the swarm's: the one most offers hold; on a tie, the one
    of the earliest-ranked offer among the tied, so that every node picks the same and a split heals."""
    counts = Counter(o.global_digest for o in offers)
    most = max(counts.values())
    tied = [o for o in offers if counts[o.global_digest] == most]
    return min(tied, key=_rank).global_digest
