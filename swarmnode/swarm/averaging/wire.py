"""What the averaging service puts on the wire (docs/design.md "The swarm" and averaging.proto): the
`Exchange` call's messages and the group spec in its protobuf and JSON forms. A part of n values
travels as one byte image (its codecs are `codecs.py`), cut into chunks of at most `CHUNK_BYTES`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from swarmnode.core import topk_layout
from swarmnode.net.dht_records import MAX_RECORD_BYTES
from swarmnode.net.rpc import CHUNK_BYTES, encode_data_chunk
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.proto.v1 import snapshot_pb2 as snapshot_pb
from swarmnode.util.validate import parse_cursor, parse_host_port

WIRE_DTYPES = ("fp32", "bf16", "int8", "int4", "topk")
"""The wire dtypes a user picks (--wire-dtype). On the wire `topk` is named with its k per chunk,
`topk<k>` (`core/sparse.py`); plain `topk` means the default density's k."""
EXCHANGE_METHOD = "/swarmnode.v1.AveragingService/Exchange"
ADMITTED = (("swarmnode-admitted", "1"),)
"""Initial metadata of an `Exchange` call whose header the reducer admitted: the part may follow."""
BULK_MARKER = pb.Contribution(bulk=True).SerializeToString()
"""The message a sender sends instead of chunks once it moved its part to the offered bulk lane."""
LANE_HEADER_PREFIX = 4
"""A result on a bulk lane: this many bytes (little-endian) give the length of its `AveragedHeader`."""
MAX_LANE_HEADER = 1 << 16
SIGNATURE_BYTES = 64
"""An Ed25519 signature: what follows each chunk on a bulk lane when the header is signed."""
MAX_WEIGHT = 1e15
MAX_TIMEOUT_S = 600.0
"""Longest all-reduce budget a group may carry (and --matchmaking/--allreduce-timeout may set): a
proposal cannot make a member hold a group's calls for longer."""


def check_dtype(wire_dtype: str) -> str:
    """`wire_dtype` if it is one of `WIRE_DTYPES` or a `topk<k>`; ValueError otherwise."""
    if wire_dtype not in WIRE_DTYPES and topk_layout.parse_wire_name(wire_dtype) is None:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
    return wire_dtype


def is_sparse(wire_dtype: str) -> bool:
    return wire_dtype == "topk" or topk_layout.parse_wire_name(wire_dtype) is not None


# ---------------------------------------------------------------------------------------------------
# The group as it travels: in `Propose` (protobuf) and in logs and snapshot metadata (plain dicts)

CURSOR_KEYS = ("shard", "epoch", "position")
MAX_GROUP_SIZE = 256
MAX_OFFER_BYTES = MAX_RECORD_BYTES  # a signed offer is one DHT record
_HEX = re.compile(r"[0-9a-f]{1,128}")


@dataclass(frozen=True)
class Member:
    """One member of an averaging group."""

    node_id: str
    """Hex."""
    address: str
    """HOST:GRPC_PORT."""
    weight: float = MAX_WEIGHT
    """The token weight the member offered for the round: the most its contribution may weigh (a
    reducer refuses a heavier one; the weight that counts travels with each contribution). Groups
    formed by matchmaking always say it; the default, the wire's bound, is for groups made by hand."""
    cursor: dict[str, int] | None = None
    """The member's data cursor (`CURSOR_KEYS`) as of the round's start; None: unknown."""
    global_digest: str = ""
    reachable: bool = True
    """False: a client member (docs/design.md "Behind NAT"): it reduces nothing and nobody dials it, so its
    address may be empty."""

    def __post_init__(self) -> None:
        if not _HEX.fullmatch(self.node_id):
            raise ValueError(f"member node id must be 1-128 lowercase hex digits, got {self.node_id!r}")
        if len(self.address) > 256:
            raise ValueError(f"member address too long: {self.address[:64]!r}…")
        if self.address or self.reachable:
            parse_host_port(self.address)
        if not 0 <= self.weight <= MAX_WEIGHT or len(self.global_digest) > 128:  # NaN fails too
            raise ValueError(f"member {self.node_id}: bad weight or digest")
        if self.cursor is not None:
            parse_cursor(self.cursor)


