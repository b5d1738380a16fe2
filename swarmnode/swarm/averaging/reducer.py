"""The reducer side of the butterfly all-reduce (`allreduce.py` has the algorithm and its failure
semantics): `AveragingService`, which answers group proposals and averages the part of Δ this node
reduces from the contributions other members stream to it.

Trust (`trust.py`): a contribution is admitted only from the member it claims to be (its certificate
or its signature says so); a caller proven to be member j that lies in its header (another sender
index, another member's part) is refused, counted, and no longer waited for. Every chunk must continue
the part's bytes in order (and, without mutual TLS, carry its sender's signature). A group proposal
must be signed by one of its members.

Robust aggregation (`aggregation.average`): a contribution holding NaN/Inf, or whose norm is over
`max_norm_ratio` × the lower median of the part's contribution norms, is left out of the average (its
tokens are not counted, it is not among the members the result names); one far from the others is
clipped (CenteredClip). Both are counted by reason and logged once per peer.

Top-k wire: a part whose image does not validate (`core/sparse.py`) is refused as `bad_sparse`; the
result a caller gets is the other contributions themselves (`relay_image`), which every member averages
as this reducer does (`allreduce.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import struct
import threading
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError

from swarmnode.net import bulk, rpc
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging import codecs, grouping, wire
from swarmnode.swarm.averaging.aggregation import Averaged, Contribution, average
from swarmnode.swarm.averaging.trust import DEFAULT_MAX_NORM_RATIO, UNCHECKED, AveragingTrust, Speaker
from swarmnode.swarm.averaging.wire import GroupSpec
from swarmnode.util.aio import settle
from swarmnode.util.labels import AveragingReject

logger = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
"""How long a new `Exchange` call may take to send its header."""
AWAIT_GROUP_MAX_S = 60.0
"""The longest an `AwaitGroup` call is held while this node is still matchmaking in its round."""
SILENT_GRACE_MIN_S = 4.0
"""Once every member that called a reducer has delivered, a member that never called is waited for as
long again as the others took (`silent_grace`), at least this long; then it is not waited for (a
member that accepted the group and sends nothing must not hold the round to its deadline). The floor
covers honest members beginning apart: a follower begins as it accepts the proposal, the leader once
every member answered it, which may take up to matchmaking's PROPOSE_TIMEOUT_S (3 s)."""
MAX_KNOWN_GROUPS = 8
"""Groups known here at once (proposed and not over); further proposals are declined. A grouped
round (`grouping.py`) makes up to three known here: its group's, the leaders' and the hand-off."""
_EOF: Any = grpc.aio.EOF


_NOT_AVERAGED = Averaged()
_CODES = {
    AveragingReject.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    AveragingReject.IMPERSONATION: grpc.StatusCode.PERMISSION_DENIED,
}


@dataclass
class _Lane:
    """The bulk lane a reducer offered one call (`net/bulk.py`): its ticket, the connection that
    presents it, and that connection once the sender moved its part there."""

    ticket: bytes
    arrival: asyncio.Future[socket.socket]
    taken: socket.socket | None = None


