"""`--fragments K`: Streaming DiLoCo's staggered fragments (Douillard et al. 2025, §2.1).

Δ (n values, flat, in parameter order) is cut into K contiguous flat ranges of equal size,
fragment p = [p·n/K, (p+1)·n/K), and the rounds take the fragments in turn: a round is H/K inner steps,
and round r synchronises fragment p = r mod K only. Round r ends at inner step ⌊(r+1)·H/K⌋ of the run's
schedule (`round_steps`: H/K steps each when K divides H, else ⌊H/K⌋ or ⌈H/K⌉ in turn, K rounds
always making H steps), so fragment p is synchronised at the inner steps t ≡ ⌊(p+1)·H/K⌋ (mod H),
once every H steps, and a node runs K all-reduces of n/K values per H steps instead of one of n: the
peak bandwidth drops K×. Round r's outer step, on fragment p's range F only:

    Δ_F  = θ_g[F] − θ[F]                         (θ[F] trained locally since fragment p's last step)
    m'_F = μ·m_F + Δ̄_F,   θ_g'[F] = θ_g[F] − lr·(Δ̄_F + μ·m'_F)    (Nesterov on that slice only)
    θ[F] ← θ_g'[F]                               (blocking; `--overlap on`: the overlapped merge on F)

and θ_g, its momentum and θ stay as they are outside F (θ keeps training there). This is exactly a
round whose all-reduce covered only F (`AveragedDelta.covered`): the all-reduce runs on the contiguous
view Δ[F], its result is placed back in flat coordinates (`FragmentPlan.lift`), and the trainer's outer
steps apply it unchanged, carried ranges and partial coverage included. K = 1 is blocking DiLoCo
bit for bit (the whole range: `slice` and `lift` return what they were given).

Why contiguous ranges balanced by size, not Streaming DiLoCo's strided layer groups: the transport,
the coverage policy and the outer steps all work on flat ranges already, so a fragment is one range
that is sent as a view (no gather or scatter copies) and needs no second path; equal sizes make every
round's bytes exactly n/K, whatever the tensors' sizes (`tiny`'s run from 128 to 65,536 values, and
it has 2 blocks: groups of whole tensors or layers strided by index would be far apart in size).
The price: a fragment is a band of consecutive layers, not layers strided across depth.

The fragment a round takes is a function of the swarm's round counter (the outer step), which every
snapshot keeps, so a restored or repaired node resumes at the exact place in the schedule.

Failure semantics (docs/design.md "Fragments"): the members agree on the global digest (all of θ_g) after
every fragment's step; snapshots are taken only where no round is in flight; a fragment round opens
and settles its ledger range as a blocking round does. A node that dies or repairs from a peer
restarts from θ_g everywhere at its last averaged round's cursor: its work on the other fragments
since their own last steps is lost, never counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

Range = tuple[int, int]

if TYPE_CHECKING:  # (no torch at import: the node's config reads `round_steps`)
    import torch

    from swarmnode.core.diloco import AveragedDelta


def round_steps(inner_steps: int, fragments: int, outer_step: int) -> int:
    """Inner steps of round `outer_step`: ⌊(r+1)·H/K⌋ − ⌊r·H/K⌋ (H: `inner_steps`, K: `fragments`)."""
    return (outer_step + 1) * inner_steps // fragments - outer_step * inner_steps // fragments


def steps_in_rounds(inner_steps: int, fragments: int, rounds: int) -> int:
    """Inner steps of rounds 0 … rounds−1 together: ⌊rounds·H/K⌋."""
    return rounds * inner_steps // fragments


@dataclass(frozen=True)
class FragmentPlan:
    """How Δ of `numel` values is cut into `count` fragments, and which one each round takes."""

    numel: int
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= max(self.numel, 1):
            raise ValueError(f"fragments: must be in 1..{self.numel}, got {self.count}")

    def fragment(self, index: int) -> Range:
        """Fragment `index`'s flat range [a, b)."""
        return index * self.numel // self.count, (index + 1) * self.numel // self.count

    def for_round(self, outer_step: int) -> Range:
        """The range round `outer_step` synchronises: fragment outer_step mod K."""
        return self.fragment(outer_step % self.count)

    @property
    def ranges(self) -> tuple[Range, ...]:
        return tuple(self.fragment(p) for p in range(self.count))

    def whole(self, fragment: Range) -> bool:
        """Whether `fragment` is all of Δ (K = 1): its Δ is Δ itself and its average needs no lifting."""
        return fragment == (0, self.numel)

    def delta_of(self, delta: torch.Tensor, fragment: Range) -> torch.Tensor:
        """Δ[F] as a contiguous view of the flat Δ (Δ itself for the whole range)."""
        a, b = fragment
        return delta if self.whole(fragment) else delta[a:b]

    def lift(self, averaged: AveragedDelta, fragment: Range) -> AveragedDelta:
        """A fragment round's average (ranges relative to F) in flat coordinates
        (`AveragedDelta.placed_at`; the whole range: `averaged` itself)."""
        if self.whole(fragment):
            return averaged
        assert averaged.delta.numel() == fragment[1] - fragment[0], (averaged.delta.numel(), fragment)
        return averaged.placed_at(fragment[0], self.numel)
