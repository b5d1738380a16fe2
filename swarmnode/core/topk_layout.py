"""The top-k wire's layout without torch (`core/sparse.py` has the codec and its notes): the chunk size,
a density's k, the wire's names and an image's size. The flag table, `status` and the wire's checks
read them, and none of those may import torch."""

from __future__ import annotations

import re

CHUNK = 4096
"""Values per chunk (SparseLoCo's); an in-chunk index fits 12 bits."""
DEFAULT_DENSITY = 0.01
"""Kept share of Δ's entries: about the most that still sends 100× fewer bytes than fp32 in a group of 4
(k = 41: 1.85 bytes an entry; docs/benchmarks.md "Top-k wire" has the measurement)."""
DEFAULT_OUTER_LR = 2.0
"""α of the top-k wire's outer step θ_g ← θ_g − α·mean(ĉ). SparseLoCo's paper uses 1; 2 ended lower in
held-out loss at 1% on the quality bench's tiny model at H = 100 and at H = 25, and 3 and 5 higher
(docs/benchmarks.md "Top-k wire")."""


def kept_per_chunk(density: float) -> int:
    """k of a density: round(density · CHUNK), at least 1."""
    if not 0 < density <= 1:
        raise ValueError(f"top-k density must be in (0, 1], got {density}")
    return max(1, min(CHUNK, round(density * CHUNK)))


_NAME = re.compile(r"topk([1-9][0-9]{0,3})")


def wire_name(k: int) -> str:
    """The wire dtype of top-k with k entries per chunk (`topk41`)."""
    assert 1 <= k <= CHUNK, k
    return f"topk{k}"


def parse_wire_name(wire_dtype: str) -> int | None:
    """k of a top-k wire dtype name; None for any other name."""
    match = _NAME.fullmatch(wire_dtype)
    if match is None or int(match.group(1)) > CHUNK:
        return None
    return int(match.group(1))


def chunk_count(n: int) -> int:
    return -(-n // CHUNK)


def entry_count(n: int, k: int) -> int:
    """Kept entries of n values: k per whole chunk, min(k, its length) in a last, shorter one."""
    return (n // CHUNK) * k + min(k, n % CHUNK)


def image_size(n: int, k: int) -> int:
    entries = entry_count(n, k)
    return 4 * chunk_count(n) + -(-entries // 4) + 3 * -(-entries // 2)
