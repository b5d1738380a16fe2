"""The all-reduce's reuse of memory: `reducer.SpareBuffers`, bf16 images encoded into given bytes, and
`average` into given buffers, each the same bits as with fresh memory."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from swarmnode.swarm.averaging import codecs
from swarmnode.swarm.averaging.aggregation import average
from swarmnode.swarm.averaging.reducer import SpareBuffers, _PartRound
from swarmnode.swarm.averaging.wire import GroupSpec, Member

GRAIN = SpareBuffers.GRAIN


def test_a_buffer_given_back_is_taken_again_by_a_size_of_its_grain() -> None:
    spares = SpareBuffers()
    first = spares.take(GRAIN + 5)
    assert len(first) == GRAIN + 5 and not first.readonly
    spares.give([first])
    assert spares.held == 1
    again = spares.take(2 * GRAIN - 7)  # another size, same grain: the same memory
    assert len(again) == 2 * GRAIN - 7
    assert _address(again) == _address(first)
    assert spares.held == 0
    other = spares.take(GRAIN + 5)  # none left: fresh memory
    assert _address(other) != _address(first)


def test_spares_hold_at_most_their_limit_and_start_over_for_new_sizes() -> None:
    spares = SpareBuffers(limit_bytes=3 * GRAIN)
    spares.give([spares.take(GRAIN) for _ in range(5)])
    assert spares.held == 3
    spares.take(3 * GRAIN)  # a size not held, and no room for it beside the others: they go
    assert spares.held == 0


def test_a_view_that_is_not_a_spare_is_not_kept() -> None:
    spares = SpareBuffers()
    spares.give([memoryview(bytearray(GRAIN + 1))])  # not a whole grain: not one of ours
    assert spares.held == 0


def test_bf16_encoded_into_given_bytes_equals_a_fresh_image() -> None:
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3)) * 1e3
    into = SpareBuffers().take(codecs.encoded_size("bf16", x.numel()))
    assert bytes(codecs.encode(x, "bf16", into)) == bytes(codecs.encode(x, "bf16"))
    assert codecs.encode(x[:0], "bf16", memoryview(b"")).nbytes == 0


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16", "int8"])
def test_average_into_given_buffers_equals_a_fresh_average(wire_dtype: str) -> None:
    n = 70_001
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(n, generator=g) for _ in range(3)]
    contributions = [(i, float(i + 1), codecs.encode(p, wire_dtype)) for i, p in enumerate(parts)]
    fresh = average(list(contributions), wire_dtype, n)
    acc = torch.full((n,), float("nan"))  # whatever an earlier round left there
    values_out = torch.full((n,), 7.0)
    scratch = torch.full((n,), float("nan"))
    reused = average(list(contributions), wire_dtype, n, acc=acc, values_out=values_out, scratch=scratch)
    assert fresh.values is not None and reused.values is not None
    assert reused.values.data_ptr() == values_out.data_ptr()
    assert torch.equal(reused.values, fresh.values)
    assert fresh.image is not None and reused.image is not None
    assert bytes(reused.image) == bytes(fresh.image)
    assert reused.included == fresh.included == (0, 1, 2)


def test_a_round_gives_its_buffers_back_only_once_it_is_gone() -> None:
    """The reducer's `_PartRound` holds the contributions' buffers; they return to the spares when the
    round object is collected, never while a call of it could still write into them."""
    spares = SpareBuffers()
    spec = GroupSpec("run", 0, "g", (Member("01", "h:1"), Member("02", "h:1")), "fp32", 5.0)

    async def scenario() -> tuple[int, int]:
        rnd = _PartRound(spec, 0, 0.0, spares)
        rnd._receive_buffer(GRAIN)
        rnd._receive_buffer(GRAIN)
        while_alive = spares.held
        del rnd
        gc.collect()
        return while_alive, spares.held

    assert asyncio.run(scenario()) == (0, 2)


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr()
