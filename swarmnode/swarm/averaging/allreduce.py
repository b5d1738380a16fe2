"""Butterfly all-reduce of DiLoCo pseudo-gradients over gRPC, with failure handling (the butterfly of
Moshpit SGD and hivemind's AllReduceRunner; the wire contract is averaging.proto).

The flat Δ (n values) of each member is cut into one part per reducer: with every member reachable,
N = len(members) parts, part k = [k·n/N, (k+1)·n/N); a client member (docs/design.md "Behind NAT") reduces
nothing and is never called, it only calls the reducers (`GroupSpec.part_range`).
Member k reduces part k: every other member streams its part k to it (`Exchange`, one call per pair),
it averages the contributions that arrived complete, weighted by tokens (fp32 accumulation), and sends
the average back on each call in the group's wire dtype (`wire.py`). Everyone, the reducer included,
applies the same decoded image, so all members hold bit-identical averaged values.

Failure semantics:
- A reducer publishes its part only once every contribution it still expects is in and its own parts
  went out, or at `COLLECT_SHARE` of the budget. A sender whose call broke, or whose node refused our
  connection, is no longer expected. So a member that dies while sending leaves no result of its own
  part behind: the survivors agree that its part is not averaged.
- A member that never called a reducer is waited for `reducer.silent_grace` once every member that did
  call is in, then not at all (it accepted the group and sends nothing); its own part's answer is not
  waited for either once nothing else is left. A member that called is waited for (it may be slow).
- A contribution that did not arrive complete is left out of its part. Its sender still gets the
  part's average if its call is open, so every member that hears from a reducer hears the same.
- A part whose result did not arrive whole within the budget is not covered (zeros, and missing from
  `covered`); nor is a part whose weights sum to 0. Nothing partial is ever applied.
- A member of weight 0 (averaged into nothing) sends each reducer only its header, then ends its
  side of the call: it is no longer expected, and it still gets the part's average.

With a top-k wire (`wire.is_sparse`, docs/design.md "Top-k wire") the parts are whole chunks and a
reducer relays rather than averages: it answers each caller with every other contribution to its part
that arrived whole and validated (each with its weight), and every member, the reducer included, takes
the same robust average (`aggregation.average`) of the same images in member order, its own from the
image it sent. The bytes are an all-gather's, (N − 1) images per member; who is in a part is still
decided by its reducer alone, so the failure semantics above hold as they are.

This module is the member side; the reducer side (`AveragingService`) is `reducer.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import tenacity
import torch
from google.protobuf.message import DecodeError

from swarmnode.core.diloco import AveragedDelta, Range
from swarmnode.net import bulk, rpc
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.proto.v1 import averaging_pb2_grpc as pb_grpc
from swarmnode.swarm.averaging import codecs, reducer, wire
from swarmnode.swarm.averaging.aggregation import Contribution, average
from swarmnode.swarm.averaging.reducer import AveragingServicer, LocalReduction, silent_grace
from swarmnode.swarm.averaging.trust import UNCHECKED, AveragingTrust
from swarmnode.swarm.averaging.wire import EXCHANGE_METHOD, GroupSpec
from swarmnode.util import faults
from swarmnode.util.aio import settle
from swarmnode.util.validate import parse_host_port

logger = logging.getLogger(__name__)

COLLECT_SHARE = 0.7
"""Share of the budget a reducer waits for contributions; the rest is for its result to travel back."""
_EOF: Any = grpc.aio.EOF


@dataclass(frozen=True)
class AllReduceResult:
    averaged: AveragedDelta
    """The average over `covered` (zeros elsewhere), the same on every member that covers a part."""
    bytes_sent: int
    """Payload bytes this node sent: its parts and its results. A chunk counts once it is handed to
    gRPC, not once its write returns: a member cancels its call as soon as it holds the whole result,
    which can cancel a write on either side after its chunk went out."""
    seconds: float
    included: tuple[frozenset[int], ...]
    """Per part: the members whose contributions were averaged into it (none: the part is not covered)."""
    screened: frozenset[int] = frozenset()
    """Members whose contributions reached a reducer and were left out by its robust aggregation: they
    delivered (no no-shows), though their Δ is in no part."""
    phases: tuple[tuple[str, float], ...] = ()
    """Seconds since the all-reduce began at which this member reached each phase, in order: `encoded`
    (its parts' images made), `sent` (its parts handed to gRPC), `reduced` (its own part averaged),
    `gathered` (every call over), `assembled` (Δ built). Where the time goes, for benches and logs."""

    @property
    def contributors(self) -> tuple[int, ...]:
        """Per part: how many members' contributions were averaged into it (0: not covered)."""
        return tuple(len(members) for members in self.included)

    @property
    def delivered(self) -> frozenset[int]:
        """The members whose contributions are in every part this node covers (none if it covers
        none): only their batches of the round are wholly in the outer step."""
        covered = [members for members in self.included if members]
        return frozenset.intersection(*covered) if covered else frozenset()


_Part = frozenset[int]
"""The members whose contributions a part's average (which lies in `_Butterfly.out`) holds."""


async def _wait_until(event: asyncio.Event, when: float) -> None:
    """Waits for the event until the loop time `when` at the latest."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout_at(when):
            await event.wait()


async def butterfly_allreduce(
    servicer: AveragingServicer,
    spec: GroupSpec,
    my_index: int,
    delta: torch.Tensor,
    weight: float,
    channels: rpc.ChannelCache | None = None,
    out: torch.Tensor | None = None,
) -> AllReduceResult:
    """Averages a flat fp32 CPU Δ with the group's other members, weighted by `weight` (e.g. tokens),
    within `spec.timeout_s`; see the module notes for what is covered when peers fail. `delta` must
    stay unchanged until this returns; a group of one returns it as it is. `channels`: the node's
    cached channels to its peers (None: one per call). `out`: where the average is written (a flat
    fp32 CPU tensor of Δ's size, not Δ itself; None: a new one): a caller that averages round after
    round reuses one buffer, as an in-place all-reduce would, instead of paying for fresh pages each
    time. Never raises for a peer's failure; ValueError for bad arguments."""
    _check_call(servicer, spec, my_index, delta, weight)
    if out is not None and (
        out.dtype != torch.float32 or out.shape != delta.shape or out.is_cuda or not out.is_contiguous()
    ):
        raise ValueError("out must be a contiguous fp32 CPU tensor of the pseudo-gradient's shape")
    if out is not None and out.data_ptr() == delta.data_ptr():
        raise ValueError("out must not be the pseudo-gradient itself: it is sent while results arrive")
    if len(spec.members) == 1:
        return AllReduceResult(AveragedDelta(delta, ((0, delta.numel()),), 1), 0, 0.0, (frozenset({0}),))
    return await _Butterfly(servicer, spec, my_index, delta, weight, channels, out).run()


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
        self,
        servicer: AveragingServicer,
        spec: GroupSpec,
        my_index: int,
        delta: torch.Tensor,
        weight: float,
        channels: rpc.ChannelCache | None,
        out: torch.Tensor | None = None,
    ) -> None:
        self.servicer, self.spec, self.me, self.delta, self.weight = servicer, spec, my_index, delta, weight
        self.channels = channels
        self.peers = [k for k in spec.reducers if k != my_index]
        now = asyncio.get_running_loop().time()
        self.deadline, self.collect_deadline = now + spec.timeout_s, now + COLLECT_SHARE * spec.timeout_s
        self.images: dict[int, memoryview] = {}
        self.signatures: dict[int, list[bytes]] = {}
        """Per part sent: one signature per chunk (none with mutual TLS: the connection says who)."""
        self.out = out if out is not None else torch.empty(delta.numel(), dtype=torch.float32)
        """The averaged Δ: each part's average is decoded (fp32: received) straight into its range."""
        self.parts: dict[int, _Part] = {}
        """The parts whose average arrived whole."""
        self.screened: set[int] = set()  # (see `AllReduceResult.screened`)
        self.heard: set[int] = set()
        """The reducers whose answer (a result's header) reached us."""
        self.decodes: list[asyncio.Future[Any]] = []
        self.borrowed: list[memoryview] = []
        """Buffers taken from the servicer's spares (`reducer.SpareBuffers`), given back at the end."""
        self.lanes: dict[int, socket.socket] = {}
        """The bulk lanes (`net/bulk.py`) of the calls that moved their part to one, by reducer."""
        self.bytes_sent, self.parts_out = 0, 0
        self.sends_over: set[int] = set()
        self.sends_done = asyncio.Event()
        if not self.peers:  # the only reducer (every other member a client): nothing to send
            self.sends_done.set()
        self.started = time.monotonic()
        self.phases: dict[str, float] = {}

    def _mark(self, phase: str) -> None:
        self.phases.setdefault(phase, time.monotonic() - self.started)

    async def run(self) -> AllReduceResult:
        started = self.started
        rnd = self.servicer.begin(self.spec, self.me, self.delta, self.weight)
        tasks: list[asyncio.Task[None]] = []
        try:
            # fp32 and bf16 images cost a copy at most (well under a millisecond per million values): on
            # the loop, as a thread hop costs more on a busy machine; quantising and signing go off it.
            cheap = self.spec.wire_dtype in codecs.CHEAP_DTYPES
            self.images = self._encode_parts() if cheap else await asyncio.to_thread(self._encode_parts)
            signing = self.servicer.trust.signs_chunks
            self.signatures = await asyncio.to_thread(self._sign_parts) if signing else {}
            self._mark("encoded")
            fault = await faults.ahit("allreduce_send")
            if fault is not None and fault.action == "drop":  # test-only: a no-show
                logger.warning("fault: group %s: sending and reducing nothing", self.spec.group_id)
                await asyncio.sleep(max(self.deadline - asyncio.get_running_loop().time(), 0.0))
            else:
                exchanges = {
                    k: asyncio.create_task(self._exchange(k, rnd), name=f"exchange-{k}") for k in self.peers
                }
                reducing = (
                    asyncio.create_task(self._reduce(rnd), name="reduce")
                    if self.spec.reduces(self.me)
                    else None
                )
                tasks = [*exchanges.values(), *([reducing] if reducing is not None else [])]
                await self._calls_over(exchanges, reducing, rnd)
        finally:
            await settle(*tasks)
            await asyncio.gather(*self.decodes, return_exceptions=True)
            self.servicer.end(rnd)
        self._mark("gathered")
        averaged = self._assemble()  # at most a zero fill of the parts not covered
        self._mark("assembled")
        self.servicer.spares.give(self.borrowed)  # every call and decode is over: nothing uses them
        included = tuple(self.parts.get(k, frozenset()) for k in range(len(self.spec.members)))
        seconds = time.monotonic() - started
        phases = tuple(self.phases.items())
        sent = self.bytes_sent + rnd.result_bytes
        result = AllReduceResult(averaged, sent, seconds, included, frozenset(self.screened), phases)
        logger.info(
            "group %s round %d: averaged %.0f%% of Δ with %d members in %.2f s, sent %d bytes",
            *(self.spec.group_id, self.spec.round, 100 * averaged.coverage, len(self.spec.members)),
            *(seconds, result.bytes_sent),
        )
        return result

    async def _calls_over(
        self,
        exchanges: dict[int, asyncio.Task[None]],
        reducing: asyncio.Task[None] | None,
        rnd: LocalReduction,
    ) -> None:
        """Waits until our calls and our own reduction are over, or until the deadline. A reducer that
        has not answered when nothing else is left, and never called our own part (our reduction gave
        up on it after `silent_grace`), is given up at once: it accepted the group and sends nothing.
        A member that reduces nothing cannot know who called whom: it gives `silent_grace` to the
        reducers that have not answered once nothing else is left."""
        if reducing is not None:
            await self._until({reducing}, self.deadline)
        pending = await self._until_only_unanswered(exchanges)
        if not pending:
            return
        if reducing is None:
            grace = silent_grace(time.monotonic() - self.started)
            loop = asyncio.get_running_loop()
            await self._until(pending, min(self.deadline, loop.time() + grace))
            silent = {k for k in exchanges if k not in self.heard}
        else:
            silent = set(rnd.silent) - self.heard
        for k in sorted(silent):
            if not exchanges[k].done():
                logger.warning(
                    "group %s: member %d called nobody here and answers nothing: its part is not averaged",
                    *(self.spec.group_id, k),
                )
                exchanges[k].cancel()
        await self._until({t for t in exchanges.values() if not t.done()}, self.deadline)

    async def _until(self, tasks: set[asyncio.Task[None]], when: float) -> None:
        left = when - asyncio.get_running_loop().time()
        if tasks and left > 0:
            await asyncio.wait(tasks, timeout=left)

    async def _until_only_unanswered(
        self, exchanges: dict[int, asyncio.Task[None]]
    ) -> set[asyncio.Task[None]]:
        """Waits until every call still pending is to a reducer that has not answered (or none is
        pending, or the deadline passed); returns the calls pending."""
        loop = asyncio.get_running_loop()
        by_task = {task: k for k, task in exchanges.items()}
        pending = {task for task in exchanges.values() if not task.done()}
        while pending and any(by_task[task] in self.heard for task in pending):
            left = self.deadline - loop.time()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        return pending

    def _encode_parts(self) -> dict[int, memoryview]:
        if self.weight == 0:  # a contribution of weight 0 is averaged into nothing: only its header goes
            return {}
        n, wire_dtype = self.delta.numel(), self.spec.wire_dtype
        images = {}
        for k in self.peers:
            part = self.delta[slice(*self.spec.part_range(k, n))]
            into = (
                self._borrow(codecs.encoded_size(wire_dtype, part.numel())) if wire_dtype == "bf16" else None
            )
            images[k] = codecs.encode(part, wire_dtype, into)
        return images

    def _borrow(self, size: int) -> memoryview:
        buffer = self.servicer.spares.take(size)
        self.borrowed.append(buffer)
        return buffer

    def _sign_parts(self) -> dict[int, list[bytes]]:
        trust = self.servicer.trust
        return {k: trust.sign_chunks(self.spec, k, wire.chunks(image)) for k, image in self.images.items()}

    def _assemble(self) -> AveragedDelta:
        """The averaged Δ in `out`: zeros where no whole average arrived (a result cut short may have
        left part of its values there)."""
        n, out = self.delta.numel(), self.out
        covered: list[Range] = []
        carried: list[Range] = []
        for k in range(len(self.spec.members)):
            lo, hi = self.spec.part_range(k, n)
            if k not in self.parts:
                out[lo:hi].zero_()
                continue
            _extend(covered, lo, hi)
            if self.me not in self.parts[k]:  # our own Δ is not in this average: keep it as local progress
                _extend(carried, lo, hi)
        return AveragedDelta(out, tuple(covered), len(self.spec.members), tuple(carried))

    async def _reduce(self, rnd: LocalReduction) -> None:
        """Reduces this node's part once every expected contribution is in and its own parts went
        out (or at the collect deadline), publishes the result, and waits until it was delivered."""
        await rnd.contributions_in(self.collect_deadline)
        await _wait_until(self.sends_done, self.collect_deadline)
        mine = self.out[slice(*self.spec.part_range(self.me, self.delta.numel()))]
        averaged = await rnd.reduce(self.spec.wire_dtype, self.servicer.max_norm_ratio, mine)
        self.servicer.report_exclusions(self.spec, averaged)
        self._mark("reduced")
        await faults.ahit("allreduce_reduce")
        rnd.publish(averaged)
        self.screened.update(index for index, _ in averaged.excluded)
        if averaged.values is not None:  # decoded into `mine`
            self.parts[self.me] = frozenset(averaged.included)
        absent = len(self.spec.members) - averaged.contributors - rnd.weightless - (self.weight == 0)
        if absent > 0:
            logger.warning(
                "group %s: part %d averages %d of %d members",
                *(self.spec.group_id, self.me, averaged.contributors, len(self.spec.members)),
            )
        await rnd.delivered()

    async def _exchange(self, k: int, rnd: LocalReduction) -> None:
        """Sends part k to member k and takes back its average; a failure leaves part k uncovered."""
        try:
            async with rpc.peer_channel(self.spec.members[k].address, self.channels) as channel:
                outcome = await self._exchange_on(channel, k)
        finally:
            self._send_over(k)
        if isinstance(outcome, grpc.StatusCode):
            if outcome == grpc.StatusCode.UNAVAILABLE:
                rnd.stop_waiting_for(k)  # its node is unreachable: no contribution will come from it
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
        """One call; another, backing off, while member k does not know the group yet (it answers
        FAILED_PRECONDITION until it accepted the proposal), until the collect deadline."""
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(_retryable(asyncio.get_running_loop().time())),
            wait=tenacity.wait_exponential(multiplier=0.02, max=0.25),
            stop=tenacity.stop_after_delay(
                max(self.collect_deadline - asyncio.get_running_loop().time(), 0.0)
            ),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._one_call(channel, k)
        except grpc.aio.AioRpcError as exc:
            logger.info(
                "group %s: member %d answered %s: %s", self.spec.group_id, k, exc.code(), exc.details()
            )
            return exc.code()
        raise AssertionError("tenacity ends with a result or the last error")

    async def _one_call(self, channel: grpc.aio.Channel, k: int) -> _Part | None:
        call = channel.stream_stream(
            EXCHANGE_METHOD,
            request_serializer=rpc.serialize,
            response_deserializer=None,  # raw bytes: chunks are parsed in place (`wire.take_chunk`)
        )()
        chosen: asyncio.Future[socket.socket | None] = asyncio.get_running_loop().create_future()
        writer = asyncio.create_task(self._write(call, k, chosen), name=f"write-{k}")
        try:
            return await self._read_result(call, k, chosen)
        finally:
            call.cancel()
            await settle(writer)
            lane = self.lanes.pop(k, None)
            if lane is not None:
                lane.close()

    async def _write(self, call: Any, k: int, lane: asyncio.Future[socket.socket | None]) -> None:
        """Sends part k, on the reducer's bulk lane if it offered one we reach (`lane` tells the
        reader which, as soon as it is known), else in the call's messages."""
        try:
            await self._write_part(call, k, lane)
        finally:
            if not lane.done():
                lane.set_result(None)

    async def _write_part(self, call: Any, k: int, lane: asyncio.Future[socket.socket | None]) -> None:
        header = wire.contribution_header(self.spec, self.me, k, self.weight, self.delta.numel())
        header = self.servicer.trust.sign_header(_lie(header, self.spec, self.me, k))
        try:
            await call.write(pb.Contribution(header=header))
            # Stream only once the reducer admitted the header: writing into a call that it refused
            # turns the call's status into INTERNAL (grpc.aio), which would hide why it refused.
            metadata = tuple(await call.initial_metadata())
            if wire.ADMITTED[0] not in metadata:
                return
            image, signatures = self.images.get(k, memoryview(b"")), self.signatures.get(k, ())
            if image and await self._move_to_lane(call, k, metadata):
                lane.set_result(self.lanes[k])
                await self._send_on_lane(self.lanes[k], image, signatures)
            else:
                for message, size in wire.chunk_messages(image, signatures):
                    self.bytes_sent += size  # counted before the await: see `AllReduceResult.bytes_sent`
                    await call.write(message)
            # The part is out: our own reduction need not wait for gRPC to acknowledge the half-close.
            self._send_over(k)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, OSError):
            return  # the call (or its lane) ended; its reader reports why
        self.parts_out += 1
        if self.parts_out < len(self.peers):
            await faults.ahit("allreduce_send")  # before the next part, as if they went one at a time

    async def _move_to_lane(self, call: Any, k: int, metadata: tuple[Any, ...]) -> bool:
        """Opens the bulk lane reducer k offered (none on a TLS swarm: the lane is plaintext) and tells
        it the part follows there; False (the part goes in messages) if none was offered or it
        cannot be reached."""
        offer = bulk.parse_offer(metadata)
        if offer is None or rpc.client_security().tls:
            return False
        host, _ = parse_host_port(self.spec.members[k].address)
        budget = self.collect_deadline - asyncio.get_running_loop().time()
        lane = await bulk.dial(host, *offer, timeout_s=max(0.1, min(bulk.DIAL_TIMEOUT_S, budget)))
        if lane is None:
            return False
        self.lanes[k] = lane
        await call.write(wire.BULK_MARKER)
        return True

    async def _send_on_lane(
        self, lane: socket.socket, image: memoryview, signatures: Sequence[bytes]
    ) -> None:
        if not signatures:
            self.bytes_sent += len(image)  # counted before the await: see `AllReduceResult.bytes_sent`
            await bulk.send(lane, image)
            return
        for chunk, signature in zip(wire.chunks(image), signatures, strict=True):
            self.bytes_sent += len(chunk)
            await bulk.send(lane, chunk)
            await bulk.send(lane, signature)

    def _send_over(self, k: int) -> None:
        self.sends_over.add(k)
        if len(self.sends_over) == len(self.peers):
            self._mark("sent")
            self.sends_done.set()

    async def _read_result(
        self, call: Any, k: int, lane_choice: asyncio.Future[socket.socket | None]
    ) -> _Part | None:
        """Part k's average from its reducer, on the lane our part went by if the reducer answers there
        (else in the call's messages); None if it is not averaged, cut short or malformed."""
        lo, hi = self.spec.part_range(k, self.delta.numel())
        lane = await lane_choice
        h = await _lane_header(lane) if lane is not None else None
        if h is None:  # no lane, or the reducer closed it without an answer: the answer is on the call
            h = _result_header(await call.read())
        if h is None:
            return None
        self.heard.add(k)
        included = _included(h.included, len(self.spec.members))
        self.screened.update(_included(h.excluded, len(self.spec.members)))
        if not included or h.part_elements != hi - lo or h.wire_dtype != self.spec.wire_dtype:
            return None
        # fp32: the image is the values, so it lands in `out` itself; others decode into it.
        fp32 = self.spec.wire_dtype == "fp32"
        size = codecs.encoded_size(h.wire_dtype, hi - lo)
        if self.spec.sparse:  # the contributions relayed, each with its weight, all but our own
            size = (size + reducer.RELAY_WEIGHT_BYTES) * len(included - {self.me})
        image = codecs.writable_image(self.out[lo:hi]) if fp32 else self._borrow(size)
        got = 0
        if h.bulk:  # the image follows the header on the lane
            if lane is None:
                return None
            try:
                await bulk.receive_into(lane, memoryview(image).cast("B"))
            except OSError as exc:
                logger.info("group %s: member %d's result was cut short: %s", self.spec.group_id, k, exc)
                return None
            got = len(image)
        while got < len(image):
            msg = await call.read()
            if msg is _EOF:
                return None
            try:
                got += wire.take_chunk(msg, image, got, pb.AveragedPart)[0]
            except ValueError as exc:
                logger.warning("group %s: member %d sent a bad result: %s", self.spec.group_id, k, exc)
                return None
        if self.spec.sparse:
            return await self._aggregate_relay(k, included, image)
        if h.wire_dtype in codecs.CHEAP_DTYPES and not fp32:
            codecs.decode(image, h.wire_dtype, hi - lo, self.out[lo:hi])
        elif not fp32:
            # Shielded: a decode cannot be stopped, so `run` waits for it before it assembles `out`.
            decoding = asyncio.ensure_future(
                asyncio.to_thread(codecs.decode, image, h.wire_dtype, hi - lo, self.out[lo:hi])
            )
            self.decodes.append(decoding)
            await asyncio.shield(decoding)
        return included

    async def _aggregate_relay(self, k: int, arrived: frozenset[int], image: memoryview) -> _Part | None:
        """Part k of a top-k round: the same robust average (`aggregation.average`) that its reducer
        and every other member take of the contributions it relayed, ours among them if it arrived;
        None (the part not covered) if the relay does not validate."""
        lo, hi = self.spec.part_range(k, self.delta.numel())
        try:
            contributions = self._relayed(k, arrived, image)
        except ValueError as exc:
            logger.warning("group %s: member %d relayed a bad part: %s", self.spec.group_id, k, exc)
            return None
        servicer, wire_dtype = self.servicer, self.spec.wire_dtype
        work = asyncio.to_thread(
            average, contributions, wire_dtype, hi - lo, servicer.max_norm_ratio, None, self.out[lo:hi]
        )
        averaging = asyncio.ensure_future(work)
        self.decodes.append(averaging)  # `run` waits for it before it assembles `out`
        try:
            averaged = await asyncio.shield(averaging)
        except ValueError as exc:
            logger.warning("group %s: member %d relayed a bad part: %s", self.spec.group_id, k, exc)
            return None
        self.screened.update(index for index, _ in averaged.excluded)  # (counted by part k's reducer)
        return frozenset(averaged.included) if averaged.values is not None else None

    def _relayed(self, k: int, arrived: frozenset[int], image: memoryview) -> list[Contribution]:
        """The contributions in a relay (`reducer.relay_image`), in member order, ours from what we
        sent; ValueError for a weight that is not finite, not positive, or over what its member offered."""
        lo, hi = self.spec.part_range(k, self.delta.numel())
        size = codecs.encoded_size(self.spec.wire_dtype, hi - lo)
        contributions: list[Contribution] = []
        offset = 0
        for member in sorted(arrived):
            if member == self.me:
                if k not in self.images:  # we sent no values (weight 0): a relay naming us lies
                    raise ValueError("the relay names our contribution, which we did not send")
                contributions.append((member, self.weight, self.images[k]))
                continue
            (weight,) = struct.unpack_from("<d", image, offset)
            if not 0 < weight <= self.spec.members[member].weight:  # NaN fails too
                raise ValueError(f"member {member}'s weight {weight} is not one it offered")
            start = offset + reducer.RELAY_WEIGHT_BYTES
            contributions.append((member, weight, image[start : start + size]))
            offset = start + size
        return contributions


