"""The top-k wire's compressor and image (swarmnode.core.sparse): sizes, exact re-compression, and the
validation of an untrusted image."""

from __future__ import annotations

import struct

import pytest
import torch

from swarmnode.core import sparse
from swarmnode.swarm.averaging import codecs, wire

K = 41


@pytest.mark.parametrize("n", [0, 1, 40, 4096, 4097, 3 * 4096 + 17])
@pytest.mark.parametrize("k", [1, K, 4096])
def test_the_image_keeps_k_per_chunk_and_compressing_again_changes_no_bit(n: int, k: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + k))
    image = sparse.encode(x, k)
    assert len(image) == sparse.image_size(n, k) == codecs.encoded_size(sparse.wire_name(k), n)
    c = sparse.decode(image, n, k)
    assert int((c != 0).sum()) == sparse.entry_count(n, k)
    assert torch.equal(sparse.compress(c, k), c)
    kept = c != 0
    assert torch.equal(torch.sign(c[kept]), torch.sign(x[kept]))  # signs kept, the largest entries chosen
    if n >= 4096 and k < 4096:
        chunk = x[:4096].abs()
        assert chunk[kept[:4096]].min() >= chunk[~kept[:4096]].max()


def test_values_are_two_levels_of_their_chunks_largest() -> None:
    x = torch.zeros(4096)
    x[[3, 10, 200]] = torch.tensor([2.0, -1.6, 1.0])
    c = sparse.compress(x, 3)
    assert c[3] == 2.0 and c[10] == -1.5 and c[200] == 1.5


def test_bytes_per_kept_entry_at_the_default_density() -> None:
    n = 1 << 20
    k = sparse.kept_per_chunk(sparse.DEFAULT_DENSITY)
    per_entry = sparse.image_size(n, k) / sparse.entry_count(n, k)
    assert k == 41 and per_entry < 1.9  # 2 bits + 12 bits + a 4-byte scale per 41
    assert sparse.image_size(n, k) / (4 * n) < 1 / 200  # against fp32


def _indices_start(n: int, k: int) -> int:
    return 4 * sparse.chunk_count(n) + -(-sparse.entry_count(n, k) // 4)


def test_an_image_with_a_bad_scale_is_refused() -> None:
    n = 2 * 4096
    image = bytearray(sparse.encode(torch.randn(n), K))
    for bad in (float("nan"), float("inf"), -1.0):
        broken = bytearray(image)
        broken[4:8] = struct.pack("<f", bad)
        with pytest.raises(ValueError, match="scale"):
            sparse.decode(broken, n, K)


def test_an_image_with_a_repeated_index_is_refused() -> None:
    n = 4096
    image = bytearray(sparse.encode(torch.randn(n), K))
    i = _indices_start(n, K)
    first = image[i] | ((image[i + 1] & 0xF) << 8)
    image[i + 1] = (image[i + 1] & 0x0F) | ((first & 0xF) << 4)  # the second index := the first
    image[i + 2] = first >> 4
    with pytest.raises(ValueError, match="duplicate"):
        sparse.decode(image, n, K)


def test_an_image_with_an_index_beyond_its_chunk_is_refused() -> None:
    n = 4096 + 40  # the last chunk holds 40 values, all kept
    image = bytearray(sparse.encode(torch.randn(n), K))
    entries = sparse.entry_count(n, K)
    last = _indices_start(n, K) + 3 * ((entries - 1) // 2)
    assert (entries - 1) % 2 == 0  # the last entry is the low index of its triple
    image[last], image[last + 1] = 0xFF, (image[last + 1] & 0xF0) | 0x0F  # index 4095 in a chunk of 40
    with pytest.raises(ValueError, match="beyond"):
        sparse.decode(image, n, K)


def test_an_image_of_the_wrong_size_is_refused() -> None:
    image = bytes(sparse.encode(torch.randn(5000), K))
    with pytest.raises(ValueError, match="bytes"):
        sparse.decode(image + b"\0", 5000, K)
    with pytest.raises(ValueError, match="bytes"):
        sparse.decode(image, 4096, K)


def test_wire_names_carry_k() -> None:
    assert wire.check_dtype("topk41") == "topk41" and wire.is_sparse("topk") and wire.is_sparse("topk41")
    assert codecs.topk_of("topk") == K and codecs.topk_of("topk64") == 64
    for bad in ("topk0", "topk4097", "topk041", "topk-1"):
        with pytest.raises(ValueError):
            wire.check_dtype(bad)
    assert sparse.kept_per_chunk(0.0156) == 64 and sparse.kept_per_chunk(1e-9) == 1
    with pytest.raises(ValueError):
        sparse.kept_per_chunk(0.0)
