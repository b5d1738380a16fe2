"""`StateRangeService` (ranges.proto): a node's state as verifiable byte ranges, served and fetched.

The server answers from a `RangeProvider` (the node's, in swarm/recovery/range_source.py, reads its newest
snapshot at the asked outer step); it runs on the event loop and hands out immutable bytes there. It
bounds the ranges in flight (`MAX_RANGES_IN_FLIGHT` over all callers, `MAX_RANGES_PER_HOST` per caller
host or certificate node id) and answers RESOURCE_EXHAUSTED beyond; the server's guard (swarm token,
mutual TLS) covers these calls as it covers FetchSnapshot.

A manifest is signed by the serving node's identity key (`RangeManifest.signed`): the roots of both
blobs, the snapshot id, the step and the metadata's hash. A reader takes a manifest only from the node
its announcement names (`RangeManifest.signed_by`), so the node part and metadata, which no other peer
vouches for, are bound to that node's identity as a whole snapshot is bound to its signed id, and
nobody on the path can swap them.

The client returns typed values and raises `PeerUnavailable` with a reason for anything a peer did:
an unreachable or refusing peer, a malformed manifest, a range of the wrong size. Whether a range's
bytes are right is the caller's check (`RangeList.check`), as is which root to trust.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc

from swarmnode.net import rpc
from swarmnode.net.identity import Identity, node_id_from_public_key, verify_signature
from swarmnode.net.snapshot_server import peer_key
from swarmnode.proto.v1 import ranges_pb2 as pb
from swarmnode.proto.v1 import ranges_pb2_grpc as pb_grpc
from swarmnode.snapshot.ranges import EncodedRange, RangeError, RangeList
from swarmnode.util.labels import FetchFailure
from swarmnode.util.validate import is_sha256_hex

logger = logging.getLogger(__name__)

MAX_RANGES_IN_FLIGHT = 8
MAX_RANGES_PER_HOST = 4
"""A recovering node asks each peer for a few ranges at once (range_fetch.STREAMS_PER_PEER)."""
MAX_METADATA_CHARS = 1 << 20
MANIFEST_DOMAIN = b"swarmnode-range-manifest\x00"


@dataclass(frozen=True)
class RangeManifest:
    """A node's state at one outer step as ranges: the shared part, its own node part, and the
    metadata of the snapshot they were read from."""

    outer_step: int
    snapshot_id: str
    shared: RangeList
    node: RangeList
    metadata_json: str
    public_key: bytes = b""
    """The signer's raw Ed25519 public key (empty: unsigned)."""
    signature: bytes = b""

    def message(self) -> bytes:
        """What the serving node signs: everything a reader takes from this manifest."""
        metadata = hashlib.sha256(self.metadata_json.encode()).hexdigest()
        fields = (str(self.outer_step), self.snapshot_id, self.shared.root, self.node.root, metadata)
        return MANIFEST_DOMAIN + "\x00".join(fields).encode()

    def signed(self, identity: Identity) -> RangeManifest:
        return replace(self, public_key=identity.public_key, signature=identity.sign(self.message()))

    def signed_by(self, node_id_hex: str) -> bool:
        """Whether the node `node_id_hex` (the one whose announcement led here) signed this manifest."""
        if node_id_from_public_key(self.public_key).hex() != node_id_hex:
            return False
        return verify_signature(self.public_key, self.signature, self.message())

    def to_pb(self) -> pb.RangeManifest:
        return pb.RangeManifest(
            outer_step=self.outer_step,
            snapshot_id=self.snapshot_id,
            shared=_list_to_pb(self.shared),
            node=_list_to_pb(self.node),
            metadata_json=self.metadata_json,
            public_key=self.public_key,
            signature=self.signature,
        )

    @classmethod
    def from_pb(cls, msg: pb.RangeManifest) -> RangeManifest:
        """Raises RangeError when a range list is malformed or the metadata oversized."""
        if len(msg.metadata_json) > MAX_METADATA_CHARS:
            raise RangeError(f"metadata of {len(msg.metadata_json)} characters")
        if not is_sha256_hex(msg.snapshot_id):
            raise RangeError("the snapshot id is not a sha256 hex digest")
        return cls(
            msg.outer_step,
            msg.snapshot_id,
            _list_from_pb(msg.shared),
            _list_from_pb(msg.node),
            msg.metadata_json,
            msg.public_key,
            msg.signature,
        )


def _list_to_pb(ranges: RangeList) -> pb.RangeList:
    return pb.RangeList(total_bytes=ranges.total_bytes, range_bytes=ranges.range_bytes, hashes=ranges.packed)


