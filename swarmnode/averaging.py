"""Butterfly all-reduce of DiLoCo pseudo-gradients over gRPC, with failure handling (DESIGN.md §3
"Outer step across peers"; the butterfly of Moshpit SGD and hivemind's AllReduceRunner).

The flat Δ (n values) of each member is cut into N = len(members) parts, part k = [k·n/N, (k+1)·n/N).
Member k reduces part k: every other member streams its part k to it (`Exchange`, one call per pair),
it averages the contributions that arrived complete, weighted by tokens (fp32 accumulation), and sends
the average back on each call in the group's wire dtype (`wire.py`). Everyone, the reducer included,
applies the same decoded image, so all members hold bit-identical averaged values.

Failure semantics:
- A reducer publishes its part only once every contribution it still expects is in and its own parts
  went out, or at `COLLECT_SHARE` of the budget. A sender whose call broke, or whose node refused our
  connection, is no longer expected. So a member that dies while sending leaves no result of its own
  part behind: the survivors agree that its part is not averaged.
- A contribution that did not arrive complete is left out of its part. Its sender still gets the
  part's average if its call is open, so every member that hears from a reducer hears the same.
- A part whose result did not arrive whole within the budget is not covered (zeros, and missing from
  `covered`); nor is a part whose weights sum to 0. Nothing partial is ever applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from swarmnode import faults, rpc, wire
from swarmnode.diloco import AveragedDelta, Range
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.proto.v1 import averaging_pb2_grpc as pb_grpc
from swarmnode.wire import EXCHANGE_METHOD, GroupSpec, Member

__all__ = [
    "EXCHANGE_METHOD",
    "AllReduceResult",
    "AveragingServicer",
    "GroupSpec",
    "Member",
    "butterfly_allreduce",
    "propose_group",
]

logger = logging.getLogger(__name__)

COLLECT_SHARE = 0.7
"""Share of the budget a reducer waits for contributions; the rest is for its result to travel back."""
HEADER_TIMEOUT_S = 10.0
"""How long a new `Exchange` call may take to send its header."""
MAX_KNOWN_GROUPS = 4
"""Groups known here at once (proposed and not over); further proposals are declined."""
_EOF: Any = grpc.aio.EOF


@dataclass(frozen=True)
class AllReduceResult:
    averaged: AveragedDelta
    """The average over `covered` (zeros elsewhere), the same on every member that covers a part."""
    bytes_sent: int
    """Payload bytes this node sent: its parts and its results."""
    seconds: float
    contributors: tuple[int, ...]
    """Per part: members whose contributions were averaged into it (0: the part is not covered)."""


@dataclass(frozen=True)
class _Averaged:
    """A reducer's result: its wire image and the image's decoded values (None: not averaged)."""

    contributors: int
    image: memoryview | None = None
    values: torch.Tensor | None = None


_NOT_AVERAGED = _Averaged(0)
_Part = tuple[torch.Tensor, int]
"""A part's averaged values and how many contributions they average."""


class _Refused(Exception):
    """A request this node will not serve; ends the call with `code`."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def _invalid(message: str) -> _Refused:
    return _Refused(grpc.StatusCode.INVALID_ARGUMENT, "invalid", message)


async def _settle(*tasks: asyncio.Task[Any]) -> None:
    """Cancels the tasks and waits for them to end; logs failures other than refusals (reported)."""
    for task in tasks:
        task.cancel()
    for task, outcome in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
        if isinstance(outcome, Exception) and not isinstance(outcome, _Refused):
            logger.error("averaging task %s failed", task.get_name(), exc_info=outcome)


async def _wait_until(event: asyncio.Event, when: float) -> None:
    """Waits for the event until the loop time `when` at the latest."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout_at(when):
            await event.wait()


# ---------------------------------------------------------------------------------------------------
# Reducer side


