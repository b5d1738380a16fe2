"""The 4-bit wire codec (swarmnode.swarm.averaging.codecs, `int4`): exact sizes, the error bound, its
layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmnode.swarm.averaging import codecs
from swarmnode.swarm.averaging.codecs import INT4_BLOCK

LENGTHS = [0, 1, 2, 3, INT4_BLOCK - 1, INT4_BLOCK, INT4_BLOCK + 1, 7 * INT4_BLOCK + 33]


def values(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def round_trip(x: torch.Tensor) -> torch.Tensor:
    return codecs.decode(bytes(codecs.encode(x, "int4")), "int4", x.numel())


def assert_int4_bound(x: torch.Tensor, y: torch.Tensor) -> None:
    """|x − y| ≤ absmax/7/2 per block, plus fp32 rounding (of the scale, of x/scale and of the product)."""
    for start in range(0, x.numel(), INT4_BLOCK):
        block, back = x[start : start + INT4_BLOCK], y[start : start + INT4_BLOCK]
        absmax = float(block.abs().max())
        assert float((block - back).abs().max()) <= absmax / 7 / 2 + 3 * absmax * 2**-24 + 1e-45


@pytest.mark.parametrize("n", [*LENGTHS, 1 << 20])
def test_int4_image_has_one_scale_per_block_and_two_values_per_byte(n: int) -> None:
    image = codecs.encode(values(n), "int4")
    assert len(image) == 4 * -(-n // INT4_BLOCK) + (n + 1) // 2 == codecs.encoded_size("int4", n)


def test_int4_is_about_an_eighth_of_fp32() -> None:
    n = 1 << 20
    assert codecs.encoded_size("int4", n) / codecs.encoded_size("fp32", n) == pytest.approx(0.1328, abs=1e-4)


@pytest.mark.parametrize("n", LENGTHS)
def test_int4_error_stays_within_half_a_step_of_each_block(n: int) -> None:
    x = values(n, seed=3, scale=2.0)
    assert_int4_bound(x, round_trip(x))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 3 * INT4_BLOCK + 5),
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_int4_bound_holds_for_any_length_and_scale(n: int, scale: float, seed: int) -> None:
    x = values(n, seed, scale)
    assert_int4_bound(x, round_trip(x))


def test_int4_layout_is_scales_then_low_nibble_first() -> None:
    x = torch.tensor([7.0, -7.0, 0.0, 3.0, 1.0])  # one block: scale 1, q = x
    image = bytes(codecs.encode(x, "int4"))
    assert torch.frombuffer(bytearray(image[:4]), dtype=torch.float32).item() == 1.0
    assert image[4:] == bytes([15 | 1 << 4, 8 | 11 << 4, 9 | 8 << 4])  # q + 8; the odd tail pads with 8
    assert torch.equal(round_trip(x), x)


def test_int4_blocks_of_zeros_come_back_as_zeros() -> None:
    x = torch.zeros(3 * INT4_BLOCK)
    x[INT4_BLOCK : 2 * INT4_BLOCK] = values(INT4_BLOCK)
    y = round_trip(x)
    assert not y[:INT4_BLOCK].any() and not y[2 * INT4_BLOCK :].any()


def test_int4_decoding_is_a_pure_function_of_the_image() -> None:
    image = bytes(codecs.encode(values(1000, seed=4), "int4"))
    out = torch.full((1000,), float("nan"))
    assert torch.equal(codecs.decode(image, "int4", 1000), codecs.decode(image, "int4", 1000, out))
    assert torch.equal(out, codecs.decode(image, "int4", 1000))


def test_int4_image_of_the_wrong_size_is_refused() -> None:
    image = bytes(codecs.encode(values(100), "int4"))
    for bad in (image[:-1], image + b"\0", b""):
        with pytest.raises(ValueError, match="bytes"):
            codecs.decode(bad, "int4", 100)
