"""What the averaging service puts on the wire (DESIGN.md §3 "Outer step across peers"): the codecs
of pseudo-gradient parts, the `Exchange` call's messages, and the group spec in its protobuf and JSON forms.

A part of n fp32 values travels as one byte image, cut into chunks of at most `CHUNK_BYTES`. The image
of each wire dtype:
- `fp32`: the raw little-endian values (4n bytes);
- `bf16`: torch's round-to-nearest-even bfloat16 values (2n bytes);
- `int8`: blockwise absmax quantisation, `INT8_BLOCK` values per block: first one fp32 scale per block
  (absmax / 127), then one int8 per value, q = round(x / scale) (n + 4·⌈n / INT8_BLOCK⌉ bytes).
  Each value comes back within scale / 2 (plus fp32 rounding) of what was sent.

Decoding is a pure function of the image, so every member that decodes the same image holds the
same fp32 values bit for bit (the all-reduce relies on it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from swarmnode.config import parse_host_port
from swarmnode.data import parse_cursor
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.proto.v1 import snapshot_pb2 as snapshot_pb
from swarmnode.rpc import CHUNK_BYTES, encode_data_chunk

WIRE_DTYPES = ("fp32", "bf16", "int8")
EXCHANGE_METHOD = "/swarmnode.v1.AveragingService/Exchange"
ADMITTED = (("swarmnode-admitted", "1"),)
"""Initial metadata of an `Exchange` call whose header the reducer admitted: the part may follow."""
MAX_WEIGHT = 1e15
INT8_BLOCK = 1024
"""Values per int8 quantisation block (one fp32 scale each: 0.4% overhead)."""

_INT8_MAX = 127.0
_ITEM_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}

assert sys.byteorder == "little", "the wire images are little-endian, as torch lays them out here"


def check_dtype(wire_dtype: str) -> str:
    """`wire_dtype` if it is one of `WIRE_DTYPES`; ValueError otherwise."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
    return wire_dtype