class _Refused(Exception):
    """A request this node will not serve; ends the call with `code`."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def _invalid(message: str) -> _Refused:
    return _Refused(grpc.StatusCode.INVALID_ARGUMENT, "invalid", message)


def _denied(reason: AveragingReject, message: str) -> _Refused:
    return _Refused(grpc.StatusCode.PERMISSION_DENIED, reason, message)


async def _settle(*tasks: asyncio.Task[Any]) -> None:
    await settle(*tasks, expected=(_Refused,))  # a refusal was reported when it was made


class SpareBuffers:
    """Receive buffers of ended rounds, for the next round's contributions. A fresh buffer of a part's
    size costs a page fault and the kernel's zeroing per page: in `swarmnode bench allreduce` that was
    half of a member's CPU. A buffer comes back only once the round that used it is gone (no call of
    it can still write into it). Buffers are kept by size class, `limit_bytes` in all; a size that
    finds none spare and no room beside them drops them all (the sizes changed: another model or
    group size)."""

    GRAIN = 1 << 20
    """Buffers are kept by size rounded up to this, so parts a few values apart share them."""

    def __init__(self, limit_bytes: int = 256 << 20) -> None:
        self.limit_bytes = limit_bytes
        self._free: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()  # a round may be collected on whichever thread drops it last

    def take(self, size: int) -> memoryview:
        """`size` writable bytes, not zero-filled; `give` its whole buffer back (`view.obj`)."""
        capacity = -(-size // self.GRAIN) * self.GRAIN
        with self._lock:
            free = self._free.get(capacity)
            if free:
                return free.pop()[:size]
            if self._held() + capacity > self.limit_bytes:
                self._free.clear()  # other sizes (another group size, or model) filled it: start over
        return codecs.receive_buffer(capacity)[:size]

    def give(self, views: list[memoryview]) -> None:
        with self._lock:
            held = self._held()
            for view in views:
                whole = memoryview(view.obj).cast("B") if view.obj is not None else view
                if len(whole) % self.GRAIN == 0 and held + len(whole) <= self.limit_bytes:
                    self._free.setdefault(len(whole), []).append(whole)
                    held += len(whole)

    def _held(self) -> int:
        return sum(len(b) for free in self._free.values() for b in free)

    @property
    def held(self) -> int:
        """Buffers kept now."""
        with self._lock:
            return sum(len(free) for free in self._free.values())


class _PartRound:
    """One group as this node's reducer sees it: the contributions to its part, and its result. Known
    from a proposal (calls are then held until the local all-reduce begins, or until `expires_at`) or
    from the local all-reduce itself."""

    def __init__(
        self, spec: GroupSpec, my_index: int, expires_at: float, spares: SpareBuffers | None = None
    ) -> None:
        self.spec, self.my_index, self.expires_at = spec, my_index, expires_at
        self.spares = spares
        self.buffers: list[memoryview] = []
        if spares is not None:
            weakref.finalize(self, spares.give, self.buffers)
        self.started, self.all_in, self.idle = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.only_silent_left = asyncio.Event()
        """Set once all are in, or some member called and every sender still waited for never did."""
        self.idle.set()
        self.total, self.own_weight, self.own = 0, 0.0, torch.empty(0)
        self.began = 0.0
        """The loop time the local all-reduce began."""
        self.waiting = set(range(len(spec.members))) - {my_index}
        """Senders that may still deliver a whole contribution."""
        self.seen: set[int] = set()
        self.silent: set[int] = set()
        """Senders given up for never calling within the grace (`give_up_silent`)."""
        self.refused: set[int] = set()
        """Members proven to have lied to this reducer: not waited for, never admitted."""
        self.open: set[int] = set()
        self.weightless: set[int] = set()
        """Senders whose header says weight 0 (a grouped round's hand-off): they send no values."""
        self.contributions: dict[int, tuple[float, bytearray | memoryview]] = {}
        self.closed = False
        self.result: asyncio.Future[Averaged] = asyncio.get_running_loop().create_future()
        self.result_bytes = 0

    @property
    def part_len(self) -> int:
        lo, hi = self.spec.part_range(self.my_index, self.total)
        return hi - lo

    def start(self, delta: torch.Tensor, weight: float) -> None:
        self.total, self.own_weight = delta.numel(), weight
        self.own = delta[slice(*self.spec.part_range(self.my_index, self.total))]
        self.began = asyncio.get_running_loop().time()
        self.started.set()
        self._check_all_in()

    def attach(self, h: pb.ContributionHeader, speaker: Speaker) -> int:
        """Admits a call from the member its header names; `_Refused` otherwise (a member proven to
        have sent a lying header itself is refused for the rest of the round, and no longer waited for)."""
        group = self.spec.group_id
        if speaker.refusal in (AveragingReject.UNAUTHENTICATED, AveragingReject.BAD_SIGNATURE):
            raise _denied(speaker.refusal, f"group {group}: the caller did not prove which member it is")
        speaking = self.spec.find(speaker.node_id)
        if speaker.node_id is not None and speaking is None:
            raise _denied(
                AveragingReject.IMPERSONATION, f"group {group}: node {speaker.node_id} is no member"
            )
        if speaking in self.refused:
            raise _denied(AveragingReject.IMPERSONATION, f"group {group}: member {speaking} lied before")
        problem = wire.header_problem(h, self.spec, self.my_index)
        if problem is None and speaker.refusal is not None:
            problem = f"member {speaking} claims to be member {h.sender}"
        if problem:
            # A lie is the speaker's own when its connection proves who it is, or when it signed a
            # header claiming another member; a signed header for another part or round may be a
            # replay of an honest one, so that call alone is refused.
            own_lie = speaker.by_connection or speaker.refusal is not None
            if speaking is not None and speaking != self.my_index and own_lie:
                self.refuse(speaking)
            reason = AveragingReject.IMPERSONATION if speaker.refusal is not None else AveragingReject.INVALID
            raise _Refused(_CODES[reason], reason, f"group {group}: {problem}")
        offered = self.spec.members[h.sender].weight
        if h.weight > offered:  # (the group's weights are what each member signed in its offer)
            if speaking is not None and speaking != self.my_index:
                self.refuse(speaking)
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                AveragingReject.OVER_WEIGHT,
                f"group {group}: member {h.sender} weighs {h.weight:g}, more than the {offered:g} it offered",
            )
        if h.sender in self.seen:
            raise _Refused(grpc.StatusCode.ALREADY_EXISTS, "duplicate", f"sender {h.sender} called twice")
        self.seen.add(h.sender)
        if h.weight == 0:
            self.weightless.add(int(h.sender))
        self.open.add(h.sender)
        self.idle.clear()
        return int(h.sender)

    def refuse(self, member: int) -> None:
        """Member `member` lied to this reducer: its contribution is not waited for, nor admitted."""
        self.refused.add(member)
        self.waiting.discard(member)
        self._check_all_in()

    def detach(self, sender: int) -> None:
        self.open.discard(sender)
        self.give_up(sender)
        if not self.open:
            self.idle.set()

    def give_up(self, sender: int) -> None:
        """Stops waiting for a sender unless its call is open (it may still deliver)."""
        if sender not in self.open or sender in self.contributions:
            self.waiting.discard(sender)
            self._check_all_in()

    def give_up_silent(self) -> list[int]:
        """Stops waiting for the senders that never called; returns them."""
        silent = sorted(self.waiting - self.seen)
        self.silent.update(silent)
        self.waiting.difference_update(silent)
        self._check_all_in()
        return silent

    def _check_all_in(self) -> None:
        if not self.started.is_set():
            return
        if not self.waiting:
            self.all_in.set()
            self.only_silent_left.set()
        elif self.seen and self.waiting.isdisjoint(self.seen):  # (none called yet: none to compare with)
            self.only_silent_left.set()

    def close(self) -> list[Contribution]:
        """The whole contributions, its own included, in member order; any that completes later is
        left out."""
        self.closed = True
        contributions: dict[int, tuple[float, torch.Tensor | bytearray | memoryview]] = dict(
            self.contributions
        )
        contributions[self.my_index] = (self.own_weight, self.own)
        return [(k, *contributions[k]) for k in sorted(contributions)]

    def publish(self, averaged: Averaged) -> None:
        if not self.result.done():
            self.result.set_result(averaged)

    async def wait_started(self, h: pb.ContributionHeader) -> None:
        """Holds a call until the local all-reduce begins, then checks the sizes it declared."""
        try:
            async with asyncio.timeout_at(self.expires_at):
                await self.started.wait()
        except TimeoutError:
            raise _Refused(grpc.StatusCode.ABORTED, "expired", "the all-reduce never began here") from None
        if h.total_elements != self.total or h.part_elements != self.part_len:
            raise _invalid(f"sizes {h.total_elements}/{h.part_elements}, not {self.total}/{self.part_len}")

    async def collect(
        self, context: Any, sender: int, h: pb.ContributionHeader, trust: AveragingTrust, lane: _Lane | None
    ) -> Averaged:
        """Receives a sender's contribution (over the call, or the bulk lane offered to it), then waits
        for this part's result (a late sender gets the result too: its reception is cut short)."""
        receiving = asyncio.create_task(
            self._receive(context, sender, h, trust, lane), name=f"receive-{sender}"
        )
        try:
            await asyncio.wait((receiving, self.result), return_when=asyncio.FIRST_COMPLETED)
            if receiving.done():
                receiving.result()  # raises the refusal of a bad chunk
            return await asyncio.shield(self.result)
        finally:
            await _settle(receiving)

    async def _receive(
        self, context: Any, sender: int, h: pb.ContributionHeader, trust: AveragingTrust, lane: _Lane | None
    ) -> None:
        image = self._receive_buffer(codecs.encoded_size(self.spec.wire_dtype, self.part_len))
        got, index = 0, 0
        while got < len(image):
            msg = await context.read()
            if lane is not None and got == 0 and msg == wire.BULK_MARKER:
                if not await self._receive_on_lane(lane, sender, h, trust, image):
                    return
                break
            if msg is _EOF:  # the call broke (or the sender gave up) before the whole part
                self._lost(sender)
                return
            try:
                size, signature = wire.take_chunk(msg, image, got, pb.Contribution)
            except ValueError as exc:
                raise _Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, AveragingReject.CHUNK_ORDER, str(exc)
                ) from None
            chunk = memoryview(image)[got : got + size]
            # sha256 and Ed25519 of up to 1 MiB: off the loop, like the member side's signing
            signed = not trust.signs_chunks or await asyncio.to_thread(
                trust.chunk_ok, h, self.spec, index, chunk, signature
            )
            if not signed:
                raise _denied(
                    AveragingReject.BAD_SIGNATURE, f"chunk {index} of member {sender}: bad signature"
                )
            got, index = got + size, index + 1
        if self.spec.sparse and not await asyncio.to_thread(self._valid_sparse, image):
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                AveragingReject.BAD_SPARSE,
                f"group {self.spec.group_id}: member {sender}'s top-k part does not validate",
            )
        weight = h.weight
        if self.closed:
            logger.info("group %s: member %d's part came after the reduction", self.spec.group_id, sender)
            return
        self.contributions[sender] = (weight, image)
        self.give_up(sender)

    def _valid_sparse(self, image: memoryview) -> bool:
        try:
            codecs.entries(image, self.spec.wire_dtype, self.part_len)
        except ValueError as exc:
            logger.info("group %s: a top-k part refused: %s", self.spec.group_id, exc)
            return False
        return True

    def _receive_buffer(self, size: int) -> memoryview:
        if self.spares is None:
            return codecs.receive_buffer(size)
        buffer = self.spares.take(size)
        self.buffers.append(buffer)
        return buffer

    def _lost(self, sender: int) -> None:
        """The sender's part stopped before its end: it will not deliver."""
        self.open.discard(sender)
        self.give_up(sender)

    async def _receive_on_lane(
        self, lane: _Lane, sender: int, h: pb.ContributionHeader, trust: AveragingTrust, image: memoryview
    ) -> bool:
        """Receives the part on the bulk lane the sender moved to (each chunk followed by its signature
        when the header is signed); False if it ended early. `_Refused` if the lane never came or a
        chunk's signature does not verify."""
        try:
            lane.taken = await asyncio.wait_for(asyncio.shield(lane.arrival), HEADER_TIMEOUT_S)
        except TimeoutError:
            raise _invalid("the sender moved to the bulk lane but never connected") from None
        signatures: list[bytes] = []
        signature = bytearray(wire.SIGNATURE_BYTES if h.signature else 0)
        for offset in range(0, len(image), rpc.CHUNK_BYTES):
            try:
                await bulk.receive_into(lane.taken, image[offset : offset + rpc.CHUNK_BYTES])
                await bulk.receive_into(lane.taken, memoryview(signature))
            except OSError:
                self._lost(sender)
                return False
            signatures.append(bytes(signature))
        # Every chunk checked in one trip off the loop (sha256 and Ed25519 per MiB), while the other
        # lanes go on arriving; nothing of the part is used before.
        bad = (
            await asyncio.to_thread(self._first_bad_chunk, h, trust, image, signatures)
            if trust.signs_chunks
            else None
        )
        if bad is not None:
            raise _denied(AveragingReject.BAD_SIGNATURE, f"chunk {bad} of member {sender}: bad signature")
        return True

    def _first_bad_chunk(
        self, h: pb.ContributionHeader, trust: AveragingTrust, image: memoryview, signatures: list[bytes]
    ) -> int | None:
        for index, signature in enumerate(signatures):
            chunk = image[index * rpc.CHUNK_BYTES : (index + 1) * rpc.CHUNK_BYTES]
            if not trust.chunk_ok(h, self.spec, index, chunk, signature):
                return index
        return None


