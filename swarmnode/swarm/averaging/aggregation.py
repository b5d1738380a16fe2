"""The robust outer step's maths: what a reducer makes of its part's contributions (no gRPC, no I/O).

Four steps, each on one part of Δ (a reducer's slice; every member's contribution to it):

1. **Screen** (`robust_filter`): a contribution holding NaN/Inf is left out, and so is one whose L2 norm
   is over `max_norm_ratio` × the lower median of the part's norms (`--max-norm-ratio`).
2. **Opposed** (`opposed_filter`, dense wires): a minority of contributions that point against the
   contributions' coordinate-wise median — a negative cosine to it, at least OPPOSED_SHARE as large as
   the part's median cosine is positive: against what most members moved — is left out. CenteredClip
   (next) bounds such a member's pull only by its radius, the honest members' spread, which over a long
   inner phase is as large as the step itself, and a flip of a member's own Δ at a few times its norm
   lies near that radius; honest contributions of one round point the same way, so an honest round
   leaves nobody out (both measured: docs/benchmarks.md "Robust outer step"). Not on a top-k wire:
   there the median is zero except where two members' kept values agree in sign, so the cosine says
   little of a member.
3. **CenteredClip** (`centered_clip`; Karimireddy, He and Jaggi 2021, "Learning from History for
   Byzantine Robust Optimization"; Gorbunov et al. 2022, "Secure Distributed Training at Scale", the
   aggregator of hivemind's BTARD), once any contribution lies farther than FAR × the median distance
   of the contributions to their coordinate-wise median (a start a minority cannot move outside the
   majority's per-coordinate range): from that start, CLIP_ITERATIONS steps
   v ← v + Σᵢ (wᵢ/Σw) · min(1, τ/‖xᵢ − v‖) · (xᵢ − v) with the radius τ = CLIP_RADIUS × that median
   distance. A member of weight w pulls v by at most (w/Σw)·τ a step whatever it sends — any direction,
   any norm under the screen — so a minority's influence is bounded by the honest members' own spread,
   not by its own norm. (A member that stays within FAR × the median distance is not clipped: its pull
   is at most (w/Σw)·FAR times that distance, the bound's other half.)
4. **Mean** when nobody is far: the plain token-weighted mean in member order (`average`), bit for bit
   what an honest round gave before, so honest rounds pay the median and the distances and nothing in
   their result.

Groups of fewer than CLIP_MIN_MEMBERS take the mean after the screen: with two members neither can be
told from the other (their median is their midpoint). So do parts of fewer than CLIP_MIN_VALUES values:
an honest member's distance to the median concentrates only over many coordinates (over one value, one
honest member in four lies beyond FAR × the median distance about as often as not), and a part that
small exists only when the whole Δ has fewer than CLIP_MIN_VALUES × N values, which no model has.

The choice of CenteredClip over a coordinate-wise median or trimmed mean: those replace the mean in
every round (a median of 3–8 noisy Δs is a worse estimate of their mean: the honest cost), while
CenteredClip is the mean whenever nobody is far, and its bound holds in whole-vector terms (a median's
holds per coordinate only). Measured: docs/benchmarks.md
"Robust outer step".
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import torch

from swarmnode.swarm.averaging import codecs
from swarmnode.swarm.averaging.wire import is_sparse
from swarmnode.util.labels import Exclusion

FAR = 2.0
"""A contribution farther than FAR × the median distance from the coordinate-wise median makes the
reducer clip; with none that far, the round is the plain mean."""
CLIP_RADIUS = 1.0
"""τ as a multiple of the median distance of a part's contributions to their coordinate-wise median
(1.0 against 0.5 and 2.0: docs/benchmarks.md "Robust outer step")."""
OPPOSED_SHARE = 0.25
"""A contribution is opposed when it points against the coordinate-wise median at least this share as
strongly (cosine, against the median cosine of the part's contributions) as the part's contributions
point along it: a round whose honest members agree little (late in training, all noise) leaves none out."""
CLIP_ITERATIONS = 3
CLIP_MIN_MEMBERS = 3
CLIP_MIN_VALUES = 64

Contribution = tuple[int, float, "torch.Tensor | bytearray | memoryview"]
"""(member index, token weight, values or their wire image)."""
_Weighted = list[tuple[int, float, torch.Tensor]]
_Centre = tuple[list[torch.Tensor], torch.Tensor]
"""Contributions' values as fp32 rows, and their coordinate-wise median."""


@dataclass(frozen=True)
class Averaged:
    """A reducer's result: its wire image and the image's decoded values (None: not averaged), and the
    members (indices, ascending) whose contributions it averages."""

    included: tuple[int, ...] = ()
    image: memoryview | None = None
    values: torch.Tensor | None = None
    excluded: tuple[tuple[int, Exclusion], ...] = ()
    """Members whose contributions the robust aggregation left out, and why."""
    clipped: tuple[int, ...] = ()
    """Members (among `included`) whose contributions CenteredClip pulled in to its radius."""
    relay: tuple[tuple[int, float, memoryview], ...] = ()
    """A top-k wire's reducer: (member, weight, image) of every contribution of positive weight that
    arrived whole, its own included, in member order: what it sends its callers (`allreduce.py`)."""

    @property
    def contributors(self) -> int:
        return len(self.included)


def average(
    contributions: list[Contribution],
    wire_dtype: str,
    n: int,
    max_norm_ratio: float = 8.0,
    acc: torch.Tensor | None = None,
    values_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    clip: bool = True,
) -> Averaged:
    """The part's robust average (see the module notes) of the contributions of positive weight, then
    its wire image and the image's decoded values, which is what every member applies, the members it
    averages, those it left out and those it clipped. With nobody far, Σᵢ (wᵢ / Σw) Δᵢ in fp32 in member
    order, so equal weights give exactly (Δ₀ + Δ₁) / 2. `max_norm_ratio` inf: the plain mean of the
    finite contributions (the benches' anchor). `acc` (n fp32 values, any content) holds the result,
    which for fp32 is the image; the decoded values go into `values_out` (n fp32 values) if given.
    `scratch` (n fp32 values): where a bf16 contribution is widened before it is added, which is exact
    and several times faster than torch's mixed-dtype add. `clip` False: the screen alone (the benches'
    "before"). Runs on a worker thread."""
    if is_sparse(wire_dtype):
        return _sparse_average(
            contributions, wire_dtype, n, max_norm_ratio, values_out if values_out is not None else acc, clip
        )
    decoded: _Weighted = []
    for index, weight, data in contributions:
        if weight > 0:
            values = data if isinstance(data, torch.Tensor) else codecs.wire_values(data, wire_dtype, n)
            decoded.append((index, weight, values))
    kept, excluded = robust_filter(decoded, max_norm_ratio)
    if not kept:
        return Averaged(excluded=excluded)
    acc = acc if acc is not None else torch.empty(n, dtype=torch.float32)
    clipped = None
    if clip and math.isfinite(max_norm_ratio):
        kept, opposed, known = opposed_filter(kept)
        excluded += opposed
        clipped = centered_clip(kept, acc, known=known)
    if clipped is None:
        _weighted_mean(kept, acc, scratch)
    included = tuple(index for index, _, _ in kept)
    image = codecs.encode(acc, wire_dtype)
    values = codecs.decode(image, wire_dtype, n, values_out)
    return Averaged(included, image, values, excluded, clipped or ())


def _sparse_average(
    contributions: list[Contribution],
    wire_dtype: str,
    n: int,
    max_norm_ratio: float,
    out: torch.Tensor | None,
    clip: bool,
) -> Averaged:
    """`average` on a top-k wire, computed on the kept entries alone: the screen on their norms, then
    CenteredClip or the weighted mean on the coordinates where any kept contribution has an entry
    (everywhere else every contribution, their median, every step of the clip and the mean are 0),
    scattered into `out`. The same maths as on the dense vectors (the mean bit for bit: the same adds
    in the same order), at a cost that follows the entries (N·density·n) rather than N·n, and never N
    dense copies of a part in memory (a 1B model's part is GBs). The opposed filter is not taken (see
    the module notes). Every member aggregates the relayed contributions itself: no image. ValueError
    if an image does not validate."""
    positions: dict[int, torch.Tensor] = {}
    decoded: _Weighted = []
    for index, weight, data in contributions:
        if weight > 0:
            positions[index], values = _entries(data, wire_dtype, n)
            decoded.append((index, weight, values))
    kept, excluded = robust_filter(decoded, max_norm_ratio)
    if not kept:
        return Averaged(excluded=excluded)
    out = out if out is not None else torch.empty(n, dtype=torch.float32)
    out.zero_()
    support = torch.unique(torch.cat([positions[index] for index, _, _ in kept]))  # (sorted)
    rows: _Weighted = []
    for index, weight, values in kept:
        row = torch.zeros(support.numel(), dtype=torch.float32)
        row[torch.searchsorted(support, positions[index])] = values
        rows.append((index, weight, row))
    on_support = torch.empty(support.numel(), dtype=torch.float32)
    clipped = None
    if clip and math.isfinite(max_norm_ratio):
        clipped = centered_clip(rows, on_support, numel=n)
    if clipped is None:
        _weighted_mean(rows, on_support, None)
    out[support] = on_support
    included = tuple(index for index, _, _ in kept)
    return Averaged(included, None, out, excluded, clipped or ())


def _entries(
    data: torch.Tensor | bytearray | memoryview, wire_dtype: str, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k contribution's non-zero entries: from its image (validated), or from a dense tensor."""
    if isinstance(data, torch.Tensor):
        where = torch.nonzero(data).squeeze(1)  # (NaN is non-zero: the screen sees it)
        return where, data[where].float()
    return codecs.entries(data, wire_dtype, n)


def _weighted_mean(kept: _Weighted, acc: torch.Tensor, scratch: torch.Tensor | None) -> None:
    total = sum(weight for _, weight, _ in kept)
    acc.zero_()
    for _, weight, values in kept:
        if scratch is not None and values.dtype != torch.float32:
            values = scratch.copy_(values)
        acc.add_(values, alpha=weight / total)


def robust_filter(
    contributions: _Weighted, max_norm_ratio: float
) -> tuple[_Weighted, tuple[tuple[int, Exclusion], ...]]:
    """The screen: a contribution whose L2 norm is not finite (NaN/Inf, or overflowing fp32) is left
    out; so is one whose norm is over `max_norm_ratio` × the lower median of the finite norms (with two
    members, the smaller: one honest member is enough to screen the other). Returns the kept
    contributions and the left-out ones' indices and reasons."""
    kept: _Weighted = []
    excluded: list[tuple[int, Exclusion]] = []
    if math.isinf(max_norm_ratio):  # screening off (the all-reduce bench's anchor): finite values only
        for contribution in contributions:
            if _finite(contribution[2]):
                kept.append(contribution)
            else:
                excluded.append((contribution[0], Exclusion.NONFINITE))
        return kept, tuple(excluded)
    norms = [float(torch.linalg.vector_norm(values, dtype=torch.float32)) for _, _, values in contributions]
    finite = sorted(x for x in norms if math.isfinite(x))
    bound = max_norm_ratio * finite[(len(finite) - 1) // 2] if finite else math.inf
    for contribution, norm in zip(contributions, norms, strict=True):
        if not math.isfinite(norm):
            excluded.append((contribution[0], Exclusion.NONFINITE))
        elif norm > bound > 0:
            excluded.append((contribution[0], Exclusion.NORM))
        else:
            kept.append(contribution)
    return kept, tuple(excluded)


def opposed_filter(
    contributions: _Weighted,
) -> tuple[_Weighted, tuple[tuple[int, Exclusion], ...], _Centre | None]:
    """Leaves out a minority of contributions that point against the coordinate-wise median (a cosine
    to it below −OPPOSED_SHARE × the contributions' median cosine: see the module notes). Returns the
    kept contributions, the left-out ones, and the kept ones' fp32 rows and median when they are still
    theirs (nothing left out; None otherwise, or when the group or part is too small to tell, as for
    CenteredClip)."""
    if len(contributions) < CLIP_MIN_MEMBERS or contributions[0][2].numel() < CLIP_MIN_VALUES:
        return contributions, (), None
    rows = [values.float() for _, _, values in contributions]
    centre = coordinate_median(rows)
    along = [_along(x, centre) for x in rows]
    bar = -OPPOSED_SHARE * statistics.median(along)
    opposed = {index for (index, _, _), a in zip(contributions, along, strict=True) if a < min(bar, 0.0)}
    if not opposed or 2 * len(opposed) >= len(contributions):  # a majority is no minority to leave out
        return contributions, (), (rows, centre)
    kept = [c for c in contributions if c[0] not in opposed]
    return kept, tuple((index, Exclusion.OPPOSED) for index in sorted(opposed)), None


def centered_clip(
    contributions: _Weighted,
    out: torch.Tensor,
    radius: float = CLIP_RADIUS,
    iterations: int = CLIP_ITERATIONS,
    known: _Centre | None = None,
    numel: int | None = None,
) -> tuple[int, ...] | None:
    """CenteredClip of finite contributions into `out` (see the module notes); returns the members it
    clipped, or None — `out` untouched — when every contribution lies within the radius of the
    coordinate-wise median, or there are fewer than CLIP_MIN_MEMBERS or CLIP_MIN_VALUES (the weighted
    mean is then the answer). `known`: their fp32 rows and coordinate-wise median (which this changes),
    if already made. `numel`: the contributions' length when the rows hold only the coordinates where
    any of them is non-zero (a top-k wire's), which is what CLIP_MIN_VALUES counts."""
    length = numel if numel is not None else contributions[0][2].numel()
    if len(contributions) < CLIP_MIN_MEMBERS or length < CLIP_MIN_VALUES:
        return None
    if known is None:
        rows = [values.float() for _, _, values in contributions]
        centre = coordinate_median(rows)
    else:
        rows, centre = known
    buffer = torch.empty_like(centre)
    distances = [_distance(x, centre, buffer) for x in rows]
    median_distance = statistics.median(distances)
    tau = radius * median_distance
    if not tau > 0 or max(distances) <= FAR * median_distance:
        return None
    total = sum(weight for _, weight, _ in contributions)
    clipped: set[int] = set()
    for _ in range(iterations):
        step = buffer.zero_()
        pulled = 0.0
        for (index, weight, _), x, distance in zip(contributions, rows, distances, strict=True):
            share = weight / total * (min(1.0, tau / distance) if distance > 0 else 1.0)
            if distance > tau:
                clipped.add(index)
            step.add_(x, alpha=share)
            pulled += share
        centre.mul_(1.0 - pulled).add_(step)  # v + Σ cᵢ (xᵢ − v)
        distances = [_distance(x, centre, buffer) for x in rows]
    out.copy_(centre)
    return tuple(sorted(clipped))


def coordinate_median(rows: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of equally long fp32 rows (the mean of the middle two for an even
    count, so two rows give their midpoint). By a sorting network pruned to the middle (elementwise
    min/max: a few passes over memory, several times faster than `sort(dim=0)` across rows)."""
    k = len(rows)
    if k == 1:
        return rows[0].clone()
    work = list(rows)  # (the comparators make new tensors: the contributions stay as they are)
    for a, b in _median_network(k):
        work[a], work[b] = torch.minimum(work[a], work[b]), torch.maximum(work[a], work[b])
    return work[k // 2] if k % 2 else (work[k // 2 - 1] + work[k // 2]) / 2


@functools.lru_cache(maxsize=64)
def _median_network(k: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort network for `k` inputs (that of the next power of two, less the
    comparators that touch a missing input: they would stand at the end as +inf, never moving), keeping
    only the comparators the middle output(s) depend on."""
    size = 1
    while size < k:
        size *= 2
    network = []
    p = 1
    while p < size:
        step = p
        while step >= 1:
            for j in range(step % p, size - step, 2 * step):
                for i in range(min(step, size - j - step)):
                    if (i + j) // (2 * p) == (i + j + step) // (2 * p) and i + j + step < k:
                        network.append((i + j, i + j + step))
            step //= 2
        p *= 2
    needed = {k // 2} | ({k // 2 - 1} if k % 2 == 0 else set())
    kept = []
    for a, b in reversed(network):
        if a in needed or b in needed:
            kept.append((a, b))
            needed |= {a, b}
    return tuple(reversed(kept))


def _along(x: torch.Tensor, centre: torch.Tensor) -> float:
    """How far x points along the centre, per unit of its own norm (the cosine times ‖centre‖)."""
    norm = float(torch.linalg.vector_norm(x))
    return float(torch.dot(x, centre)) / norm if norm > 0 else 0.0


def _distance(x: torch.Tensor, centre: torch.Tensor, buffer: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(torch.sub(x, centre, out=buffer)))


def _finite(values: torch.Tensor) -> bool:
    """Whether every value is finite. A sum is NaN or ±inf if any value is, and is much cheaper than
    `isfinite` (docs/benchmarks.md "Robust aggregation's bound"); only a sum that overflowed from finite
    values needs the full check."""
    return bool(values.sum().isfinite()) or bool(torch.isfinite(values).all())