def int8_blocks(n: int) -> int:
    return -(-n // INT8_BLOCK)


def encoded_size(wire_dtype: str, n: int) -> int:
    """Bytes of the image of n values."""
    size = _ITEM_BYTES[check_dtype(wire_dtype)] * n
    return size + 4 * int8_blocks(n) if wire_dtype == "int8" else size


def encode(x: torch.Tensor, wire_dtype: str) -> memoryview:
    """The image of a flat fp32 CPU tensor, as bytes. For fp32 it is a view of `x` itself (no copy):
    keep `x` alive and unchanged while the image is in use."""
    assert x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous(), "flat contiguous fp32 expected"
    if check_dtype(wire_dtype) == "fp32":
        return _bytes_of(x)
    if wire_dtype == "bf16":
        return _bytes_of(x.to(torch.bfloat16))
    scales, q = _quantize_int8(x)
    image = torch.empty(encoded_size("int8", x.numel()), dtype=torch.uint8)
    image[: 4 * scales.numel()].copy_(scales.view(torch.uint8))
    image[4 * scales.numel() :].copy_(q.view(torch.uint8))
    return _bytes_of(image)


def decode(image: bytes | bytearray | memoryview, wire_dtype: str, n: int) -> torch.Tensor:
    """The n fp32 values of an image made by `encode`; for fp32 a view of the image's memory if it is
    writable (no copy). Raises ValueError if its size is not exactly `encoded_size(wire_dtype, n)`."""
    if len(image) != encoded_size(wire_dtype, n):
        raise ValueError(
            f"a {wire_dtype} image of {n} values has {encoded_size(wire_dtype, n)} bytes, not {len(image)}"
        )
    if n == 0:
        return torch.empty(0, dtype=torch.float32)
    raw = torch.frombuffer(_writable(image), dtype=torch.uint8)
    if wire_dtype == "fp32":
        return raw.view(torch.float32)
    if wire_dtype == "bf16":
        return raw.view(torch.bfloat16).float()
    nb = int8_blocks(n)
    return _dequantize_int8(raw[: 4 * nb].view(torch.float32), raw[4 * nb :].view(torch.int8))


def _quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(one scale per block, int8 values); a block of zeros has scale 0 and decodes to zeros."""
    blocks = _padded_blocks(x)
    scales = blocks.abs().amax(dim=1).div_(_INT8_MAX)
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = blocks.div(divisors[:, None]).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return scales, q.view(-1)[: x.numel()]


def _dequantize_int8(scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    values = _padded_blocks(q.to(torch.float32))
    return values.mul_(scales[:, None]).view(-1)[: q.numel()]


def _padded_blocks(x: torch.Tensor) -> torch.Tensor:
    """`x` as rows of `INT8_BLOCK` values, zero-padded at the end (a fresh tensor only if padded)."""
    pad = int8_blocks(x.numel()) * INT8_BLOCK - x.numel()
    return (torch.cat((x, x.new_zeros(pad))) if pad else x).view(-1, INT8_BLOCK)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _writable(image: bytes | bytearray | memoryview) -> bytearray | memoryview:
    """A writable buffer over the image (torch refuses to wrap read-only memory without a warning)."""
    view = memoryview(image)
    return view if not view.readonly else bytearray(view)


# ---------------------------------------------------------------------------------------------------
# The group as it travels: in `Propose` (protobuf) and in logs and snapshot metadata (plain dicts)

CURSOR_KEYS = ("shard", "epoch", "position")
MAX_GROUP_SIZE = 256
_HEX = re.compile(r"[0-9a-f]{1,128}")


@dataclass(frozen=True)
class Member:
    """One member of an averaging group."""

    node_id: str
    """Hex."""
    address: str
    """HOST:GRPC_PORT."""
    weight: float = 0.0
    """Informational; the weight that counts travels with each contribution."""
    cursor: dict[str, int] | None = None
    """The member's data cursor (`CURSOR_KEYS`) as of the round's start; None: unknown."""
    global_digest: str = ""

    def __post_init__(self) -> None:
        if not _HEX.fullmatch(self.node_id):
            raise ValueError(f"member node id must be 1-128 lowercase hex digits, got {self.node_id!r}")
        if len(self.address) > 256:
            raise ValueError(f"member address too long: {self.address[:64]!r}…")
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
    """Ordered: member k reduces part k."""
    wire_dtype: str
    """"fp32" | "bf16" | "int8"."""
    timeout_s: float
    """The all-reduce's budget (--allreduce-timeout)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        check_dtype(self.wire_dtype)
        if not 0 < len(self.members) <= MAX_GROUP_SIZE:
            raise ValueError(f"a group has 1-{MAX_GROUP_SIZE} members, got {len(self.members)}")
        if len({m.node_id for m in self.members}) != len(self.members):
            raise ValueError(f"group {self.group_id!r} names a member twice")
        if not 0 < len(self.group_id) <= 256 or len(self.run_id) > 256 or self.round < 0:
            raise ValueError(f"bad group id, run id or round: {self.group_id!r} {self.run_id!r} {self.round}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"all-reduce timeout must be a positive number of seconds, got {self.timeout_s}")

    def index_of(self, node_id: str) -> int:
        """The member's index; ValueError if the node is not a member."""
        for k, member in enumerate(self.members):
            if member.node_id == node_id:
                return k
        raise ValueError(f"node {node_id} is not a member of group {self.group_id}")

    def part_range(self, k: int, n: int) -> tuple[int, int]:
        """Part k of a flat Δ of n values: [k·n/N, (k+1)·n/N)."""
        size = len(self.members)
        return k * n // size, (k + 1) * n // size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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
    )
    for m in spec.members:
        member = msg.members.add(
            node_id=m.node_id, address=m.address, weight=m.weight, global_digest=m.global_digest
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
        )
        for m in msg.members
    )
    return GroupSpec(msg.run_id, msg.round, msg.group_id, members, msg.wire_dtype, msg.timeout_s)


# ---------------------------------------------------------------------------------------------------
# The messages of an `Exchange` call (see averaging.proto)


def chunk_messages(image: memoryview) -> Iterator[tuple[bytes, int]]:
    """The image as `(offset, data)` chunk messages (`Contribution` and `AveragedPart` share the
    layout) in protobuf wire format, each with its payload size; built one at a time, one copy each."""
    for offset in range(0, len(image), CHUNK_BYTES):
        chunk = image[offset : offset + CHUNK_BYTES]
        yield encode_data_chunk(offset, chunk), len(chunk)


def take_chunk(msg: pb.Contribution | pb.AveragedPart, image: bytearray, got: int) -> int:
    """Copies a chunk that continues `image` at byte `got` into it and returns its size; ValueError
    for anything else (a header, a gap, an overlap, an empty or oversized chunk)."""
    data = msg.data
    if msg.HasField("header") or msg.offset != got or not 0 < len(data) <= min(CHUNK_BYTES, len(image) - got):
        raise ValueError(f"chunk of {len(data)} bytes at offset {msg.offset} does not continue byte {got}")
    image[got : got + len(data)] = data
    return len(data)


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
    if h.part != my_index or h.wire_dtype != spec.wire_dtype:
        return f"part {h.part} in {h.wire_dtype!r} is not part {my_index} in {spec.wire_dtype!r}"
    if not 0 <= h.weight <= MAX_WEIGHT:  # NaN fails too
        return f"weight {h.weight} is out of range"
    return None