class LocalReduction:
    """The member side's handle on the part this node reduces: the reducer owns the round's state
    (who called, who may still deliver, the contributions), the member may only wait for them, stop
    waiting for a member it knows is gone, reduce, and wait until the result went out."""

    def __init__(self, rnd: _PartRound) -> None:
        self._round = rnd

    @property
    def part_elements(self) -> int:
        return int(self._round.own.numel())

    @property
    def result_bytes(self) -> int:
        """Payload bytes of this part's average handed to gRPC so far, all callers together."""
        return self._round.result_bytes

    @property
    def weightless(self) -> int:
        """How many senders (this node aside) contributed weight 0 on purpose: a header, no values."""
        return len(self._round.weightless)

    @property
    def silent(self) -> frozenset[int]:
        """Members given up for never calling this reducer (see `contributions_in`)."""
        return frozenset(self._round.silent)

    async def contributions_in(self, deadline: float) -> None:
        """Waits until every contribution still expected is in, or until the loop time `deadline`. Once
        only members that never called are missing, they are waited for `silent_grace` longer, then
        given up (`silent`): a member that called is waited for until the deadline (it may be slow),
        one that accepted the group and never called is not (it may be doing it on purpose)."""
        rnd = self._round
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await rnd.only_silent_left.wait()
                if not rnd.all_in.is_set():
                    grace = silent_grace(asyncio.get_running_loop().time() - rnd.began)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(grace):
                            await rnd.all_in.wait()
                    silent = rnd.give_up_silent()
                    if silent:
                        logger.warning(
                            "group %s: member(s) %s never called in %.1f s: not waited for",
                            *(rnd.spec.group_id, silent, asyncio.get_running_loop().time() - rnd.began),
                        )
                await rnd.all_in.wait()

    def stop_waiting_for(self, sender: int) -> None:
        """Member `sender` is unreachable: no contribution will come from it (unless its call is open)."""
        self._round.give_up(sender)

    async def reduce(
        self,
        wire_dtype: str,
        max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO,
        values_out: torch.Tensor | None = None,
    ) -> Averaged:
        """Averages the whole contributions in (its own included; any that completes later is left out)
        on a worker thread, robustly (see `average`), the decoded values written into `values_out` if
        given; `publish` then answers every caller with it."""
        rnd = self._round
        contributions = rnd.close()
        n = self.part_elements
        acc = torch.frombuffer(rnd._receive_buffer(4 * n), dtype=torch.float32) if n else None
        scratch = (
            torch.frombuffer(rnd._receive_buffer(4 * n), dtype=torch.float32)
            if n and wire_dtype == "bf16"
            else None
        )
        if not rnd.spec.sparse:
            return await asyncio.to_thread(
                average, contributions, wire_dtype, n, max_norm_ratio, acc, values_out, scratch
            )
        # Top-k: its own contribution counts as its image decodes, as on every member it is relayed to.
        relay = await asyncio.to_thread(_relay, contributions, wire_dtype)
        relayed: list[Contribution] = list(relay)
        averaged = await asyncio.to_thread(average, relayed, wire_dtype, n, max_norm_ratio, acc, values_out)
        return dataclasses.replace(averaged, relay=relay)

    def publish(self, averaged: Averaged) -> None:
        self._round.publish(averaged)

    async def delivered(self) -> None:
        """Waits until every call to this part ended (each caller got the result or went away)."""
        await self._round.idle.wait()