async def _lane_header(lane: socket.socket) -> pb.AveragedHeader | None:
    """The result header a reducer wrote on a lane (`wire.lane_header`); None if the lane ended before
    one, or it is malformed."""
    size = bytearray(wire.LANE_HEADER_PREFIX)
    try:
        await bulk.receive_into(lane, memoryview(size))
        length = int.from_bytes(size, "little")
        if not 0 < length <= wire.MAX_LANE_HEADER:
            return None
        raw = bytearray(length)
        await bulk.receive_into(lane, memoryview(raw))
        msg = pb.AveragedHeader.FromString(bytes(raw))
    except (OSError, DecodeError):
        return None
    return msg if msg.bulk else None


def _result_header(first: Any) -> pb.AveragedHeader | None:
    """The header of a result's first message (raw bytes); None if the call ended or it is not one."""
    if first is _EOF:
        return None
    try:
        msg = pb.AveragedPart.FromString(first)
    except DecodeError:
        return None
    return msg.header if msg.HasField("header") else None


def _extend(ranges: list[Range], lo: int, hi: int) -> None:
    """Appends [lo, hi) to sorted, disjoint `ranges`, merging it with the last one if they touch."""
    if ranges and ranges[-1][1] == lo:
        lo = ranges.pop()[0]
    if lo < hi:
        ranges.append((lo, hi))