class _Round:
    """One group as this node's reducer sees it: the contributions to its part, and its result. Known
    from a proposal (calls are then held until the local all-reduce begins, or until `expires_at`) or
    from the local all-reduce itself."""

    def __init__(self, spec: GroupSpec, my_index: int, expires_at: float) -> None:
        self.spec, self.my_index, self.expires_at = spec, my_index, expires_at
        self.started, self.all_in, self.idle = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.idle.set()
        self.total, self.own_weight, self.own = 0, 0.0, torch.empty(0)
        self.waiting = set(range(len(spec.members))) - {my_index}
        """Senders that may still deliver a whole contribution."""
        self.seen: set[int] = set()
        self.open: set[int] = set()
        self.contributions: dict[int, tuple[float, bytearray]] = {}
        self.closed = False
        self.result: asyncio.Future[_Averaged] = asyncio.get_running_loop().create_future()
        self.result_bytes = 0

    @property
    def part_len(self) -> int:
        lo, hi = self.spec.part_range(self.my_index, self.total)
        return hi - lo

    def start(self, delta: torch.Tensor, weight: float) -> None:
        self.total, self.own_weight = delta.numel(), weight
        self.own = delta[slice(*self.spec.part_range(self.my_index, self.total))]
        self.started.set()
        self._check_all_in()

    def attach(self, h: pb.ContributionHeader) -> int:
        problem = wire.header_problem(h, self.spec, self.my_index)
        if problem:
            raise _invalid(f"group {self.spec.group_id}: {problem}")
        if h.sender in self.seen:
            raise _Refused(grpc.StatusCode.ALREADY_EXISTS, "duplicate", f"sender {h.sender} called twice")
        self.seen.add(h.sender)
        self.open.add(h.sender)
        self.idle.clear()
        return int(h.sender)

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

    def _check_all_in(self) -> None:
        if self.started.is_set() and not self.waiting:
            self.all_in.set()

    def close(self) -> list[tuple[float, torch.Tensor | bytearray]]:
        """The whole contributions, its own included, in member order; any that completes later is
        left out."""
        self.closed = True
        contributions: dict[int, tuple[float, torch.Tensor | bytearray]] = dict(self.contributions)
        contributions[self.my_index] = (self.own_weight, self.own)
        return [contributions[k] for k in sorted(contributions)]

    def publish(self, averaged: _Averaged) -> None:
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

    async def collect(self, context: Any, sender: int, weight: float) -> _Averaged:
        """Receives a sender's contribution, then waits for this part's result (a late sender gets
        the result too: its reception is cut short)."""
        receiving = asyncio.create_task(self._receive(context, sender, weight), name=f"receive-{sender}")
        try:
            await asyncio.wait((receiving, self.result), return_when=asyncio.FIRST_COMPLETED)
            if receiving.done():
                receiving.result()  # raises the refusal of a bad chunk
            return await asyncio.shield(self.result)
        finally:
            await _settle(receiving)

    async def _receive(self, context: Any, sender: int, weight: float) -> None:
        image = bytearray(wire.encoded_size(self.spec.wire_dtype, self.part_len))
        got = 0
        while got < len(image):
            msg = await context.read()
            if msg is _EOF:  # the call broke (or the sender gave up) before the whole part
                self.open.discard(sender)
                self.give_up(sender)
                return
            try:
                got += wire.take_chunk(msg, image, got)
            except ValueError as exc:
                raise _invalid(str(exc)) from None
        if self.closed:
            logger.info("group %s: member %d's part came after the reduction", self.spec.group_id, sender)
            return
        self.contributions[sender] = (weight, image)
        self.give_up(sender)