def silent_grace(others_took_s: float) -> float:
    """How long, after the others delivered in `others_took_s`, a member that never called is waited for."""
    return max(SILENT_GRACE_MIN_S, others_took_s)


class AveragingServicer:
    """`AveragingService` of one node: answers proposals and reduces this node's parts. Register it
    with `snapshot_server.start_server(..., extra_servicers=[servicer.register])`."""

    def __init__(
        self,
        node_id: str,
        on_proposal: Callable[[GroupSpec, str | None], Awaitable[GroupSpec | None]] | None = None,
        on_rejected: Callable[[str], None] | None = None,
        led_group: Callable[[str, int, float], Awaitable[GroupSpec | None]] | None = None,
        trust: AveragingTrust = UNCHECKED,
        max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO,
        on_excluded: Callable[[str], None] | None = None,
        on_clipped: Callable[[], None] | None = None,
        lanes: bulk.BulkListener | None = None,
    ) -> None:
        """`on_proposal(spec, proposer)` decides whether this node joins a group `proposer` (the node
        that signed it; None when nobody is proven) proposed, and returns the group as this node runs
        it, or None (None as the callback: it joins every valid group that names it as it is);
        `on_rejected(reason)` counts requests refused as bad, late or unauthenticated
        (`AveragingReject`); `led_group(run id, round, wait_s)` is the group this node
        led in that round, for a client member's `AwaitGroup` (None: it led none); `trust` signs and
        checks who speaks (`trust.py`; the default trusts every header: in-process tests only);
        `max_norm_ratio` is the robust aggregation's bound and `on_excluded(reason)` counts the
        contributions it leaves out, `on_clipped()` those it clips; `lanes`: the started listener
        whose bulk lanes this node offers its callers (None: every byte goes over gRPC; never with TLS,
        see `net/bulk.py`)."""
        self.node_id = node_id
        self.led_group = led_group
        self._on_proposal, self._on_rejected = on_proposal, on_rejected
        self.trust, self.max_norm_ratio, self._on_excluded = trust, max_norm_ratio, on_excluded
        self._on_clipped = on_clipped
        self.lanes = lanes
        self._logged_exclusions: set[str] = set()
        self._logged_clips: set[str] = set()
        self._rounds: dict[str, _PartRound] = {}
        self.spares = SpareBuffers()
        self._over: dict[str, None] = {}  # recently ended groups, oldest first

    def register(self, server: grpc.aio.Server) -> str:
        """Adds `AveragingService` to the server; returns its name (reported in health and reflection)."""
        handlers = {
            "Propose": grpc.unary_unary_rpc_method_handler(
                self.Propose,
                request_deserializer=pb.GroupProposal.FromString,
                response_serializer=pb.ProposalReply.SerializeToString,
            ),
            "Exchange": grpc.stream_stream_rpc_method_handler(
                self.Exchange,
                request_deserializer=None,  # raw bytes: chunks are parsed in place (`wire.take_chunk`)
                response_serializer=rpc.serialize,
            ),
            "AwaitGroup": grpc.unary_unary_rpc_method_handler(
                self.AwaitGroup,
                request_deserializer=pb.AwaitGroupRequest.FromString,
                response_serializer=pb.GroupProposal.SerializeToString,
            ),
        }
        name = pb.DESCRIPTOR.services_by_name["AveragingService"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
        return str(name)

    def expect(self, spec: GroupSpec) -> bool:
        """Makes the group known here, so that calls for it which arrive before the local all-reduce
        begins are held (for up to `spec.timeout_s`); for a grouped round spec, each sub-group this
        node averages in. False if too many groups are known or a group id is taken; ValueError if
        this node is not a member."""
        return all([self._expect_one(sub) for sub in grouping.sub_specs(spec, self.node_id)])

    def _expect_one(self, spec: GroupSpec) -> bool:
        my_index = spec.index_of(self.node_id)
        self._forget_expired()
        known = self._rounds.get(spec.group_id)
        if known is not None:
            return known.spec == spec
        if len(self._rounds) >= MAX_KNOWN_GROUPS or spec.group_id in self._over:
            return False
        self._rounds[spec.group_id] = _PartRound(
            spec, my_index, asyncio.get_running_loop().time() + spec.timeout_s, self.spares
        )
        return True

    def begin(self, spec: GroupSpec, my_index: int, delta: torch.Tensor, weight: float) -> LocalReduction:
        """Starts reducing this node's part of the group's all-reduce and hands the member side a narrow
        handle on it (the member calls this, then `end`); ValueError if the group already ran here or
        is known with another spec."""
        self._forget_expired()
        rnd = self._rounds.get(spec.group_id) or _PartRound(spec, my_index, 0.0, self.spares)
        if rnd.spec != spec or rnd.started.is_set() or spec.group_id in self._over:
            raise ValueError(f"group {spec.group_id} already ran here, or is known with another spec")
        self._rounds[spec.group_id] = rnd
        rnd.start(delta, weight)
        return LocalReduction(rnd)

    def end(self, reduction: LocalReduction) -> None:
        """Ends a reduction that `begin` started: unanswered calls get no average, later ones are refused."""
        rnd = reduction._round
        rnd.publish(_NOT_AVERAGED)
        self._rounds.pop(rnd.spec.group_id, None)
        self._over[rnd.spec.group_id] = None
        while len(self._over) > 64:
            del self._over[next(iter(self._over))]

    def _forget_expired(self) -> None:
        now = asyncio.get_running_loop().time()
        for group_id, rnd in list(self._rounds.items()):
            if not rnd.started.is_set() and rnd.expires_at < now:
                del self._rounds[group_id]

    async def Propose(self, request: pb.GroupProposal, context: Any) -> pb.ProposalReply:
        try:
            spec = wire.spec_from_pb(request)
            spec.index_of(self.node_id)
        except ValueError as exc:
            self._reject("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        refusal = self.trust.proposal_refusal(request, spec, context)
        if refusal is not None:
            self._reject(refusal)
            logger.info("refused a proposal of group %s: %s", spec.group_id, refusal)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"the group is not signed by its leader ({refusal})"
            )
        accepted = await self._ask(spec, self.trust.proposer(request))
        if accepted is None:
            return pb.ProposalReply(accepted=False, reason="declined")
        if not self.expect(accepted):
            return pb.ProposalReply(accepted=False, reason="too many groups known, or group id reused")
        return pb.ProposalReply(accepted=True)

    async def AwaitGroup(self, request: pb.AwaitGroupRequest, context: Any) -> pb.GroupProposal:
        """A client member's pull of the group this node led (see averaging.proto)."""
        remaining = context.time_remaining()
        wait_s = min(AWAIT_GROUP_MAX_S, remaining if remaining is not None else AWAIT_GROUP_MAX_S)
        spec = None
        if self.led_group is not None:
            spec = await self.led_group(request.run_id, request.round, max(wait_s - 0.2, 0.0))
        if spec is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"not leading round {request.round}")
        assert spec is not None
        if spec.find(request.node_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"group {spec.group_id} does not include it")
        return self.trust.sign_proposal(wire.spec_to_pb(spec))

    async def _ask(self, spec: GroupSpec, proposer: str | None) -> GroupSpec | None:
        if self._on_proposal is None:
            return spec
        try:
            return await self._on_proposal(spec, proposer)
        except Exception:
            logger.exception("deciding on group %s failed; declining it", spec.group_id)
            return None

    async def Exchange(self, request_iterator: Any, context: Any) -> None:
        rnd, sender, lane = None, -1, None
        try:
            header = await _read_header(context)
            rnd = self._round_for(header.group_id)
            sender = rnd.attach(header, self.trust.speaker(header, context, rnd.spec))
            lane = self._offer_lane()
            offer = (bulk.offer_metadata(self.lanes.port, lane.ticket),) if self.lanes and lane else ()
            await context.send_initial_metadata(wire.ADMITTED + offer)
            await rnd.wait_started(header)
            averaged = await rnd.collect(context, sender, header, self.trust, lane)
            await _send_result(context, rnd, averaged, lane.taken if lane else None, sender)
        except _Refused as exc:
            if exc.reason != "unknown_group":  # not yet known: the sender asks again
                self._reject(exc.reason)
                logger.info("refused an averaging call (%s): %s", exc.reason, exc)
            await context.abort(exc.code, str(exc))
        finally:
            if rnd is not None and sender >= 0:
                rnd.detach(sender)
            if lane is not None and self.lanes is not None:
                self.lanes.release(lane.ticket, lane.arrival)

    def _offer_lane(self) -> _Lane | None:
        offered = self.lanes.offer() if self.lanes is not None else None
        return _Lane(*offered) if offered is not None else None

    def _round_for(self, group_id: str) -> _PartRound:
        self._forget_expired()
        if group_id in self._rounds:
            return self._rounds[group_id]
        if group_id in self._over:
            raise _Refused(grpc.StatusCode.ABORTED, "over", f"the all-reduce of group {group_id} is over")
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "unknown_group", f"group {group_id} is unknown")

    def _reject(self, reason: str) -> None:
        if self._on_rejected is not None:
            self._on_rejected(reason)

    def report_exclusions(self, spec: GroupSpec, averaged: Averaged, part: int | None = None) -> None:
        """Counts the contributions the robust aggregation left out or clipped of a part (None: this
        node's own; a top-k member aggregates every part itself); logs each peer once."""
        part = spec.index_of(self.node_id) if part is None else part
        for index in averaged.clipped:
            if self._on_clipped is not None:
                self._on_clipped()
            node_id = spec.members[index].node_id
            if node_id not in self._logged_clips:
                self._logged_clips.add(node_id)
                logger.warning(
                    "group %s: clipped member %d (%s)'s contribution to part %d: far from the others' "
                    "(logged once per peer; counted in swarmnode_averaging_clipped_total)",
                    *(spec.group_id, index, node_id[:12], part),
                )
        for index, reason in averaged.excluded:
            if self._on_excluded is not None:
                self._on_excluded(reason)
            node_id = spec.members[index].node_id
            if node_id not in self._logged_exclusions:
                self._logged_exclusions.add(node_id)
                logger.warning(
                    "group %s: left member %d (%s)'s contribution out of part %d: %s "
                    "(logged once per peer; counted in swarmnode_averaging_excluded_total)",
                    *(spec.group_id, index, node_id[:12], part, reason),
                )