@dataclass(frozen=True)
class GroupSpec:
    """A frozen averaging group, identical on every member (its leader sends it in `Propose`)."""

    run_id: str
    round: int
    group_id: str
    """Unique per (round, leader)."""
    members: tuple[Member, ...]
    """Ordered; the reachable ones reduce, in this order (`part_range`)."""
    wire_dtype: str
    """"fp32" | "bf16" | "int8" | "int4"."""
    timeout_s: float
    """The all-reduce's budget (--allreduce-timeout)."""
    offers: tuple[bytes, ...] = ()
    """The members' signed DHT offers the leader read (`DHTEntry.signed`): the group's evidence."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "offers", tuple(self.offers))
        if len(self.offers) > len(self.members) or any(len(o) > MAX_OFFER_BYTES for o in self.offers):
            raise ValueError(f"group {self.group_id!r} carries more or larger offers than it has members")
        check_dtype(self.wire_dtype)
        if not 0 < len(self.members) <= MAX_GROUP_SIZE:
            raise ValueError(f"a group has 1-{MAX_GROUP_SIZE} members, got {len(self.members)}")
        if not self.reducers:
            raise ValueError(f"group {self.group_id!r} has no reachable member to reduce")
        if len({m.node_id for m in self.members}) != len(self.members):
            raise ValueError(f"group {self.group_id!r} names a member twice")
        if not 0 < len(self.group_id) <= 256 or len(self.run_id) > 256 or self.round < 0:
            raise ValueError(f"bad group id, run id or round: {self.group_id!r} {self.run_id!r} {self.round}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # NaN fails too
            raise ValueError(
                f"all-reduce timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.timeout_s}"
            )

    def find(self, node_id: str | None) -> int | None:
        """The member's index; None if the node is not a member."""
        return next((k for k, m in enumerate(self.members) if m.node_id == node_id), None)

    def index_of(self, node_id: str) -> int:
        """The member's index; ValueError if the node is not a member."""
        k = self.find(node_id)
        if k is None:
            raise ValueError(f"node {node_id} is not a member of group {self.group_id}")
        return k

    @functools.cached_property
    def reducers(self) -> tuple[int, ...]:
        """The indices of the members that reduce a part: the reachable ones, in group order."""
        return tuple(k for k, m in enumerate(self.members) if m.reachable)

    def reduces(self, k: int) -> bool:
        return self.members[k].reachable

    def part_range(self, k: int, n: int) -> tuple[int, int]:
        """Part k (member k's) of a flat Δ of n values: for the j-th of R reducers [j·n/R, (j+1)·n/R);
        an empty range for a client member (with every member reachable: [k·n/N, (k+1)·n/N)). With a
        top-k wire the bounds are rounded down to whole chunks (`topk_layout.CHUNK`), so a part's chunks
        are the chunks the node compressed Δ in."""
        if not self.members[k].reachable:
            return 0, 0
        j, size = self.reducers.index(k), len(self.reducers)
        lo, hi = j * n // size, (j + 1) * n // size
        if self.sparse:
            lo, hi = lo - lo % topk_layout.CHUNK, hi if j == size - 1 else hi - hi % topk_layout.CHUNK
        return lo, hi

    @functools.cached_property
    def sparse(self) -> bool:
        """Whether the group's wire is top-k (`core/sparse.py`): its reducers relay contributions
        rather than average them (`allreduce.py`)."""
        return is_sparse(self.wire_dtype)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for m in d["members"]:
            if m["reachable"]:
                del m["reachable"]  # as before clients existed: older readers take these dicts
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupSpec:
        """The inverse of `to_dict`; ValueError for anything malformed."""
        try:
            members = tuple(Member(**m) for m in d["members"])
            return cls(**{**d, "members": members})
        except (TypeError, KeyError) as exc:
            raise ValueError(f"malformed group spec: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GroupSpec:
        return cls.from_dict(json.loads(text))


def spec_to_pb(spec: GroupSpec) -> pb.GroupProposal:
    msg = pb.GroupProposal(
        run_id=spec.run_id,
        round=spec.round,
        group_id=spec.group_id,
        wire_dtype=spec.wire_dtype,
        timeout_s=spec.timeout_s,
        member_offers=spec.offers,
    )
    for m in spec.members:
        member = msg.members.add(
            node_id=m.node_id,
            address=m.address,
            weight=m.weight,
            global_digest=m.global_digest,
            client=not m.reachable,
        )
        if m.cursor is not None:
            member.cursor.CopyFrom(snapshot_pb.DataCursor(**m.cursor))
    return msg


def spec_from_pb(msg: pb.GroupProposal) -> GroupSpec:
    """The proposal's group; ValueError if it is malformed."""
    members = tuple(
        Member(
            m.node_id,
            m.address,
            m.weight,
            {k: getattr(m.cursor, k) for k in CURSOR_KEYS} if m.HasField("cursor") else None,
            m.global_digest,
            not m.client,
        )
        for m in msg.members
    )
    return GroupSpec(
        msg.run_id, msg.round, msg.group_id, members, msg.wire_dtype, msg.timeout_s, tuple(msg.member_offers)
    )


# ---------------------------------------------------------------------------------------------------
# The messages of an `Exchange` call (see averaging.proto)


def chunks(image: memoryview) -> list[memoryview]:
    """The image cut into the chunks `chunk_messages` sends, in order."""
    return [image[offset : offset + CHUNK_BYTES] for offset in range(0, len(image), CHUNK_BYTES)]


def chunk_messages(image: memoryview, signatures: Sequence[bytes] = ()) -> Iterator[tuple[bytes, int]]:
    """The image as `(offset, data)` chunk messages (`Contribution` and `AveragedPart` share the
    layout) in protobuf wire format, each with its payload size; built one at a time, one copy each.
    `signatures`: one per chunk (a `Contribution`'s field 4), or none."""
    for index, chunk in enumerate(chunks(image)):
        trailer = (
            _SIGNATURE_FIELD + bytes([len(signatures[index])]) + signatures[index] if signatures else b""
        )
        yield encode_data_chunk(index * CHUNK_BYTES, chunk, trailer), len(chunk)


_SIGNATURE_FIELD = b"\x22"  # field 4, length-delimited; an Ed25519 signature (64 bytes) fits one length byte


def take_chunk(
    raw: bytes, image: bytearray | memoryview, got: int, message_type: type[pb.Contribution | pb.AveragedPart]
) -> tuple[int, bytes]:
    """Copies a chunk message (`raw`, its protobuf wire bytes) that continues `image` at byte `got`
    into it, the one copy of its data on this side; returns its size and its signature (a
    `Contribution`'s field 4; empty if none). ValueError for anything else (a header, a gap, an
    overlap, an empty or oversized chunk, bytes that do not decode)."""
    offset, data, signature = chunk_fields(raw, message_type)
    if offset != got or not 0 < len(data) <= min(CHUNK_BYTES, len(image) - got):
        raise ValueError(f"chunk of {len(data)} bytes at offset {offset} does not continue byte {got}")
    image[got : got + len(data)] = data
    return len(data), signature


def chunk_fields(
    raw: bytes, message_type: type[pb.Contribution | pb.AveragedPart]
) -> tuple[int, memoryview, bytes]:
    """(offset, data, signature) of a chunk message, `data` a view of `raw` (no copy) when the message
    has the layout `chunk_messages` writes (offset, data, then the optional signature); any other
    encoding is decoded with protobuf. ValueError for a header message or bytes that do not decode."""
    if not isinstance(raw, bytes):
        raise ValueError(f"a chunk message must be bytes, got {type(raw).__name__}")
    fast = _fast_chunk_fields(raw)
    if fast is not None:
        return fast
    try:
        msg = message_type.FromString(raw)
    except DecodeError:
        raise ValueError("a chunk message does not decode") from None
    if msg.HasField("header"):
        raise ValueError("a header where a chunk was expected")
    return msg.offset, memoryview(msg.data), bytes(getattr(msg, "signature", b""))


def _fast_chunk_fields(raw: bytes) -> tuple[int, memoryview, bytes] | None:
    """Field 2 (varint offset), field 3 (data), then optionally field 4 (a signature of under 128 bytes)
    to the message's end; None for any other layout."""
    if len(raw) < 4 or raw[0] != 0x10:
        return None
    offset, pos = _read_varint(raw, 1)
    if not 0 <= pos < len(raw) or raw[pos] != 0x1A:
        return None
    size, pos = _read_varint(raw, pos + 1)
    end = pos + size
    if pos < 0 or end > len(raw):
        return None
    if end == len(raw):
        return offset, memoryview(raw)[pos:end], b""
    length = raw[end + 1 : end + 2]
    if (
        raw[end : end + 1] == _SIGNATURE_FIELD
        and length
        and length[0] < 0x80
        and end + 2 + length[0] == len(raw)
    ):
        return offset, memoryview(raw)[pos:end], raw[end + 2 :]
    return None


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; (0, -1) if it runs past the end or 10 bytes."""
    value, shift = 0, 0
    for i in range(pos, min(pos + 10, len(raw))):
        value |= (raw[i] & 0x7F) << shift
        if raw[i] < 0x80:
            return value, i + 1
        shift += 7
    return 0, -1


def contribution_header(
    spec: GroupSpec, sender: int, part: int, weight: float, n: int
) -> pb.ContributionHeader:
    lo, hi = spec.part_range(part, n)
    return pb.ContributionHeader(
        group_id=spec.group_id,
        run_id=spec.run_id,
        round=spec.round,
        sender=sender,
        node_id=spec.members[sender].node_id,
        part=part,
        weight=weight,
        wire_dtype=spec.wire_dtype,
        total_elements=n,
        part_elements=hi - lo,
    )


def header_problem(h: pb.ContributionHeader, spec: GroupSpec, my_index: int) -> str | None:
    """What makes a contribution's header unfit for this member's part of the group (None: fit).
    The sizes are checked later, once the local all-reduce knows Δ's length."""
    if h.run_id != spec.run_id or h.round != spec.round:
        return f"run {h.run_id!r} round {h.round} is not the group's"
    if h.sender >= len(spec.members) or h.sender == my_index:
        return f"sender index {h.sender} is out of range"
    if h.node_id != spec.members[h.sender].node_id:
        return f"node {h.node_id!r} is not member {h.sender}"
    if h.part != my_index or h.wire_dtype != spec.wire_dtype or not spec.reduces(my_index):
        return f"part {h.part} in {h.wire_dtype!r} is not part {my_index} in {spec.wire_dtype!r}"
    if not 0 <= h.weight <= MAX_WEIGHT:  # NaN fails too
        return f"weight {h.weight} is out of range"
    return None


def lane_header(header: pb.AveragedHeader) -> bytes:
    """A result header as a reducer writes it on a bulk lane, before the averaged image."""
    raw = header.SerializeToString()
    return len(raw).to_bytes(LANE_HEADER_PREFIX, "little") + raw