def _average(
    contributions: list[tuple[float, torch.Tensor | bytearray]], wire_dtype: str, n: int
) -> _Averaged:
    """Σᵢ (wᵢ / Σw) Δᵢ in fp32, in member order, over the finite contributions of positive weight (so
    equal weights give exactly (Δ₀ + Δ₁) / 2); then its wire image and the image's decoded values,
    which is what every member applies. Runs on a worker thread."""
    kept: list[tuple[float, torch.Tensor]] = []
    for weight, data in contributions:
        if weight <= 0:
            continue
        values = data if isinstance(data, torch.Tensor) else wire.decode(data, wire_dtype, n)
        if bool(torch.isfinite(values).all()):
            kept.append((weight, values))
    if not kept:
        return _NOT_AVERAGED
    total = sum(weight for weight, _ in kept)
    acc = torch.zeros(n, dtype=torch.float32)
    for weight, values in kept:
        acc.add_(values, alpha=weight / total)
    image = wire.encode(acc, wire_dtype)
    return _Averaged(len(kept), image, wire.decode(image, wire_dtype, n))


class AveragingServicer:
    """`AveragingService` of one node: answers proposals and reduces this node's parts. Register it
    with `rpc.start_server(..., extra_servicers=[servicer.register])`."""

    def __init__(
        self,
        node_id: str,
        on_proposal: Callable[[GroupSpec], Awaitable[bool]] | None = None,
        on_rejected: Callable[[str], None] | None = None,
    ) -> None:
        """`on_proposal(spec)` decides whether this node joins a proposed group (None: it joins every
        valid group that names it); `on_rejected(reason)` counts requests refused as bad or late
        ("invalid", "duplicate", "expired", "over")."""
        self.node_id = node_id
        self._on_proposal, self._on_rejected = on_proposal, on_rejected
        self._rounds: dict[str, _Round] = {}
        self._over: dict[str, None] = {}  # recently ended groups, oldest first

    def register(self, server: grpc.aio.Server) -> None:
        handlers = {
            "Propose": grpc.unary_unary_rpc_method_handler(
                self.Propose,
                request_deserializer=pb.GroupProposal.FromString,
                response_serializer=pb.ProposalReply.SerializeToString,
            ),
            "Exchange": grpc.stream_stream_rpc_method_handler(
                self.Exchange,
                request_deserializer=pb.Contribution.FromString,
                response_serializer=wire.serialize,
            ),
        }
        name = pb.DESCRIPTOR.services_by_name["AveragingService"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)

    def expect(self, spec: GroupSpec) -> bool:
        """Makes the group known here, so that calls for it which arrive before the local all-reduce
        begins are held (for up to `spec.timeout_s`). False if too many groups are known or the group
        id is taken; ValueError if this node is not a member."""
        my_index = spec.index_of(self.node_id)
        self._forget_expired()
        known = self._rounds.get(spec.group_id)
        if known is not None:
            return known.spec == spec
        if len(self._rounds) >= MAX_KNOWN_GROUPS or spec.group_id in self._over:
            return False
        self._rounds[spec.group_id] = _Round(
            spec, my_index, asyncio.get_running_loop().time() + spec.timeout_s
        )
        return True

    def _begin(self, spec: GroupSpec, my_index: int, delta: torch.Tensor, weight: float) -> _Round:
        self._forget_expired()
        rnd = self._rounds.get(spec.group_id) or _Round(spec, my_index, 0.0)
        if rnd.spec != spec or rnd.started.is_set() or spec.group_id in self._over:
            raise ValueError(f"group {spec.group_id} already ran here, or is known with another spec")
        self._rounds[spec.group_id] = rnd
        rnd.start(delta, weight)
        return rnd

    def _end(self, rnd: _Round) -> None:
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
        if not await self._ask(spec):
            return pb.ProposalReply(accepted=False, reason="declined")
        if not self.expect(spec):
            return pb.ProposalReply(accepted=False, reason="too many groups known, or group id reused")
        return pb.ProposalReply(accepted=True)

    async def _ask(self, spec: GroupSpec) -> bool:
        if self._on_proposal is None:
            return True
        try:
            return bool(await self._on_proposal(spec))
        except Exception:
            logger.exception("deciding on group %s failed; declining it", spec.group_id)
            return False

    async def Exchange(self, request_iterator: Any, context: Any) -> None:
        rnd, sender = None, -1
        try:
            header = await _read_header(context)
            rnd = self._round_for(header.group_id)
            sender = rnd.attach(header)
            await context.send_initial_metadata(wire.ADMITTED)
            await rnd.wait_started(header)
            averaged = await rnd.collect(context, sender, header.weight)
            await _send_result(context, rnd, averaged)
        except _Refused as exc:
            if exc.reason != "unknown_group":  # not yet known: the sender asks again
                self._reject(exc.reason)
                logger.info("refused an averaging call: %s", exc)
            await context.abort(exc.code, str(exc))
        finally:
            if rnd is not None and sender >= 0:
                rnd.detach(sender)

    def _round_for(self, group_id: str) -> _Round:
        self._forget_expired()
        if group_id in self._rounds:
            return self._rounds[group_id]
        if group_id in self._over:
            raise _Refused(grpc.StatusCode.ABORTED, "over", f"the all-reduce of group {group_id} is over")
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "unknown_group", f"group {group_id} is unknown")

    def _reject(self, reason: str) -> None:
        if self._on_rejected is not None:
            self._on_rejected(reason)