async def _read_header(context: Any) -> pb.ContributionHeader:
    try:
        async with asyncio.timeout(HEADER_TIMEOUT_S):
            msg = await context.read()
    except TimeoutError:
        raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "invalid", "no header in time") from None
    try:
        first = pb.Contribution.FromString(msg) if isinstance(msg, bytes) else None
    except DecodeError:
        first = None
    if first is None or not first.HasField("header") or first.data:
        raise _invalid("the first message must carry the header and no data")
    return first.header


def _relay(contributions: list[Contribution], wire_dtype: str) -> tuple[tuple[int, float, memoryview], ...]:
    """The contributions of positive weight as a top-k reducer relays them (its own encoded)."""
    return tuple(
        (k, w, codecs.encode(data, wire_dtype) if isinstance(data, torch.Tensor) else memoryview(data))
        for k, w, data in contributions
        if w > 0
    )


RELAY_WEIGHT_BYTES = 8
"""A relayed top-k contribution: its weight (float64, little-endian), then its image."""


def relay_image(averaged: Averaged, caller: int) -> memoryview:
    """What a top-k reducer sends `caller`: every relayed contribution but the caller's own, in member
    order, each as its weight then its image."""
    pieces = [struct.pack("<d", w) + bytes(image) for k, w, image in averaged.relay if k != caller]
    return memoryview(b"".join(pieces))


