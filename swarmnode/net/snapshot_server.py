"""gRPC snapshot server (the contract is snapshot.proto): serves complete snapshots and a node's live status.

The server runs on the node's event loop (`grpc.aio`) and serves only complete snapshots that its
catalog lists; file reads happen on a reader thread, never on the loop.

The server sends data chunks pre-encoded in protobuf wire format (`encode_data_chunk`, built on the
reader thread) instead of building and serialising a `FetchSnapshotChunk`, a third of the server's CPU;
clients see the generated message. A reader thread per stream (4 chunks ahead) lets a test fault block
without holding the pool. docs/benchmarks.md "Component measurements" has the figures.

A peer that stops reading cannot pin a serving slot (`StreamLimits`). A client that stops reading lets
a few more chunk writes complete (its HTTP/2 windows, grown by BDP probing, plus the socket buffers),
then the next `context.write` blocks. The windows never grew without bound, so a stall shows as a write
that does not complete and no channel option is needed; the total-time bound covers a peer whose
window is large or that reads just enough. So each write runs under `asyncio.timeout` (an async
generator's `yield` cannot be bounded: gRPC sends outside it). A stalled stream ends
DEADLINE_EXCEEDED by setting the code and returning, never `context.abort`: the status queues behind
the unread data either way, and abort waits for it. The slot, the reader thread and the file are freed
at once; the call itself (the message in flight) lives in gRPC until the peer reads, cancels or
disconnects, since grpc.aio cannot reset one stream. Initial metadata goes out first on its own: gRPC
cannot finish a call whose first write, which carries it, was cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from swarmnode.net.rpc import (
    CHUNK_BYTES,
    SERVER_OPTIONS,
    SNAPSHOT_SERVICE,
    NodeStatus,
    ServeFaults,
    SnapshotMeta,
    encode_data_chunk,
    meta_to_pb,
    peer_address,
    serialize,
    status_to_pb,
)
from swarmnode.net.security import Security, ServerGuard, authenticated_node_id
from swarmnode.proto.v1 import snapshot_pb2 as pb
from swarmnode.proto.v1 import snapshot_pb2_grpc as pb_grpc
from swarmnode.snapshot.format import SnapshotInfo

logger = logging.getLogger(__name__)

READ_AHEAD_CHUNKS = 4
"""Chunks a serving stream's reader thread may read ahead of what gRPC has taken."""

StatusProvider = Callable[[], NodeStatus]
"""Returns the node's current status; called on the event loop, so it must be cheap."""

StallReason = Literal["idle", "slow"]
"""Why a snapshot stream was ended: a write waited `StreamLimits.idle_s` for a peer that does not read,
or the stream ran past its minimum rate."""