async def _read_header(context: Any) -> pb.ContributionHeader:
    try:
        async with asyncio.timeout(HEADER_TIMEOUT_S):
            msg = await context.read()
    except TimeoutError:
        raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "invalid", "no header in time") from None
    if msg is _EOF or not msg.HasField("header") or msg.data:
        raise _invalid("the first message must carry the header and no data")
    return msg.header


async def _send_result(context: Any, rnd: _Round, averaged: _Averaged) -> None:
    header = pb.AveragedHeader(
        contributors=averaged.contributors, part_elements=rnd.part_len, wire_dtype=rnd.spec.wire_dtype
    )
    await context.write(pb.AveragedPart(header=header))
    for message, size in wire.chunk_messages(
        averaged.image if averaged.image is not None else memoryview(b"")
    ):
        await context.write(message)
        rnd.result_bytes += size


# ---------------------------------------------------------------------------------------------------
# Member side


async def butterfly_allreduce(
    servicer: AveragingServicer, spec: GroupSpec, my_index: int, delta: torch.Tensor, weight: float
) -> AllReduceResult:
    """Averages a flat fp32 CPU Δ with the group's other members, weighted by `weight` (e.g. tokens),
    within `spec.timeout_s`; see the module notes for what is covered when peers fail. `delta` must
    stay unchanged until this returns; a group of one returns it as it is. Never raises for a peer's
    failure; ValueError for bad arguments."""
    _check_call(servicer, spec, my_index, delta, weight)
    if len(spec.members) == 1:
        return AllReduceResult(AveragedDelta(delta, ((0, delta.numel()),), 1), 0, 0.0, (1,))
    return await _Butterfly(servicer, spec, my_index, delta, weight).run()


def _check_call(
    servicer: AveragingServicer, spec: GroupSpec, my_index: int, delta: torch.Tensor, weight: float
) -> None:
    if not 0 <= my_index < len(spec.members) or spec.members[my_index].node_id != servicer.node_id:
        raise ValueError(f"node {servicer.node_id} is not member {my_index} of group {spec.group_id}")
    if delta.dtype != torch.float32 or delta.dim() != 1 or not delta.is_contiguous() or delta.is_cuda:
        raise ValueError("the pseudo-gradient must be a flat contiguous fp32 CPU tensor")
    if not 0 <= weight <= wire.MAX_WEIGHT:
        raise ValueError(f"weight must be in [0, {wire.MAX_WEIGHT:g}], got {weight}")


