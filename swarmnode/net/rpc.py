"""gRPC transport, the part both sides share (the contract is protos/swarmnode/v1): message limits and channel
options, the snapshot and status messages as Python values and their protobuf conversions, the data
chunk encoding, a client channel factory and the errors a peer's failure comes back as.

`snapshot_server.py` serves snapshots and a node's live status; `snapshot_client.py` fetches them. Both import
this module, never each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from swarmnode.net.security import Security, credential_interceptors
from swarmnode.proto.v1 import snapshot_pb2 as pb
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.util.errors import PeerFault
from swarmnode.util.labels import FetchFailure
from swarmnode.util.validate import parse_host_port

CHUNK_BYTES = 1 << 20
"""Data bytes per stream message: the fastest size for protobuf streams (docs/benchmarks.md "Component
measurements")."""
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES + 64 * 1024
"""Largest message either side sends or accepts; leaves room for larger averaging parts later."""
SNAPSHOT_SERVICE = "swarmnode.v1.SnapshotService"

_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *_KEEPALIVE_OPTIONS,
]
SERVER_OPTIONS = [
    *_COMMON_OPTIONS,
    # Peers' keepalive pings (every 30 s) are welcome: at gRPC's default (5 min) the third ping is a
    # strike and the server sends GOAWAY "too_many_pings", failing the calls in flight on that
    # connection (it cost an all-reduce part about once a minute on cached channels). The argument's
    # name is gRPC's `GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS`.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # A client's BDP-probe pings (sent as results stream in) came within that interval of its keepalive
    # pings: after 2 such "strikes" the server sent GOAWAY too_many_pings and the next round's call on
    # the cached channel failed UNAVAILABLE (seen in `bench allreduce --trust`). Strikes off.
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),  # gRPC's default lets a second process bind the port and take half the calls
]
_RECONNECT_OPTIONS = [
    # A cached channel to a peer that was away (stopped, restarted, partitioned) reconnects within a
    # fraction of a round, not after gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # gRPC takes this as the least time a connection attempt (TCP, TLS handshake, HTTP/2 SETTINGS) is
    # given, not as a backoff: at 100 ms, TLS handshakes of a loaded machine (or of any peer more than
    # ~50 ms away) timed out ("connection attempt timed out before receiving SETTINGS frame").
    ("grpc.min_reconnect_backoff_ms", 5_000),
]
CLIENT_OPTIONS = [*_COMMON_OPTIONS, *_RECONNECT_OPTIONS, ("grpc.enable_retries", 0)]


# ---------------------------------------------------------------------------------------------------
# Messages as Python values