@dataclass(frozen=True)
class StreamLimits:
    """How long one snapshot stream may hold its serving slot; past either bound the server ends it
    DEADLINE_EXCEEDED and frees the slot. The defaults are the floor of our own client
    (snapshot_client.MIN_TRANSFER_S, MIN_RATE_BYTES_S, its 10 s per-chunk deadline), with room to spare."""

    idle_s: float = 30.0
    """Longest one message may wait for the peer to take it (HTTP/2 flow control: it stopped reading);
    a 1 MiB chunk at the minimum rate takes 4 s."""
    min_s: float = 60.0
    min_rate_bytes_s: float = 256 << 10
    """A stream may take `min_s` plus its bytes at this rate, no longer (checked at each write)."""

    def __post_init__(self) -> None:
        for name in ("idle_s", "min_s", "min_rate_bytes_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def stream_s(self, nbytes: int) -> float:
        """The most a stream of `nbytes` may take."""
        return self.min_s + nbytes / self.min_rate_bytes_s


class SnapshotCatalog(Protocol):
    """The snapshots a node serves. Called on the event loop: both methods must be cheap (in memory)."""

    def list_snapshots(self) -> list[SnapshotInfo]:
        """Complete snapshots only, in any order (the server sorts them newest first)."""
        ...

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        """The complete snapshot with this id (None: the newest), or None if it is not served."""
        ...


def _newest_first(infos: Sequence[SnapshotInfo]) -> list[SnapshotInfo]:
    return sorted(infos, key=lambda i: (i.outer_step, i.inner_step, i.created_at), reverse=True)


class _FileChanged(Exception):
    """The file behind a served snapshot vanished or changed; `code` is the status to end with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ChunkReader:
    """Reads bytes [start, stop) of a snapshot file in `CHUNK_BYTES` pieces on its own thread, at
    most `READ_AHEAD_CHUNKS` ahead of the consumer, so disk reads overlap sends and never block
    the event loop; yields each piece already encoded as a `FetchSnapshotChunk`. The file is opened
    once: a snapshot deleted mid-stream is still served whole."""

    def __init__(
        self, info: SnapshotInfo, start: int, stop: int, chunk_filter: Callable[[int, bytes], bytes] | None
    ) -> None:
        self._info, self._start, self._stop, self._filter = info, start, stop, chunk_filter
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self._credits = threading.Semaphore(READ_AHEAD_CHUNKS)
        self._closed = False

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """Yields the encoded chunks in order; raises `_FileChanged` if the file is gone or changed."""
        threading.Thread(target=self._run, name="snapshot-reader", daemon=True).start()
        try:
            while (item := await self._queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                self._credits.release()
                yield item
        finally:
            self._closed = True
            self._credits.release()  # wakes the thread if it waits for room, so it can exit

    def _run(self) -> None:
        try:
            with open(self._info.path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != self._info.size_bytes:
                    raise _FileChanged(grpc.StatusCode.ABORTED, "snapshot file changed on disk")
                self._read_all(f.fileno())
            self._deliver(None)
        except FileNotFoundError:
            self._deliver(_FileChanged(grpc.StatusCode.NOT_FOUND, "snapshot file is no longer on disk"))
        except OSError as exc:
            self._deliver(_FileChanged(grpc.StatusCode.ABORTED, f"cannot read snapshot file: {exc}"))
        except _FileChanged as exc:
            self._deliver(exc)

    def _read_all(self, fd: int) -> None:
        for offset in range(self._start, self._stop, CHUNK_BYTES):
            self._credits.acquire()
            if self._closed:
                return
            wanted = min(CHUNK_BYTES, self._stop - offset)
            data = os.pread(fd, wanted, offset)
            if len(data) != wanted:
                raise _FileChanged(grpc.StatusCode.ABORTED, "snapshot file shrank while being served")
            if self._filter is not None:
                data = self._filter(offset, data)
            self._deliver(encode_data_chunk(offset, data))

    def _deliver(self, item: bytes | Exception | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._closed = True


class _Stalled(Exception):
    """The peer did not take a message in time; `reason` says which bound it crossed."""

    def __init__(self, reason: StallReason, message: str) -> None:
        super().__init__(message)
        self.reason: StallReason = reason


class _BoundedWriter:
    """Writes one stream's messages, each within `idle_s` and all within the stream's total time;
    raises `_Stalled` when a write does not complete in time."""

    def __init__(self, context: Any, limits: StreamLimits, nbytes: int) -> None:
        self._context, self._idle_s, self._total_s = context, limits.idle_s, limits.stream_s(nbytes)
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + self._total_s

    async def start(self) -> None:
        await self._bounded(self._context.send_initial_metadata(()))

    async def write(self, message: bytes | pb.FetchSnapshotChunk) -> None:
        await self._bounded(self._context.write(message))

    async def _bounded(self, sending: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(min(self._idle_s, self._deadline - self._loop.time())):
                await sending
        except TimeoutError:
            if self._loop.time() >= self._deadline:
                raise _Stalled(
                    "slow", f"the stream ran below the minimum rate ({self._total_s:.1f} s)"
                ) from None
            raise _Stalled("idle", f"the peer took no data for {self._idle_s:g} s") from None


def peer_host(peer: str) -> str:
    """The caller's address without its port, scheme kept ("ipv4:10.0.0.5:40312" -> "ipv4:10.0.0.5",
    "ipv6:[::1]:5" -> "ipv6:[::1]"; a peer with no host, as it is): streams are limited per host, since
    one machine can open connections from any number of ports."""
    address = peer_address(peer)
    if address is None:
        return peer
    scheme, host = address
    return f"{scheme}:[{host}]" if scheme == "ipv6" else f"{scheme}:{host}"


def peer_key(context: Any) -> str:
    """Whom the per-peer serving limit counts a stream against: the node id its TLS client certificate
    names (many volunteers share one NAT address), else its host (`peer_host`)."""
    node_id = authenticated_node_id(context)
    return f"node:{node_id}" if node_id is not None else peer_host(context.peer())


class _SnapshotServicer(pb_grpc.SnapshotServiceServicer):
    """`SnapshotService` over a catalog and a status provider (see the .proto for the contract)."""

    def __init__(
        self,
        catalog: SnapshotCatalog,
        status: StatusProvider,
        max_serving: int,
        on_served: Callable[[str], None] | None,
        faults: ServeFaults,
        max_per_peer: int,
        limits: StreamLimits,
        on_stalled: Callable[[StallReason], None] | None,
    ) -> None:
        self._catalog, self._status, self._max_serving = catalog, status, max_serving
        self._on_served, self._faults, self._max_per_peer = on_served, faults, max_per_peer
        self._limits, self._on_stalled = limits, on_stalled
        self._serving = 0
        self._per_peer: Counter[str] = Counter()
        self._stalled_peers: set[str] = set()  # hosts whose stall was logged already
        self._cuts_left = faults.cut_streams

    async def ListSnapshots(self, request: pb.ListSnapshotsRequest, context: Any) -> pb.ListSnapshotsResponse:
        infos = _newest_first(self._catalog.list_snapshots())
        return pb.ListSnapshotsResponse(snapshots=[meta_to_pb(i) for i in infos])

    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.NodeStatus:
        served = tuple(SnapshotMeta.from_info(i) for i in _newest_first(self._catalog.list_snapshots()))
        return status_to_pb(dataclasses.replace(self._status(), snapshots=served))

    async def FetchSnapshot(self, request: pb.FetchSnapshotRequest, context: Any) -> None:
        info = await self._admit(request, context)
        stop = self._stop_offset(info, request.offset)
        peer = peer_key(context)
        self._serving += 1
        self._per_peer[peer] += 1
        try:
            completed = await self._send(info, request.offset, stop, context, peer)
        finally:
            self._serving -= 1
            self._per_peer[peer] -= 1
            if not self._per_peer[peer]:
                del self._per_peer[peer]
        if completed and stop == info.size_bytes and self._on_served is not None:
            self._on_served(info.snapshot_id)

    async def _send(self, info: SnapshotInfo, start: int, stop: int, context: Any, peer: str) -> bool:
        """Streams bytes [start, stop) of the snapshot; False if the stream ended early with a status
        (set, not aborted: an abort would wait behind data that a stalled peer never takes)."""
        writer = _BoundedWriter(context, self._limits, stop - start)
        reader = _ChunkReader(info, start, stop, self._faults.chunk_filter)
        try:
            await writer.start()
            await writer.write(pb.FetchSnapshotChunk(meta=meta_to_pb(info), offset=start))
            async with contextlib.aclosing(reader.chunks()) as chunks:
                async for encoded in chunks:
                    await writer.write(encoded)
        except _FileChanged as exc:
            logger.warning("stopped serving snapshot %s: %s", info.snapshot_id[:12], exc)
            _end(context, exc.code, f"snapshot {info.snapshot_id}: {exc}")
            return False
        except _Stalled as exc:
            self._stalled(peer, info, exc)
            _end(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"snapshot {info.snapshot_id}: {exc}")
            return False
        return True

    def _stalled(self, peer: str, info: SnapshotInfo, exc: _Stalled) -> None:
        """Counts a stalled stream; logs it once per peer host."""
        if peer not in self._stalled_peers:
            self._stalled_peers.add(peer)
            logger.warning(
                "ended the snapshot %s stream to %s: %s (its slot is free; later stalls of this host "
                "are counted, not logged)",
                info.snapshot_id[:12],
                peer,
                exc,
            )
        if self._on_stalled is not None:
            self._on_stalled(exc.reason)

    async def _admit(self, request: pb.FetchSnapshotRequest, context: Any) -> SnapshotInfo:
        """The requested snapshot if this stream may serve it; otherwise aborts the call."""
        wanted = None if request.snapshot_id in ("", "latest") else request.snapshot_id
        info = self._catalog.find(wanted)
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"snapshot {wanted or 'latest'} not served here")
        elif request.offset > info.size_bytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"offset {request.offset} beyond size {info.size_bytes}"
            )
        elif self._serving >= self._max_serving:
            logger.info("refused a snapshot stream: %d/%d busy", self._serving, self._max_serving)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"serving {self._serving}/{self._max_serving} snapshot streams; try another peer or later",
            )
        elif self._per_peer[peer_key(context)] >= self._max_per_peer:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"already serving {self._max_per_peer} snapshot stream(s) to your address; one at a time",
            )
        assert info is not None
        return info

    def _stop_offset(self, info: SnapshotInfo, start: int) -> int:
        """Where this stream ends: the file's end unless a test fault cuts it short."""
        cut = self._faults.cut_at_offset
        if cut is None or self._cuts_left == 0:
            return info.size_bytes
        if self._cuts_left is not None:
            self._cuts_left -= 1
        return max(start, min(cut, info.size_bytes))