def _included(indices: Any, group_size: int) -> frozenset[int]:
    """The members a result says it averages; none (an unusable result) unless they are distinct
    indices of the group, ascending."""
    members = list(indices)
    if members != sorted(set(members)) or any(k >= group_size for k in members):
        return frozenset()
    return frozenset(members)


def _lie(header: pb.ContributionHeader, spec: GroupSpec, me: int, k: int) -> pb.ContributionHeader:
    """Test-only (`lie@sender`, `lie@part`): a header that claims another member's index and id, or
    another member's part; inert unless the fault is set."""
    others = [i for i in range(len(spec.members)) if i not in (me, k)]
    if faults.find("lie", "sender") is not None and others:
        header.sender, header.node_id = others[0], spec.members[others[0]].node_id
    if faults.find("lie", "part") is not None and others:
        header.part = others[0]
    return header


def _not_known_yet(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION


FIRST_CONNECT_RETRY_S = 1.0
"""How long a call that fails to connect (UNAVAILABLE) or dies before the reducer admits it
(INTERNAL) is tried again: a busy machine's fresh connection, or grpc.aio reporting a refusal of a
group not known yet as INTERNAL when it crosses the header's write. A dead member is given up after
this, so its part is no longer waited for."""


def _retryable(started: float) -> Callable[[BaseException], bool]:
    """FAILED_PRECONDITION (the member does not know the group yet) until the collect deadline;
    UNAVAILABLE and INTERNAL for `FIRST_CONNECT_RETRY_S` after the call's first try. A retried call
    that the reducer had admitted after all is refused as a duplicate, which ends it as before."""
    flaky = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)

    def retry(exc: BaseException) -> bool:
        if not isinstance(exc, grpc.aio.AioRpcError):
            return False
        early = asyncio.get_running_loop().time() < started + FIRST_CONNECT_RETRY_S
        return _not_known_yet(exc) or (early and exc.code() in flaky)

    return retry