async def _send_result(
    context: Any, rnd: _PartRound, averaged: Averaged, lane: socket.socket | None, caller: int
) -> None:
    """The part's average to one caller: on the caller's bulk lane when its contribution came that way
    (the header, framed, then the image: no gRPC message on the way), else in the call's messages.
    A top-k reducer sends the contributions it holds instead (`relay_image`), `included` naming them."""
    sparse = rnd.spec.sparse
    header = pb.AveragedHeader(
        contributors=len(averaged.relay) if sparse else averaged.contributors,
        part_elements=rnd.part_len,
        wire_dtype=rnd.spec.wire_dtype,
        included=[k for k, _, _ in averaged.relay] if sparse else averaged.included,
        bulk=lane is not None,
        excluded=[] if sparse else sorted(index for index, _ in averaged.excluded),
    )
    if sparse:
        averaged = dataclasses.replace(averaged, image=relay_image(averaged, caller))
    if lane is not None:
        image = averaged.image if averaged.image is not None else memoryview(b"")
        rnd.result_bytes += len(image)  # counted before the await, as below
        with contextlib.suppress(OSError):  # the caller went away; it has no result from this part
            await bulk.send(lane, wire.lane_header(header))
            await bulk.send(lane, image)
        return
    await context.write(pb.AveragedPart(header=header))
    for message, size in wire.chunk_messages(
        averaged.image if averaged.image is not None else memoryview(b"")
    ):
        # Counted before the await: the member cancels the call once it holds the whole result, and
        # grpc.aio then cancels this handler, possibly before the delivered last chunk's write returns.
        rnd.result_bytes += size
        await context.write(message)
