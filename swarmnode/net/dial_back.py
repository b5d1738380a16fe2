"""The dial-back probe (`ReachabilityService.DialBack`, reachability.proto): "connect to me and answer".

A node asks a peer to dial it back; the peer opens a fresh connection to the caller's *observed*
address — the host of the call's own peer string, never a host the caller names — at the port the
caller gives, and calls `GetStatus` there: the caller is reachable when a node answers with the node id
it claimed. So the probe can make a node dial only the very host that asked (at worst another port of
it), and only within bounds: `DIAL_BACK_BURST` probes per caller host, refilled one per
`DIAL_BACK_REFILL_S`, and `MAX_DIALS_IN_FLIGHT` dials at once; beyond either the call ends
RESOURCE_EXHAUSTED without dialling. Every dial takes at most `DIAL_TIMEOUT_S`, and is over before the
prober answers: the prober opens the TCP connection itself first (`connect_once`, whose socket is closed
when it gives up) and asks `GetStatus` only of a caller that accepted it. A gRPC channel cannot end a dial:
closing it leaves its connection attempt running until gRPC's own connect timeout (5 s here,
`grpc.min_reconnect_backoff_ms`), so a caller behind NAT went on receiving the prober's SYN retries (one a
second on Linux, `net.ipv4.tcp_syn_linear_timeouts`) after it had been told "could not", and its router
counted them as dials of a client (tests/chaos/test_behind_nat.py).

Failure semantics: the server's dial failing is an answer (`reachable` false, with the reason), not an
error; the caller's side (`ask_dial_back`) returns None when the prober did not answer at all, so the
caller can tell "nobody could reach me" from "nobody told me".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from swarmnode.net import rpc, snapshot_client
from swarmnode.proto.v1 import reachability_pb2 as pb
from swarmnode.proto.v1 import reachability_pb2_grpc as pb_grpc
from swarmnode.util.labels import ProbeResult
from swarmnode.util.ratelimit import TokenBuckets
from swarmnode.util.validate import is_node_id_hex

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0
"""The longest one dial-back (connect and `GetStatus`) may take."""
DIAL_BACK_BURST = 3
"""Dial-backs a caller host gets at once; then one more per `DIAL_BACK_REFILL_S`."""
DIAL_BACK_REFILL_S = 20.0
MAX_DIALS_IN_FLIGHT = 4
"""Dial-backs running at once, all callers together."""
MAX_TRACKED_CALLERS = 1024


@dataclass(frozen=True)
class DialBackAnswer:
    """What a prober said: whether it reached this node, and the host it saw this node call from."""

    reachable: bool
    observed_host: str
    reason: str = ""


def observed_host(peer: str) -> str | None:
    """The caller's bare host in a gRPC peer string ("ipv4:10.0.0.5:40312" -> "10.0.0.5", "ipv6:[::1]:5"
    -> "::1"); None for anything else (a unix socket has no host to dial)."""
    address = rpc.peer_address(peer)
    return address[1] if address is not None else None


def dial_target(host: str, port: int) -> str:
    """HOST:PORT as the gRPC client takes it (IPv6 hosts in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DialBackServicer:
    """`ReachabilityService` of one node. Register it with
    `snapshot_server.start_server(..., extra_servicers=[servicer.register])`."""

    def __init__(
        self,
        on_dial: Callable[[ProbeResult], None] | None = None,
        dial_timeout_s: float = DIAL_TIMEOUT_S,
        budget: TokenBuckets | None = None,
    ) -> None:
        """`on_dial(result)` counts each call: reachable, unreachable, throttled or invalid."""
        self._on_dial = on_dial
        self._dial_timeout_s = dial_timeout_s
        self._budget = budget or TokenBuckets(1 / DIAL_BACK_REFILL_S, DIAL_BACK_BURST, MAX_TRACKED_CALLERS)
        self._in_flight = 0

    def register(self, server: grpc.aio.Server) -> str:
        pb_grpc.add_ReachabilityServiceServicer_to_server(self, server)  # type: ignore[arg-type]
        return str(pb.DESCRIPTOR.services_by_name["ReachabilityService"].full_name)

    async def DialBack(self, request: pb.DialBackRequest, context: Any) -> pb.DialBackReply:
        host = observed_host(context.peer())
        if host is None or not 0 < request.port < 65536 or not is_node_id_hex(request.node_id):
            self._count(ProbeResult.INVALID)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad port or node id, or no host to dial")
        assert host is not None
        if self._in_flight >= MAX_DIALS_IN_FLIGHT or not self._budget.take(host):
            self._count(ProbeResult.THROTTLED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many dial-backs; ask later")
        self._in_flight += 1
        try:
            reason = await self._dial(host, request.port, request.node_id)
        finally:
            self._in_flight -= 1
        self._count(ProbeResult.UNREACHABLE if reason else ProbeResult.REACHABLE)
        return pb.DialBackReply(reachable=not reason, observed_host=host, reason=reason)

    async def _dial(self, host: str, port: int, node_id: str) -> str:
        """Why HOST:PORT is not the node `node_id` ("" when it answered as that node). New connections,
        never a cached channel: the probe must connect as any peer would. The TCP connection comes first
        and is ours (`connect_once`): when it fails, nothing of this dial is still on the wire."""
        target = dial_target(host, port)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._dial_timeout_s
        try:
            await connect_once(host, port, self._dial_timeout_s)
        except TimeoutError:
            return f"no answer at {target}: no connection within {self._dial_timeout_s:g} s"
        except OSError as exc:
            return f"no answer at {target}: {exc.strerror or exc}"
        try:  # it accepted a connection: gRPC's own connects at once
            status = await snapshot_client.get_status(target, max(deadline - loop.time(), 0.001))
        except (rpc.PeerUnavailable, ValueError) as exc:
            return f"no answer at {target}: {exc}"
        if status.node_id != node_id:
            return f"another node ({status.node_id[:12]}) answers at {target}"
        return ""

    def _count(self, result: ProbeResult) -> None:
        if self._on_dial is not None:
            self._on_dial(result)


async def connect_once(host: str, port: int, timeout_s: float) -> None:
    """Opens a TCP connection to HOST:PORT and closes it again; TimeoutError when none was made within
    `timeout_s`, OSError when it was refused or unroutable. Its socket is closed before it returns or
    raises (a timeout cancels the connect, which closes the socket): no SYN of it is sent afterwards."""
    async with asyncio.timeout(timeout_s):  # the connect's cancellation closes its socket
        _, writer = await asyncio.open_connection(host, port)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def ask_dial_back(
    prober: str, port: int, node_id: str, timeout_s: float, channels: rpc.ChannelCache | None = None
) -> DialBackAnswer | None:
    """Asks the peer at HOST:PORT `prober` to dial this node back at `port`; None when it did not
    answer (unreachable, throttled, an older node without the service)."""
    request = pb.DialBackRequest(port=port, node_id=node_id)
    try:
        async with rpc.peer_channel(prober, channels) as channel:
            reply = await pb_grpc.ReachabilityServiceStub(channel).DialBack(request, timeout=timeout_s)
    except (grpc.aio.AioRpcError, ValueError) as exc:
        logger.debug("dial-back probe by %s not answered: %s", prober, exc)
        return None
    return DialBackAnswer(reply.reachable, reply.observed_host, reply.reason)
