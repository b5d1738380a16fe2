"""Chunk-wise top-k with 2-bit values: the compressor of SparseLoCo (Sarfi et al. 2025, "Communication
Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706) and its byte image.

A flat fp32 vector of n values is cut into chunks of `CHUNK` values from its start (the last one may be
shorter); in each chunk the k entries of largest magnitude are kept (all of a chunk shorter than k),
the rest dropped. A kept value is sent as 2 bits against its chunk's scale s (the largest kept
magnitude): its sign, and whether its magnitude is nearer s or `LOW`·s. The image of n values:

    scales   fp32 × chunks                     (s of each chunk, finite and ≥ 0)
    codes    2 bits × entries, 4 to a byte     (bit 0: negative; bit 1: magnitude s, else LOW·s)
    indices  12 bits × entries, 2 to 3 bytes   (in-chunk positions, strictly increasing per chunk)

so about 1.75 + 4/k bytes per kept entry. Decoding validates everything before it writes a value:
the exact size, finite non-negative scales, and in-chunk indices within the chunk and strictly
increasing (no duplicate); any violation is a ValueError. Never unpickles.

`compress(x)` is decode(encode(x)); compressing its output again gives it back bit for bit (the kept
entries are then the only non-zero ones, the largest is s itself, and LOW·s stays below the midpoint),
which is what lets a node add its own compressed Δ to an average exactly as peers decode its image.
"""

from __future__ import annotations

import torch

from swarmnode.core.topk_layout import CHUNK as CHUNK
from swarmnode.core.topk_layout import DEFAULT_DENSITY as DEFAULT_DENSITY
from swarmnode.core.topk_layout import DEFAULT_OUTER_LR as DEFAULT_OUTER_LR
from swarmnode.core.topk_layout import chunk_count as chunk_count
from swarmnode.core.topk_layout import entry_count as entry_count
from swarmnode.core.topk_layout import image_size as image_size
from swarmnode.core.topk_layout import kept_per_chunk as kept_per_chunk
from swarmnode.core.topk_layout import parse_wire_name as parse_wire_name
from swarmnode.core.topk_layout import wire_name as wire_name

LOW = 0.75
"""The lower magnitude level, as a share of the chunk's scale; the levels are LOW·s and s."""
_MIDPOINT = (1.0 + LOW) / 2


def _chunks(n: int, k: int) -> list[tuple[int, int, int]]:
    """(start, length, kept) of the two chunk shapes: the whole chunks as one block, then the last,
    shorter one (each present only if it has values)."""
    whole, rest = divmod(n, CHUNK)
    shapes = []
    if whole:
        shapes.append((0, whole * CHUNK, min(k, CHUNK)))
    if rest:
        shapes.append((whole * CHUNK, rest, min(k, rest)))
    return shapes


def encode(x: torch.Tensor, k: int) -> memoryview:
    """The image of a flat contiguous fp32 CPU tensor (see the module notes)."""
    assert x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous(), "flat contiguous fp32 expected"
    n = x.numel()
    scales, codes, indices = [], [], []
    for start, length, kept in _chunks(n, k):
        size = min(length, CHUNK)
        rows = x[start : start + length].view(-1, size)
        index = rows.abs().topk(kept, dim=1, sorted=False).indices.sort(dim=1).values
        values = rows.gather(1, index)
        scale = values.abs().amax(dim=1)
        high = values.abs() > scale[:, None] * _MIDPOINT
        codes.append((values < 0).to(torch.uint8) | (high.to(torch.uint8) << 1))
        scales.append(scale)
        indices.append(index)
    image = torch.empty(image_size(n, k), dtype=torch.uint8)
    if n == 0:
        return _bytes_of(image)
    nch, count = chunk_count(n), entry_count(n, k)
    image[: 4 * nch].copy_(torch.cat(scales).view(torch.uint8))
    code = torch.cat([c.reshape(-1) for c in codes])
    code = torch.cat((code, code.new_zeros(-count % 4))).view(-1, 4)
    packed = code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)
    image[4 * nch : 4 * nch + packed.numel()].copy_(packed)
    idx = torch.cat([i.reshape(-1) for i in indices]).to(torch.int32)
    idx = torch.cat((idx, idx.new_zeros(count % 2))).view(-1, 2)
    a, b = idx[:, 0], idx[:, 1]
    triples = torch.stack((a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4), dim=1).to(torch.uint8)
    image[4 * nch + packed.numel() :].copy_(triples.view(-1))
    return _bytes_of(image)


def decode(
    image: bytes | bytearray | memoryview, n: int, k: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The n fp32 values of an image made by `encode` (zeros where nothing was kept), written into
    `out` if given. ValueError, before anything is written, if the image is malformed (module notes)."""
    positions, values = entries(image, n, k)
    out = out if out is not None else torch.empty(n, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (n,), "flat fp32 out of n expected"
    out.zero_()
    out[positions] = values
    return out


def entries(image: bytes | bytearray | memoryview, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept entries of an image made by `encode`: their flat positions (int64, strictly increasing)
    and fp32 values, without the n-value dense vector (`decode` is these scattered into zeros). Same
    validation as `decode`: ValueError if the image is malformed (module notes)."""
    if len(image) != image_size(n, k):
        raise ValueError(f"a top-{k} image of {n} values has {image_size(n, k)} bytes, not {len(image)}")
    if n == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    raw = torch.frombuffer(bytearray(image), dtype=torch.uint8)  # (a copy: the checks read what we use)
    nch, count = chunk_count(n), entry_count(n, k)
    scales = raw[: 4 * nch].view(torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError("a top-k image holds a scale that is negative, NaN or infinite")
    packed = raw[4 * nch : 4 * nch + -(-count // 4)]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    code = ((packed[:, None] >> shifts) & 3).reshape(-1)[:count]
    triples = raw[4 * nch + packed.numel() :].to(torch.int64).view(-1, 3)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    index = torch.stack((a, b), dim=1).reshape(-1)[:count]
    positions, chunk_of = _positions(index, n, k)
    scale = scales[chunk_of]
    magnitude = torch.where((code & 2).bool(), scale, scale * LOW)
    return positions, torch.where((code & 1).bool(), -magnitude, magnitude)


def _positions(index: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions and chunk numbers of the entries' in-chunk indices; ValueError unless every
    index lies in its chunk and they increase strictly within each chunk."""
    positions, chunks = [], []
    done = 0
    for start, length, kept in _chunks(n, k):
        size = min(length, CHUNK)
        rows = index[done : done + (length // size) * kept].view(-1, kept)
        done += rows.numel()
        if bool((rows >= size).any()):
            raise ValueError(f"a top-k image holds an index beyond its chunk of {size} values")
        if kept > 1 and not bool((rows[:, 1:] > rows[:, :-1]).all()):
            raise ValueError("a top-k image holds a duplicate or unordered index within a chunk")
        first = start // CHUNK
        numbers = torch.arange(first, first + rows.shape[0])
        positions.append((rows + numbers[:, None] * CHUNK).reshape(-1))
        chunks.append(numbers.repeat_interleave(kept))
    return torch.cat(positions), torch.cat(chunks)


def compress(x: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """What peers decode of `x`'s image: decode(encode(x)), into `out` if given."""
    return decode(encode(x, k), x.numel(), k, out)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
