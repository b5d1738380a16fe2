"""What the averaging service puts on the wire (swarmnode.swarm.averaging.wire): part codecs, chunks,
group specs."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmnode.net import rpc
from swarmnode.net.rpc import CHUNK_BYTES
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging import codecs, wire
from swarmnode.swarm.averaging.codecs import INT8_BLOCK
from swarmnode.swarm.averaging.wire import GroupSpec, Member

LENGTHS = [0, 1, INT8_BLOCK - 1, INT8_BLOCK, INT8_BLOCK + 1, 5 * INT8_BLOCK + 17]


def values(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------------
# Codecs


@pytest.mark.parametrize("n", LENGTHS)
def test_fp32_round_trips_exactly(n: int) -> None:
    x = values(n)
    assert torch.equal(codecs.decode(bytes(codecs.encode(x, "fp32")), "fp32", n), x)


@pytest.mark.parametrize("n", LENGTHS)
def test_bf16_round_trip_is_torch_rounding(n: int) -> None:
    x = values(n, seed=1)
    assert torch.equal(
        codecs.decode(bytes(codecs.encode(x, "bf16")), "bf16", n), x.to(torch.bfloat16).float()
    )


@pytest.mark.parametrize("n", LENGTHS)
def test_int8_error_stays_within_half_a_step_of_each_block(n: int) -> None:
    x = values(n, seed=2, scale=3.0)
    assert_int8_bound(x, codecs.decode(bytes(codecs.encode(x, "int8")), "int8", n))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 3 * INT8_BLOCK + 5),
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_int8_bound_holds_for_any_length_and_scale(n: int, scale: float, seed: int) -> None:
    x = values(n, seed, scale)
    assert_int8_bound(x, codecs.decode(bytes(codecs.encode(x, "int8")), "int8", n))


def assert_int8_bound(x: torch.Tensor, y: torch.Tensor) -> None:
    """|x − y| ≤ absmax/127/2 per block, plus fp32 rounding: of the scale, of x/scale (which can send a
    value to the other neighbour at a half step) and of the product, each at most absmax·2⁻²⁴."""
    for start in range(0, x.numel(), INT8_BLOCK):
        block, back = x[start : start + INT8_BLOCK], y[start : start + INT8_BLOCK]
        absmax = float(block.abs().max())
        assert float((block - back).abs().max()) <= absmax / 127 / 2 + 3 * absmax * 2**-24 + 1e-45


def test_int8_blocks_of_zeros_come_back_as_zeros() -> None:
    x = torch.zeros(3 * INT8_BLOCK)
    x[INT8_BLOCK : 2 * INT8_BLOCK] = values(INT8_BLOCK)
    y = codecs.decode(bytes(codecs.encode(x, "int8")), "int8", x.numel())
    assert not y[:INT8_BLOCK].any() and not y[2 * INT8_BLOCK :].any()


@pytest.mark.parametrize("n", [0, 1000, 1 << 20])
def test_compressed_images_are_half_and_a_quarter_of_fp32(n: int) -> None:
    x = values(n)
    fp32, bf16, int8 = (len(codecs.encode(x, d)) for d in ("fp32", "bf16", "int8"))
    assert fp32 == 4 * n == codecs.encoded_size("fp32", n)
    assert bf16 == fp32 // 2 == codecs.encoded_size("bf16", n)
    assert int8 == fp32 // 4 + 4 * -(-n // INT8_BLOCK) == codecs.encoded_size("int8", n)


def test_fp32_image_is_a_view_of_the_tensor() -> None:
    x = values(10)
    image = codecs.encode(x, "fp32")
    x[0] = 42.0
    assert codecs.decode(bytes(image), "fp32", 10)[0] == 42.0


@pytest.mark.parametrize("wire_dtype", wire.WIRE_DTYPES)
def test_an_image_of_the_wrong_size_is_refused(wire_dtype: str) -> None:
    image = bytes(codecs.encode(values(100), wire_dtype))
    for bad in (image[:-1], image + b"\0", b""):
        with pytest.raises(ValueError, match="bytes"):
            codecs.decode(bad, wire_dtype, 100)


def test_unknown_wire_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="wire dtype"):
        codecs.encoded_size("fp64", 10)


# ---------------------------------------------------------------------------------------------------
# Chunk messages


@pytest.mark.parametrize("message_type", [pb.Contribution, pb.AveragedPart])
def test_chunk_messages_parse_and_reassemble_the_image(message_type: type[pb.Contribution]) -> None:
    image = codecs.encode(values(CHUNK_BYTES // 2 + 7), "fp32")  # two whole chunks and a bit
    got, rebuilt = 0, bytearray(len(image))
    sizes = []
    for encoded, size in wire.chunk_messages(image):
        msg = message_type.FromString(encoded)
        assert msg.offset == got and len(msg.data) == size  # what we write is a proper protobuf message
        got += wire.take_chunk(encoded, rebuilt, got, message_type)[0]
        sizes.append(size)
    assert bytes(rebuilt) == bytes(image) and sizes == [CHUNK_BYTES, CHUNK_BYTES, 28]


@pytest.mark.parametrize("offset", [0, 5, 300, 1 << 40])
def test_a_chunk_in_our_layout_is_read_in_place(offset: int) -> None:
    encoded = rpc.encode_data_chunk(offset, b"abcdef")
    got_offset, data, _ = wire.chunk_fields(encoded, pb.Contribution)
    assert (got_offset, bytes(data)) == (offset, b"abcdef") and data.obj is encoded  # a view, not a copy


def test_a_chunk_from_another_protobuf_writer_is_read_too() -> None:
    # protobuf omits a zero offset, and may order fields its own way: the slow path decodes those
    zero = pb.Contribution(offset=0, data=b"xyz").SerializeToString()
    reordered = b"\x1a\x03xyz\x10\x07"
    fields = [wire.chunk_fields(raw, pb.Contribution) for raw in (zero, reordered)]
    assert [(offset, bytes(data)) for offset, data, _ in fields] == [(0, b"xyz"), (7, b"xyz")]


def test_a_signed_chunk_is_read_in_place_with_its_signature() -> None:
    image = memoryview(codecs.encode(values(CHUNK_BYTES // 4 + 3), "fp32"))  # two chunks
    signatures = [bytes([i]) * 64 for i in range(2)]
    rebuilt, got = bytearray(len(image)), 0
    for i, (encoded, _) in enumerate(wire.chunk_messages(image, signatures)):
        assert pb.Contribution.FromString(encoded).signature == signatures[i]  # proper protobuf
        offset, data, signature = wire.chunk_fields(encoded, pb.Contribution)
        assert data.obj is encoded and signature == signatures[i]  # the fast path took it
        size, signature = wire.take_chunk(encoded, rebuilt, got, pb.Contribution)
        assert signature == signatures[i]
        got += size
    assert bytes(rebuilt) == bytes(image)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x10\xff\xff",
        b"\x10\x01\x1a\x09abc",
        b"\xff" * 12,
        b"",
        "text",
        rpc.encode_data_chunk(0, b"abcd") + b"\x22",  # a signature field cut short after its tag
    ],
)
def test_a_chunk_that_does_not_decode_is_refused(garbage: object) -> None:
    with pytest.raises(ValueError):
        wire.take_chunk(garbage, bytearray(64), 0, pb.Contribution)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("offset", "size", "image_size"),
    [(4, 8, 64), (0, 65, 64), (0, 0, 64), (0, CHUNK_BYTES + 1, 2 * CHUNK_BYTES)],
)
def test_a_chunk_that_does_not_continue_the_image_is_refused(offset: int, size: int, image_size: int) -> None:
    with pytest.raises(ValueError, match="does not continue"):
        raw = pb.Contribution(offset=offset, data=b"\0" * size).SerializeToString()
        wire.take_chunk(raw, bytearray(image_size), 0, pb.Contribution)


def test_a_chunk_with_a_header_is_refused() -> None:
    msg = pb.Contribution(header=pb.ContributionHeader(group_id="g"), offset=0, data=b"1234")
    with pytest.raises(ValueError):
        wire.take_chunk(msg.SerializeToString(), bytearray(4), 0, pb.Contribution)


# ---------------------------------------------------------------------------------------------------
# Group specs


def spec(**changes: object) -> GroupSpec:
    fields: dict[str, object] = {
        "run_id": "run",
        "round": 3,
        "group_id": "3-aa",
        "members": (
            Member("aa", "127.0.0.1:5001", 120.0, {"shard": 1, "epoch": 0, "position": 64}, "ff" * 32),
            Member("bb", "node-b.example:5002"),
        ),
        "wire_dtype": "bf16",
        "timeout_s": 30.0,
    }
    return GroupSpec(**{**fields, **changes})  # type: ignore[arg-type]


def test_group_spec_round_trips_through_json_and_protobuf() -> None:
    original = spec()
    assert GroupSpec.from_json(original.to_json()) == original
    assert json.loads(original.to_json())["members"][0]["cursor"] == {"shard": 1, "epoch": 0, "position": 64}
    again = wire.spec_from_pb(pb.GroupProposal.FromString(wire.spec_to_pb(original).SerializeToString()))
    assert again == original and again.members[1].cursor is None


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"wire_dtype": "fp16"}, "wire dtype"),
        ({"members": ()}, "members"),
        ({"members": (Member("aa", "h:1"), Member("aa", "h:2"))}, "twice"),
        ({"timeout_s": 0.0}, "timeout"),
        ({"timeout_s": float("nan")}, "timeout"),
        ({"group_id": ""}, "group id"),
    ],
)
def test_malformed_group_specs_are_refused(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec(**changes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"node_id": "AA"}, "hex"),
        ({"address": "no-port"}, "HOST:PORT"),
        ({"address": "h:70000"}, "HOST:PORT"),
        ({"cursor": {"shard": 1, "epoch": 0}}, "cursor"),
        ({"cursor": {"shard": 1, "epoch": 0, "position": -1}}, "cursor"),
        ({"weight": float("inf")}, "weight"),
    ],
)
def test_malformed_members_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Member(**{"node_id": "aa", "address": "h:1", **kwargs})  # type: ignore[arg-type]


def test_from_dict_turns_missing_or_unknown_fields_into_value_errors() -> None:
    d = spec().to_dict()
    with pytest.raises(ValueError):
        GroupSpec.from_dict({k: v for k, v in d.items() if k != "round"})
    with pytest.raises(ValueError):
        GroupSpec.from_dict({**d, "colour": "blue"})


@given(n=st.integers(0, 10_000), size=st.integers(1, 17))
def test_parts_tile_the_pseudo_gradient(n: int, size: int) -> None:
    members = tuple(Member(f"{i + 1:x}", f"h:{i + 1}") for i in range(size))
    g = spec(members=members)
    ranges = [g.part_range(k, n) for k in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_header_problems_name_what_does_not_fit() -> None:
    g = spec()
    ok = wire.contribution_header(g, 1, 0, 5.0, 1000)
    assert wire.header_problem(ok, g, 0) is None
    bad = {
        "round": 4,
        "sender": 0,
        "node_id": "cc",
        "part": 1,
        "wire_dtype": "fp32",
        "weight": float("nan"),
    }
    for field, value in bad.items():
        h = pb.ContributionHeader()
        h.CopyFrom(ok)
        setattr(h, field, value)
        assert wire.header_problem(h, g, 0), field
    assert wire.header_problem(pb.ContributionHeader(sender=9, run_id="run", round=3), g, 0)