@dataclass(frozen=True)
class SnapshotMeta:
    """What a peer announces about one snapshot it serves (a `SnapshotInfo` without the local path)."""

    snapshot_id: str
    """sha256 hex of the whole file."""
    size_bytes: int
    outer_step: int
    inner_step: int
    kind: str
    """"hot" | "cold"."""
    created_at: float
    """Unix seconds."""
    layout: str
    """Tensor layout inside the file, "planes" | "plain" (`codec` on the wire)."""
    run_id: str
    node_id: str

    @classmethod
    def from_info(cls, info: SnapshotInfo) -> SnapshotMeta:
        return cls(**{f.name: getattr(info, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class CursorStatus:
    """A node's data cursor: which batches of which shard it has consumed."""

    shard: int
    epoch: int
    position: int


@dataclass(frozen=True)
class NodeStatus:
    """A node's live state as `GetStatus` reports it. Fields added later get defaults, so both old
    status providers and answers from older peers keep working."""

    node_id: str
    run_id: str
    phase: str = "starting"
    uptime_s: float = 0.0
    outer_step: int = 0
    inner_step: int = 0
    last_loss: float | None = None
    tokens_per_s: float = 0.0
    cursor: CursorStatus | None = None
    snapshots: tuple[SnapshotMeta, ...] = ()
    """What the node serves, newest first. The server fills this from its catalog."""
    peers: int = 0
    global_digest: str = ""
    last_group: tuple[str, ...] = ()
    last_coverage: float | None = None
    last_allreduce_s: float | None = None
    repairs: int = 0
    reachability: str = ""
    """"reachable" or "client" (docs/design.md "Behind NAT"); "" from an older node."""
    snapshot_error: str = ""
    """"" while the node's snapshots are written; else why its newest state is not on disk."""
    run_settings: str = ""
    """The settings its run digest hashes, as JSON (`training.run_settings`); "" from an older node."""


def meta_to_pb(meta: SnapshotMeta | SnapshotInfo) -> pb.SnapshotMeta:
    return pb.SnapshotMeta(
        snapshot_id=meta.snapshot_id,
        size_bytes=meta.size_bytes,
        outer_step=meta.outer_step,
        inner_step=meta.inner_step,
        kind=meta.kind,
        created_at=meta.created_at,
        codec=meta.layout,
        run_id=meta.run_id,
        node_id=meta.node_id,
    )


def meta_from_pb(msg: pb.SnapshotMeta) -> SnapshotMeta:
    return SnapshotMeta(
        snapshot_id=msg.snapshot_id,
        size_bytes=msg.size_bytes,
        outer_step=msg.outer_step,
        inner_step=msg.inner_step,
        kind=msg.kind,
        created_at=msg.created_at,
        layout=msg.codec,
        run_id=msg.run_id,
        node_id=msg.node_id,
    )


_OPTIONAL_STATUS_FIELDS = ("last_loss", "last_coverage", "last_allreduce_s")
_PLAIN_STATUS_FIELDS = (
    *("node_id", "run_id", "phase", "uptime_s", "outer_step", "inner_step"),
    *("tokens_per_s", "peers", "global_digest", "repairs", "reachability", "snapshot_error"),
    "run_settings",
)


def status_to_pb(status: NodeStatus) -> pb.NodeStatus:
    msg = pb.NodeStatus(
        snapshots=[meta_to_pb(m) for m in status.snapshots],
        last_group=list(status.last_group),
        **{name: getattr(status, name) for name in _PLAIN_STATUS_FIELDS},
    )
    for name in _OPTIONAL_STATUS_FIELDS:
        if getattr(status, name) is not None:
            setattr(msg, name, getattr(status, name))
    if status.cursor is not None:
        msg.cursor.CopyFrom(pb.DataCursor(**dataclasses.asdict(status.cursor)))
    return msg


def status_from_pb(msg: pb.NodeStatus) -> NodeStatus:
    fields: dict[str, Any] = {name: getattr(msg, name) for name in _PLAIN_STATUS_FIELDS}
    fields.update({name: getattr(msg, name) for name in _OPTIONAL_STATUS_FIELDS if msg.HasField(name)})
    if msg.HasField("cursor"):
        fields["cursor"] = CursorStatus(msg.cursor.shard, msg.cursor.epoch, msg.cursor.position)
    return NodeStatus(
        snapshots=tuple(meta_from_pb(m) for m in msg.snapshots), last_group=tuple(msg.last_group), **fields
    )


@dataclass(frozen=True)
class ServeFaults:
    """Test-only misbehaviour of a snapshot server; the defaults leave it inert."""

    chunk_filter: Callable[[int, bytes], bytes] | None = None
    """Maps each data chunk's (offset, bytes) to the bytes sent instead. Runs on the stream's reader
    thread, so it may block (tests hold streams open that way)."""
    cut_at_offset: int | None = None
    """Streams end early, with an OK status, once they reach this byte offset: a truncating peer."""
    cut_streams: int | None = None
    """How many streams `cut_at_offset` applies to (None: all). With 1 the break heals on resume."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_data_chunk(offset: int, data: bytes | memoryview, trailer: bytes = b"") -> bytes:
    """`FetchSnapshotChunk(offset=offset, data=data)` in protobuf wire format, built with a single copy
    of `data` (building the message and serialising it copies twice; see `snapshot_server`'s notes);
    `trailer`: further fields, already encoded, appended in the same copy."""
    return b"".join((b"\x10", _varint(offset), b"\x1a", _varint(len(data)), data, trailer))


def peer_address(peer: str) -> tuple[str, str] | None:
    """(scheme, host) of a gRPC peer string ("ipv4:10.0.0.5:40312" -> ("ipv4", "10.0.0.5"), "ipv6:[::1]:5"
    -> ("ipv6", "::1"): the host without its port or brackets); None for anything else (a unix socket
    has no host)."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    host = rest.rsplit(":", 1)[0]
    return scheme, host[1:-1] if host.startswith("[") and host.endswith("]") else host


# ---------------------------------------------------------------------------------------------------
# Errors and channels


class PeerUnavailable(PeerFault):
    """A peer could not answer, for `reason`."""

    def __init__(self, reason: FetchFailure, detail: str) -> None:
        super().__init__(FetchFailure(reason), detail)


class SnapshotUnavailable(PeerUnavailable):
    """A snapshot could not be fetched (or listed) from a peer; nothing was kept on disk."""


def _check_address(address: str) -> str:
    """Returns `address` if it is HOST:PORT; raises ValueError (bad user input) otherwise."""
    try:
        parse_host_port(address)
    except ValueError:
        raise ValueError(f"peer address must be HOST:PORT, got {address!r}") from None
    return address


def serialize(message: bytes | Any) -> bytes:
    """A message for a gRPC stream whose data chunks come pre-encoded (`encode_data_chunk`)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


_client_security = Security()


def configure_client(security: Security) -> None:
    """The TLS credentials and swarm token every outgoing call of this process uses (one node, one
    identity: set once at start, before any call)."""
    global _client_security
    _client_security = security


def client_security() -> Security:
    """What `configure_client` set (no TLS, no token until then)."""
    return _client_security


def open_channel(address: str) -> grpc.aio.Channel:
    """A client channel to a peer's HOST:PORT with the swarm's message limits, keepalive, TLS and token
    (other services' clients use it too). Raises ValueError for a malformed address."""
    target = _check_address(address)
    security = _client_security
    interceptors = credential_interceptors(security) or None
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=CLIENT_OPTIONS, interceptors=interceptors)


class ChannelCache:
    """Client channels reused per peer address, so a node opens one connection (and does one TLS
    handshake) per peer instead of one per exchange, proposal and status call. gRPC channels reconnect
    by themselves when a peer comes back; the least recently used beyond `limit` are closed, and
    `close` ends them all (a node's shutdown). Bound to the event loop that uses it."""

    def __init__(self, limit: int = 128) -> None:
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._limit = limit
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to HOST:PORT (ValueError if malformed), opened the first time it is asked for."""
        channel = self._channels.pop(address, None) or open_channel(address)
        self._channels[address] = channel
        while len(self._channels) > self._limit:
            _, oldest = self._channels.popitem(last=False)
            task = asyncio.get_running_loop().create_task(oldest.close(grace=1.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), OrderedDict()
        await asyncio.gather(*(c.close(grace=0.5) for c in channels), *self._closing, return_exceptions=True)


@contextlib.asynccontextmanager
async def peer_channel(address: str, channels: ChannelCache | None) -> AsyncIterator[grpc.aio.Channel]:
    """The cached channel to `address` when a cache is given (left open), else one for this call only."""
    if channels is not None:
        yield channels.get(address)
        return
    async with open_channel(address) as channel:
        yield channel