def _list_from_pb(msg: pb.RangeList) -> RangeList:
    return RangeList.from_wire(msg.total_bytes, msg.range_bytes, msg.hashes)


class RangeProvider(Protocol):
    async def manifest(self, outer_step: int) -> RangeManifest | None:
        """The manifest at `outer_step` (None: no snapshot at that step is served here)."""
        ...

    async def range(self, root: str, index: int) -> EncodedRange | None:
        """Range `index` of the blob named `root` as it goes on the wire (None: not held now);
        RangeError for a bad index. Called on the event loop: any real work goes to a worker thread."""
        ...


RangeFilter = Callable[[int, EncodedRange], Awaitable[EncodedRange]]
"""Test-only: maps each served range's (index, (encoding, bytes)) to what is sent instead (a liar)."""


class StateRangeServicer:
    """`StateRangeService` over a provider. Register it with
    `snapshot_server.start_server(..., extra_servicers=[servicer.register])`."""

    def __init__(
        self,
        provider: RangeProvider,
        identity: Identity | None,
        on_served: Callable[[int], None] | None = None,
        range_filter: RangeFilter | None = None,
    ) -> None:
        """`identity` signs the manifests (None: unsigned, which a reader refuses; tests of the
        service alone); `on_served(nbytes)` counts each range served."""
        self._provider, self._identity = provider, identity
        self._on_served, self._filter = on_served, range_filter
        self._in_flight = 0
        self._per_host: Counter[str] = Counter()

    def register(self, server: grpc.aio.Server) -> str:
        pb_grpc.add_StateRangeServiceServicer_to_server(self, server)  # type: ignore[arg-type]
        return str(pb.DESCRIPTOR.services_by_name["StateRangeService"].full_name)

    async def GetRangeManifest(self, request: pb.GetRangeManifestRequest, context: Any) -> pb.RangeManifest:
        manifest = await self._provider.manifest(request.outer_step)
        if manifest is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no snapshot at outer step {request.outer_step}")
        assert manifest is not None
        if self._identity is not None:
            manifest = manifest.signed(self._identity)
        return manifest.to_pb()

    async def FetchRange(self, request: pb.FetchRangeRequest, context: Any) -> pb.FetchRangeReply:
        host = peer_key(context)
        if self._in_flight >= MAX_RANGES_IN_FLIGHT or self._per_host[host] >= MAX_RANGES_PER_HOST:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many ranges in flight; ask later")
        self._in_flight += 1
        self._per_host[host] += 1
        try:
            encoding, data = await self._range(request, context)
        finally:
            self._in_flight -= 1
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]
        if self._on_served is not None:
            self._on_served(len(data))
        return pb.FetchRangeReply(data=data, encoding=encoding)

    async def _range(self, request: pb.FetchRangeRequest, context: Any) -> EncodedRange:
        try:
            data = await self._provider.range(request.root, request.index)
        except RangeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"blob {request.root[:12]} is not held here")
        assert data is not None
        return await self._filter(request.index, data) if self._filter is not None else data


async def get_range_manifest(
    address: str, outer_step: int, timeout_s: float, channels: rpc.ChannelCache | None = None
) -> RangeManifest:
    """A peer's manifest at `outer_step` (it may take the peer a second to read its snapshot). Raises
    PeerUnavailable (INVALID: malformed)."""
    request = pb.GetRangeManifestRequest(outer_step=outer_step)
    async with rpc.peer_channel(address, channels) as channel:
        try:
            reply = await pb_grpc.StateRangeServiceStub(channel).GetRangeManifest(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc.PeerUnavailable(_reason(exc), f"{address}: {exc.details()}") from None
    try:
        return RangeManifest.from_pb(reply)
    except RangeError as exc:
        raise rpc.PeerUnavailable(FetchFailure.INVALID, f"{address}: manifest: {exc}") from None


async def fetch_range(
    address: str, root: str, index: int, timeout_s: float, channels: rpc.ChannelCache | None = None
) -> EncodedRange:
    """Range `index` of blob `root` from a peer as (encoding, bytes), undecoded and unverified
    (`ranges.decode_range`, `RangeList.check`). Raises PeerUnavailable."""
    request = pb.FetchRangeRequest(root=root, index=index)
    async with rpc.peer_channel(address, channels) as channel:
        try:
            reply = await pb_grpc.StateRangeServiceStub(channel).FetchRange(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc.PeerUnavailable(_reason(exc), f"{address}: {exc.details()}") from None
    return reply.encoding, reply.data


def _reason(exc: grpc.aio.AioRpcError) -> FetchFailure:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return FetchFailure.TIMEOUT
    if code == grpc.StatusCode.UNAVAILABLE:
        return FetchFailure.UNREACHABLE
    return FetchFailure.REFUSED