def _end(context: Any, code: grpc.StatusCode, details: str) -> None:
    """Ends the call with this status once the handler returns."""
    context.set_code(code)
    context.set_details(details)


class RpcServer:
    """A running gRPC server: `port` is the bound port, `stop()` shuts it down."""

    def __init__(self, server: grpc.aio.Server, port: int, health: HealthServicer) -> None:
        self._server, self.port, self._health = server, port, health

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Reports NOT_SERVING, then stops; calls still running after `grace_s` are cancelled."""
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)


async def start_server(
    host: str,
    port: int,
    catalog: SnapshotCatalog,
    status: StatusProvider,
    *,
    max_serving: int = 2,
    max_serving_per_peer: int | None = None,
    on_served: Callable[[str], None] | None = None,
    extra_servicers: Sequence[Callable[[grpc.aio.Server], str | None]] = (),
    faults: ServeFaults | None = None,
    security: Security | None = None,
    on_rejected: Callable[[str], None] | None = None,
    limits: StreamLimits | None = None,
    on_stalled: Callable[[StallReason], None] | None = None,
) -> RpcServer:
    """Starts `SnapshotService`, the standard health service and server reflection (so grpcurl and
    Postman call the API without the .proto files), plus `extra_servicers` (each given the server to
    register on; the service name it returns is reported SERVING and reflected too), on host:port (port
    0: a free one). At most `max_serving` snapshot
    streams run at once; `on_served(id)` is called after each stream that reached a file's end.
    A stream that crosses `limits` (default `StreamLimits()`) ends DEADLINE_EXCEEDED, its slot freed,
    and `on_stalled(reason)` counts it. With `security`, it serves TLS and/or refuses calls without
    the swarm token or a client certificate (`on_rejected("unauthenticated")` counts them). Raises
    OSError if the address cannot be bound (errno EADDRINUSE when another socket holds the port: the
    port is never shared, SO_REUSEPORT is off)."""
    if max_serving < 1:
        raise ValueError(f"max_serving must be at least 1, got {max_serving}")
    security = security or Security()
    _check_bindable(host, port)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[ServerGuard(security, on_rejected)])
    per_peer = max_serving if max_serving_per_peer is None else max_serving_per_peer
    servicer = _SnapshotServicer(
        catalog,
        status,
        max_serving,
        on_served,
        faults or ServeFaults(),
        per_peer,
        limits or StreamLimits(),
        on_stalled,
    )
    _register_snapshot_service(servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = [SNAPSHOT_SERVICE, *filter(None, (register(server) for register in extra_servicers))]
    names = (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = _bind(server, host, port, security.server_credentials())
    await server.start()
    for name in services:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("gRPC server listening on %s:%d", host, bound)
    return RpcServer(server, bound, health)


def _register_snapshot_service(servicer: _SnapshotServicer, server: grpc.aio.Server) -> None:
    """What `add_SnapshotServiceServicer_to_server` does, except that FetchSnapshot's data chunks
    arrive pre-encoded (`encode_data_chunk`); the wire format is the generated one."""
    handlers = {
        "ListSnapshots": grpc.unary_unary_rpc_method_handler(
            servicer.ListSnapshots,
            request_deserializer=pb.ListSnapshotsRequest.FromString,
            response_serializer=pb.ListSnapshotsResponse.SerializeToString,
        ),
        "FetchSnapshot": grpc.unary_stream_rpc_method_handler(
            servicer.FetchSnapshot,
            request_deserializer=pb.FetchSnapshotRequest.FromString,
            response_serializer=serialize,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus,
            request_deserializer=pb.GetStatusRequest.FromString,
            response_serializer=pb.NodeStatus.SerializeToString,
        ),
    }
    assert set(handlers) == set(pb.DESCRIPTOR.services_by_name["SnapshotService"].methods_by_name)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SNAPSHOT_SERVICE, handlers),))
    server.add_registered_method_handlers(SNAPSHOT_SERVICE, handlers)


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    address = _address(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        _check_bindable(host, port)  # taken since the first check: say so with its errno
        raise OSError(f"cannot listen for gRPC on {address}: {exc}") from exc
    if bound == 0:
        _check_bindable(host, port)
        raise OSError(f"cannot listen for gRPC on {address}")
    return int(bound)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _check_bindable(host: str, port: int) -> None:
    """Raises the OSError (EADDRINUSE, EACCES, ...) of binding host:port if no address it resolves to
    can be bound now. Probed with a socket of our own because gRPC's failure carries no errno (only
    "Failed to bind", and a line of its own on stderr). Port 0 and unresolvable hosts are left to gRPC."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    refusal: OSError | None = None
    for family, kind, proto, _, sockaddr in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                probe.bind(sockaddr)
                return
        except OSError as exc:
            refusal = refusal or exc
    if refusal is not None:
        raise OSError(refusal.errno, f"cannot listen for gRPC on {_address(host, port)}: {refusal.strerror}")