async def propose_group(
    address: str,
    spec: GroupSpec,
    timeout_s: float,
    channels: rpc.ChannelCache | None = None,
    trust: AveragingTrust = UNCHECKED,
) -> bool:
    """Asks the member at HOST:PORT to join the group, signed as its leader by `trust`'s identity;
    False on refusal or any failure."""
    try:
        async with rpc.peer_channel(address, channels) as channel:
            # wait_for_ready: a cached channel still reconnecting to a member that was away is given
            # the proposal's time to come back, rather than failing it at once.
            reply = await pb_grpc.AveragingServiceStub(channel).Propose(
                trust.sign_proposal(wire.spec_to_pb(spec)), timeout=timeout_s, wait_for_ready=True
            )
    except (grpc.aio.AioRpcError, ValueError) as exc:
        logger.info("proposal of group %s to %s failed: %s", spec.group_id, address, exc)
        return False
    if not reply.accepted:
        logger.info("%s declined group %s: %s", address, spec.group_id, reply.reason)
    return bool(reply.accepted)


async def fetch_group(
    address: str,
    run_id: str,
    outer_step: int,
    node_id: str,
    timeout_s: float,
    channels: rpc.ChannelCache | None = None,
    trust: AveragingTrust = UNCHECKED,
) -> GroupSpec | bool | None:
    """A client member asks the leader at HOST:PORT for the group it froze in `outer_step`: the group
    (signed by one of its members, checked by `trust`); False when the leader froze one without this
    node; None when it has none (yet), failed, or sent a group nobody in it signed."""
    request = pb.AwaitGroupRequest(run_id=run_id, round=outer_step, node_id=node_id)
    try:
        async with rpc.peer_channel(address, channels) as channel:
            reply = await pb_grpc.AveragingServiceStub(channel).AwaitGroup(request, timeout=timeout_s)
        spec = wire.spec_from_pb(reply)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return False
        logger.debug("group of round %d from %s not known: %s", outer_step, address, exc.code().name)
        return None
    except ValueError as exc:
        logger.info("leader %s sent a malformed group: %s", address, exc)
        return None
    refusal = trust.group_refusal(reply, spec)
    if refusal is not None:
        logger.info("leader %s sent a group no member of it signed (%s)", address, refusal)
        return None
    return spec
