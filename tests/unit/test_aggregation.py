"""The robust outer step's maths (swarm/averaging/aggregation.py): honest rounds keep their exact mean,
and one member in four, whatever it sends, moves the result by at most the clip radius."""

from __future__ import annotations

import statistics

import pytest
import torch

from swarmnode.core import sparse
from swarmnode.swarm.averaging.aggregation import (
    CLIP_MIN_VALUES,
    CLIP_RADIUS,
    OPPOSED_SHARE,
    average,
    centered_clip,
    coordinate_median,
)

N = 4096


def honest_deltas(count: int, spread: float = 0.5, seed: int = 0) -> list[torch.Tensor]:
    """Δs that share a direction (the round's progress) and differ by their own data's noise."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(N, generator=g)
    return [common + spread * torch.randn(N, generator=g) for _ in range(count)]


def radius(rows: list[torch.Tensor]) -> float:
    """τ as the aggregator computes it from these rows."""
    centre = coordinate_median(rows)
    return CLIP_RADIUS * statistics.median(float((x - centre).norm()) for x in rows)


def attacks(honest: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    mean = torch.stack(honest).mean(0)
    g = torch.Generator().manual_seed(99)
    direction = torch.randn(N, generator=g)
    return {
        "sign flip x7": -7 * honest[0],
        "constant direction x7": direction / direction.norm() * 7 * honest[0].norm(),
        "noise of the honest norm": torch.randn(N, generator=g) / N**0.5 * honest[0].norm(),
        "-4x the mean": -4 * mean,
        "x1e4": 1e4 * honest[0],
    }


def test_an_honest_round_is_the_plain_weighted_mean_bit_for_bit() -> None:
    deltas = honest_deltas(4)
    weights = [2560.0, 2560.0, 1280.0, 2560.0]
    contributions = [(k, w, d) for k, (w, d) in enumerate(zip(weights, deltas, strict=True))]
    robust = average(contributions, "fp32", N)
    plain = average(contributions, "fp32", N, float("inf"))
    assert robust.clipped == () and robust.values is not None and plain.values is not None
    assert torch.equal(robust.values, plain.values)
    expected = sum((w / sum(weights)) * d for w, d in zip(weights, deltas, strict=True))
    assert torch.allclose(robust.values, expected, atol=1e-6)


@pytest.mark.parametrize("members", [3, 4, 8])
def test_one_member_whatever_it_sends_moves_the_result_by_at_most_the_radius(members: int) -> None:
    honest = honest_deltas(members - 1)
    honest_mean = torch.stack(honest).mean(0)
    for name, attack in attacks(honest).items():
        rows = [*honest, attack]
        out = torch.empty(N)
        clipped = centered_clip([(k, 1.0, x) for k, x in enumerate(rows)], out)
        assert clipped is not None and members - 1 in clipped, (name, clipped)
        moved = float((out - honest_mean).norm())
        assert moved <= radius(rows), (name, moved, radius(rows))
        plain_moved = float((torch.stack(rows).mean(0) - honest_mean).norm())
        if name != "noise of the honest norm":  # (that one the mean bounds about as well)
            assert plain_moved > 2 * moved, (name, plain_moved, moved)  # what the mean lets through


def test_the_screen_still_leaves_out_the_non_finite_and_the_huge_and_clips_the_rest() -> None:
    honest = honest_deltas(4)
    nan = honest[0].clone()
    nan[7] = float("nan")
    contributions = [(k, 1.0, honest[k]) for k in range(4)] + [(4, 1.0, nan)]
    contributions += [(5, 1.0, -3 * honest[0]), (6, 1.0, 7 * honest[1]), (7, 1.0, 1e4 * honest[2])]
    averaged = average(contributions, "fp32", N)
    assert dict(averaged.excluded) == {4: "nonfinite", 5: "opposed", 7: "norm"}
    assert averaged.included == (0, 1, 2, 3, 6) and 6 in averaged.clipped


def test_two_members_are_averaged_as_they_are() -> None:
    a, b = honest_deltas(1)[0], -7 * honest_deltas(1, seed=1)[0]
    out = torch.empty(N)
    assert centered_clip([(0, 1.0, a), (1, 1.0, b)], out) is None
    averaged = average([(0, 1.0, a), (1, 1.0, b)], "fp32", N)
    assert averaged.clipped == () and averaged.values is not None
    assert torch.allclose(averaged.values, (a + b) / 2)


def test_the_clipped_result_travels_on_every_wire() -> None:
    honest = honest_deltas(3)
    rows = [*honest, 7 * honest[0]]  # far, but along the others (pointing against them: left out)
    reference = torch.empty(N)
    centered_clip([(k, 1.0, x) for k, x in enumerate(rows)], reference)
    for wire in ("bf16", "int8", "int4"):
        averaged = average([(k, 1.0, x) for k, x in enumerate(rows)], wire, N)
        assert 3 in averaged.clipped and averaged.values is not None
        error = float((averaged.values - reference).norm() / reference.norm())
        assert error < 0.2, (wire, error)  # the codec's own rounding, not the attacker


def test_the_coordinate_median_takes_the_middle_or_the_midpoint() -> None:
    rows = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, -1.0]), torch.tensor([100.0, 2.0])]
    assert torch.equal(coordinate_median(rows), torch.tensor([3.0, 2.0]))
    assert torch.equal(coordinate_median(rows[:2]), torch.tensor([2.0, 2.0]))


def test_a_part_of_a_few_values_is_the_plain_mean() -> None:
    """Over a few coordinates honest distances do not concentrate: four independent draws of three
    values (the all-reduce test's case) would be clipped as if one were hostile."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(3, generator=g) for _ in range(4)]
    averaged = average([(k, 1.0, x) for k, x in enumerate(rows)], "fp32", 3)
    assert averaged.clipped == () and averaged.values is not None
    assert torch.allclose(averaged.values, torch.stack(rows).mean(0))
    wide = [torch.randn(CLIP_MIN_VALUES, generator=g) for _ in range(3)]
    wide.append(7 * wide[0])
    assert 3 in average([(k, 1.0, x) for k, x in enumerate(wide)], "fp32", CLIP_MIN_VALUES).clipped


@pytest.mark.parametrize("k", list(range(1, 17)))
def test_the_median_network_gives_the_sorted_middle_for_any_group_size(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    rows = [torch.randn(257, generator=g) for _ in range(k)]
    rows.append(rows[0].clone())  # (ties)
    ordered = torch.stack(rows).sort(dim=0).values
    m = len(rows)
    expected = ordered[m // 2] if m % 2 else (ordered[m // 2 - 1] + ordered[m // 2]) / 2
    originals = [row.clone() for row in rows]
    assert torch.equal(coordinate_median(rows), expected)
    assert all(torch.equal(a, b) for a, b in zip(rows, originals, strict=True))  # inputs untouched


@pytest.mark.parametrize("members", [3, 4, 8])
@pytest.mark.parametrize("k", [1.0, 2.0, 4.0, 7.0])
def test_a_member_pointing_against_the_others_is_left_out_on_a_dense_wire(members: int, k: float) -> None:
    """A flip at 1-4x its norm stays near the clip radius, where CenteredClip lets it pull the result
    by about the radius; left out, the round is the honest members' mean."""
    honest = honest_deltas(members - 1, spread=1.0)
    rows = [*honest, -k * honest[0]]
    averaged = average([(i, 1.0, x) for i, x in enumerate(rows)], "fp32", N)
    assert dict(averaged.excluded) == {members - 1: "opposed"}
    assert averaged.values is not None and averaged.included == tuple(range(members - 1))
    assert torch.allclose(averaged.values, torch.stack(honest).mean(0), atol=1e-6)


def test_honest_rounds_and_an_opposed_majority_leave_nobody_out() -> None:
    """Honest members of the same round point the same way; a majority against the median is no
    minority to leave out (CenteredClip bounds the round as before)."""
    for members in (3, 4, 8):
        for spread in (0.5, 1.0, 1.5):
            honest = honest_deltas(members, spread=spread, seed=members)
            assert average([(i, 1.0, x) for i, x in enumerate(honest)], "fp32", N).excluded == ()
    honest = honest_deltas(2)
    rows = [*honest, -honest[0], -honest[1]]
    assert average([(i, 1.0, x) for i, x in enumerate(rows)], "fp32", N).excluded == ()


def test_a_top_k_wire_is_not_screened_for_direction() -> None:
    """A sparse contribution's inner product with the median (zero where fewer than two members kept
    values of one sign) says little of it: the top-k wire clips only."""
    honest = honest_deltas(3)
    rows = [*honest, -2 * honest[0]]
    known = [(i, 1.0, x) for i, x in enumerate(rows)]
    assert average(known, "fp32", N).excluded == ((3, "opposed"),)
    assert average(known, sparse.wire_name(41), N).excluded == ()


def test_a_member_slightly_against_a_round_of_little_agreement_is_kept() -> None:
    """Late in training the members' Δs are mostly noise and agree little: a member a little against
    their median is one of them, not an attacker (it is left out only when it points against the
    median at least OPPOSED_SHARE as much as the members point along it)."""
    honest = honest_deltas(3, spread=6.0)
    g = torch.Generator().manual_seed(7)
    common = torch.stack(honest).mean(0)
    for lean, left_out in ((1.0, False), (3.0, True)):
        rows = [*honest, 6.0 * torch.randn(N, generator=g) - lean * common]
        centre = coordinate_median(rows)
        cosines = [float(x.dot(centre) / x.norm() / centre.norm()) for x in rows]
        assert cosines[3] < 0 and (cosines[3] < -OPPOSED_SHARE * statistics.median(cosines)) == left_out, (
            cosines
        )
        averaged = average([(i, 1.0, x) for i, x in enumerate(rows)], "fp32", N)
        assert averaged.excluded == (((3, "opposed"),) if left_out else ()), cosines


@pytest.mark.parametrize("far", [False, True])
def test_a_top_k_part_is_aggregated_on_its_entries_as_on_the_dense_vectors(far: bool) -> None:
    """The top-k wire's aggregation works on the kept entries alone (the coordinates nobody kept stay 0
    through the screen, the median, every clip step and the mean), and gives what the dense maths
    gives: an honest round's mean bit for bit, a clipped one to rounding (its norms add in another order)."""
    k, n = 41, 8 * sparse.CHUNK + 100
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(n, generator=g) for _ in range(3)]
    rows = [*honest, (-5 if far else 1) * honest[0] + 0.1 * torch.randn(n, generator=g)]
    weights = [2560.0, 1280.0, 2560.0, 1000.0]
    images = [
        (i, w, bytearray(sparse.encode(x, k))) for i, (w, x) in enumerate(zip(weights, rows, strict=True))
    ]
    decoded = [(i, w, sparse.decode(image, n, k)) for i, w, image in images]
    averaged = average(images, sparse.wire_name(k), n)
    assert averaged.values is not None and averaged.excluded == ()
    if far:
        expected = torch.empty(n)
        assert centered_clip(decoded, expected) == averaged.clipped and 3 in averaged.clipped
        assert torch.allclose(averaged.values, expected, rtol=1e-5, atol=1e-7)
    else:
        mean = average(decoded, "fp32", n)
        assert mean.values is not None and mean.clipped == averaged.clipped == ()
        assert torch.equal(averaged.values, mean.values)
    assert torch.equal(averaged.values == 0, torch.stack([x for _, _, x in decoded]).abs().sum(0) == 0)


def test_a_top_k_part_is_aggregated_without_a_dense_copy_per_member() -> None:
    """A 1B model's part is GBs: the aggregation allocates memory by the kept entries, never a dense
    vector per member (its result goes into the caller's buffer)."""
    k, n = 41, 64 * sparse.CHUNK
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, generator=g) for _ in range(3)]
    rows.append(-5 * rows[0])  # far (under the screen): CenteredClip runs
    images = [(i, 1.0, bytearray(sparse.encode(x, k))) for i, x in enumerate(rows)]
    out = torch.empty(n)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        averaged = average(images, sparse.wire_name(k), n, values_out=out)
    assert averaged.clipped and averaged.values is out
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < n * 4 // 2, largest  # under half of one dense fp32 part