class _Butterfly:
    """One member's side of one all-reduce: sends its parts, reduces its own, gathers the results."""

    def __init__(
        self, servicer: AveragingServicer, spec: GroupSpec, my_index: int, delta: torch.Tensor, weight: float
    ) -> None:
        self.servicer, self.spec, self.me, self.delta, self.weight = servicer, spec, my_index, delta, weight
        self.peers = [k for k in range(len(spec.members)) if k != my_index]
        now = asyncio.get_running_loop().time()
        self.deadline, self.collect_deadline = now + spec.timeout_s, now + COLLECT_SHARE * spec.timeout_s
        self.images: dict[int, memoryview] = {}
        self.parts: dict[int, _Part] = {}
        """The parts whose average arrived whole."""
        self.bytes_sent, self.parts_out = 0, 0
        self.sends_over: set[int] = set()
        self.sends_done = asyncio.Event()

    async def run(self) -> AllReduceResult:
        started = time.monotonic()
        rnd = self.servicer._begin(self.spec, self.me, self.delta, self.weight)
        tasks: list[asyncio.Task[None]] = []
        try:
            self.images = await asyncio.to_thread(self._encode_parts)
            faults.hit("allreduce_send")  # before the first part
            tasks = [asyncio.create_task(self._exchange(k, rnd), name=f"exchange-{k}") for k in self.peers]
            tasks.append(asyncio.create_task(self._reduce(rnd), name="reduce"))
            await asyncio.wait(tasks, timeout=self.deadline - asyncio.get_running_loop().time())
        finally:
            await _settle(*tasks)
            self.servicer._end(rnd)
        averaged = await asyncio.to_thread(self._assemble)
        contributors = tuple(
            self.parts[k][1] if k in self.parts else 0 for k in range(len(self.spec.members))
        )
        seconds = time.monotonic() - started
        result = AllReduceResult(averaged, self.bytes_sent + rnd.result_bytes, seconds, contributors)
        logger.info(
            "group %s round %d: averaged %.0f%% of Δ with %d members in %.2f s, sent %d bytes",
            *(self.spec.group_id, self.spec.round, 100 * averaged.coverage, len(self.spec.members)),
            *(seconds, result.bytes_sent),
        )
        return result

    def _encode_parts(self) -> dict[int, memoryview]:
        n = self.delta.numel()
        return {
            k: wire.encode(self.delta[slice(*self.spec.part_range(k, n))], self.spec.wire_dtype)
            for k in self.peers
        }

    def _assemble(self) -> AveragedDelta:
        n = self.delta.numel()
        out = torch.zeros(n, dtype=torch.float32)
        covered: list[Range] = []
        for k in sorted(self.parts):
            lo, hi = self.spec.part_range(k, n)
            out[lo:hi].copy_(self.parts[k][0])
            if covered and covered[-1][1] == lo:
                lo = covered.pop()[0]
            if lo < hi:
                covered.append((lo, hi))
        return AveragedDelta(out, tuple(covered), len(self.spec.members))

    async def _reduce(self, rnd: _Round) -> None:
        """Reduces this node's part once every expected contribution is in and its own parts went
        out (or at the collect deadline), publishes the result, and waits until it was delivered."""
        await _wait_until(rnd.all_in, self.collect_deadline)
        await _wait_until(self.sends_done, self.collect_deadline)
        contributions = rnd.close()
        averaged = await asyncio.to_thread(_average, contributions, self.spec.wire_dtype, rnd.own.numel())
        faults.hit("allreduce_reduce")
        rnd.publish(averaged)
        if averaged.values is not None:
            self.parts[self.me] = (averaged.values, averaged.contributors)
        if averaged.contributors < len(self.spec.members):
            logger.warning(
                "group %s: part %d averages %d of %d members",
                *(self.spec.group_id, self.me, averaged.contributors, len(self.spec.members)),
            )
        await rnd.idle.wait()

    async def _exchange(self, k: int, rnd: _Round) -> None:
        """Sends part k to member k and takes back its average; a failure leaves part k uncovered."""
        try:
            async with rpc.open_channel(self.spec.members[k].address) as channel:
                outcome = await self._exchange_on(channel, k)
        finally:
            self._send_over(k)
        if isinstance(outcome, grpc.StatusCode):
            if outcome == grpc.StatusCode.UNAVAILABLE:
                rnd.give_up(k)  # its node is unreachable: no contribution will come from it either
            logger.warning(
                "group %s: part %d not averaged: member %d answered %s",
                self.spec.group_id,
                k,
                k,
                outcome.name,
            )
        elif outcome is not None:
            self.parts[k] = outcome

    async def _exchange_on(self, channel: grpc.aio.Channel, k: int) -> _Part | grpc.StatusCode | None:
        """One call; another while member k does not know the group yet, until the collect deadline."""
        for attempt in itertools.count():
            call = channel.stream_stream(
                EXCHANGE_METHOD,
                request_serializer=wire.serialize,
                response_deserializer=pb.AveragedPart.FromString,
            )()
            writer = asyncio.create_task(self._write(call, k), name=f"write-{k}")
            try:
                return await self._read_result(call, k)
            except grpc.aio.AioRpcError as exc:
                late = asyncio.get_running_loop().time() > self.collect_deadline
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or late:
                    return exc.code()
            finally:
                call.cancel()
                await _settle(writer)
            await asyncio.sleep(min(0.02 * 2**attempt, 0.25))
        raise AssertionError("unreachable")

    async def _write(self, call: Any, k: int) -> None:
        header = wire.contribution_header(self.spec, self.me, k, self.weight, self.delta.numel())
        try:
            await call.write(pb.Contribution(header=header))
            # Stream only once the reducer admitted the header: writing into a call that it refused
            # turns the call's status into INTERNAL (grpc.aio), which would hide why it refused.
            if tuple(await call.initial_metadata()) != wire.ADMITTED:
                return
            for message, size in wire.chunk_messages(self.images[k]):
                await call.write(message)
                self.bytes_sent += size
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call ended; its reader reports why
        self._send_over(k)
        self.parts_out += 1
        if self.parts_out < len(self.peers):
            faults.hit("allreduce_send")  # before the next part, as if they went one at a time

    def _send_over(self, k: int) -> None:
        self.sends_over.add(k)
        if len(self.sends_over) == len(self.peers):
            self.sends_done.set()

    async def _read_result(self, call: Any, k: int) -> _Part | None:
        """Part k's average from its reducer; None if it is not averaged, cut short or malformed."""
        lo, hi = self.spec.part_range(k, self.delta.numel())
        first = await call.read()
        if first is _EOF or not first.HasField("header"):
            return None
        h = first.header
        if h.contributors == 0 or h.part_elements != hi - lo or h.wire_dtype != self.spec.wire_dtype:
            return None
        image = bytearray(wire.encoded_size(self.spec.wire_dtype, hi - lo))
        got = 0
        while got < len(image):
            msg = await call.read()
            if msg is _EOF:
                return None
            try:
                got += wire.take_chunk(msg, image, got)
            except ValueError as exc:
                logger.warning("group %s: member %d sent a bad result: %s", self.spec.group_id, k, exc)
                return None
        values = await asyncio.to_thread(wire.decode, image, self.spec.wire_dtype, hi - lo)
        return values, min(int(h.contributors), len(self.spec.members))


async def propose_group(address: str, spec: GroupSpec, timeout_s: float) -> bool:
    """Asks the member at HOST:PORT to join the group; False on refusal or any failure."""
    try:
        async with rpc.open_channel(address) as channel:
            reply = await pb_grpc.AveragingServiceStub(channel).Propose(
                wire.spec_to_pb(spec), timeout=timeout_s
            )
    except (grpc.aio.AioRpcError, ValueError) as exc:
        logger.info("proposal of group %s to %s failed: %s", spec.group_id, address, exc)
        return False
    if not reply.accepted:
        logger.info("%s declined group %s: %s", address, spec.group_id, reply.reason)
    return bool(reply.accepted)
