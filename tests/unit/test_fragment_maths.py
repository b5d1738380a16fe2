"""`--fragments K` (core/fragments.py): rounds of H/K steps each synchronise one flat range of Δ, with
the Nesterov step on that range's θ_g and momentum only; K = 1 is blocking DiLoCo bit for bit; a
snapshot taken mid-cycle resumes the schedule exactly."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.diloco import AveragedDelta, DilocoConfig
from swarmnode.core.fragments import FragmentPlan, round_steps, steps_in_rounds
from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.training import RunIdentity, TrainingRun, run_digest
from swarmnode.snapshot.metadata import SnapshotMetadata
from swarmnode.snapshot.read import read_snapshot
from swarmnode.snapshot.write import write_snapshot
from swarmnode.util.metrics import Metrics

NODE_ID = "ab" * 20
CFG = DilocoConfig(outer_lr=0.7, outer_momentum=0.9)


def fragment_run(fragments: int, outer_mix: float = CFG.outer_mix) -> TrainingRun:
    """A tiny node's training run with `--fragments fragments` (outer steps applied by hand)."""
    corpus = default_corpus()
    model = GptSpec.preset("tiny", corpus.vocab_size)
    diloco = DilocoConfig(
        outer_lr=CFG.outer_lr, outer_momentum=CFG.outer_momentum, outer_mix=outer_mix, fragments=fragments
    )
    loader = ShardLoader(corpus, 0, 16, 2, 32, seed=0)
    digest = run_digest(model, 32, 16, 0, diloco, corpus.digest)
    identity = RunIdentity("test", NODE_ID, digest, corpus.digest, "tiny")
    return TrainingRun(model, diloco, loader, corpus, identity, 0, torch.device("cpu"), Metrics())


def train(run: TrainingRun, steps: int) -> None:
    run.inner_phase(run.progress.round_step + steps, None, threading.Event(), lambda: None)


def local(run: TrainingRun) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in run.trainer.params]).clone()


def own_average(delta: torch.Tensor) -> AveragedDelta:
    """A group's average as the all-reduce returns it for this round's Δ: a shifted copy of it (so
    it is not our Δ), covering the whole range it was given."""
    return AveragedDelta(delta * 0.5 + 1e-4, ((0, delta.numel()),), 2)


def fragment_round(run: TrainingRun, steps: int) -> AveragedDelta:
    """One round: `steps` inner steps, its Δ averaged (`own_average`), its outer step applied."""
    train(run, steps)
    start = run.prepare_round()
    averaged = own_average(start.delta)
    run.apply_outer(averaged, {}, None)
    return averaged


def test_the_fragments_are_equal_disjoint_ranges_taken_in_turn() -> None:
    plan = FragmentPlan(1003, 4)
    assert plan.ranges == ((0, 250), (250, 501), (501, 752), (752, 1003))
    assert [plan.for_round(r) for r in range(6)] == [*plan.ranges, plan.ranges[0], plan.ranges[1]]
    with pytest.raises(ValueError, match="fragments"):
        FragmentPlan(3, 4)


def test_one_fragment_is_the_blocking_step_bit_for_bit() -> None:
    fragmented, blocking = fragment_run(1), fragment_run(1)
    tiny = GptSpec.preset("tiny", 256)
    assert run_digest(tiny, 32, 16, 0, DilocoConfig(fragments=1), "c") == run_digest(
        tiny, 32, 16, 0, DilocoConfig(), "c"
    )
    for _ in range(2):
        train(fragmented, 3)
        start = fragmented.prepare_round()
        assert start.delta is fragmented.trainer._delta and start.fragment == (0, start.delta.numel())
        averaged = own_average(start.delta)
        fragmented.apply_outer(averaged, {}, None)
        train(blocking, 3)  # what the trainer did before fragments: the whole Δ, the whole step
        blocking.trainer.outer_step(own_average(blocking.trainer.pseudo_gradient()))
    assert torch.equal(fragmented.trainer.global_flat, blocking.trainer.global_flat)
    assert torch.equal(fragmented.trainer.outer_momentum, blocking.trainer.outer_momentum)
    assert torch.equal(local(fragmented), local(blocking))


def test_each_fragment_takes_its_own_nesterov_step_once_per_h_inner_steps() -> None:
    k, round_steps = 4, 2  # H = 8
    run = fragment_run(k, outer_mix=0.0)  # DiLoCo's θ ← θ_g' on the fragment, to see it whole
    plan = run.fragments
    mu, lr = CFG.outer_momentum, CFG.outer_lr
    want_global, want_momentum = run.trainer.global_flat.clone(), torch.zeros_like(run.trainer.global_flat)
    moved = [0] * k
    for r in range(2 * k):
        before_global, before_momentum = run.trainer.global_flat.clone(), run.trainer.outer_momentum.clone()
        averaged = fragment_round(run, round_steps)
        a, b = plan.for_round(r)
        assert averaged.delta.numel() == b - a  # the all-reduce carried 1/K of Δ
        changed = (run.trainer.global_flat != before_global).nonzero().flatten()
        assert changed.min() >= a and changed.max() < b  # θ_g moved on this round's fragment only
        assert torch.equal(run.trainer.outer_momentum[:a], before_momentum[:a])
        assert torch.equal(run.trainer.outer_momentum[b:], before_momentum[b:])
        moved[r % k] += 1
        # The Nesterov step on the fragment's slice, its momentum that slice's own (torch.optim.SGD's).
        grad = averaged.delta
        want_momentum[a:b].mul_(mu).add_(grad)
        want_global[a:b].add_(grad.add(want_momentum[a:b], alpha=mu), alpha=-lr)
        assert torch.equal(run.trainer.global_flat, want_global)
        assert torch.equal(run.trainer.outer_momentum, want_momentum)
        theta = local(run)
        assert torch.equal(theta[a:b], run.trainer.global_flat[a:b])  # θ reset on the fragment
        assert not torch.equal(theta[:a], run.trainer.global_flat[:a]) or a == 0  # trains on elsewhere
    assert moved == [2] * k  # each fragment once per H = K · H/K inner steps
    assert run.progress.inner_step == 2 * k * round_steps and run.progress.outer_step == 2 * k


def test_a_fragments_delta_holds_all_its_work_since_its_own_last_step() -> None:
    k, round_steps = 2, 3
    run = fragment_run(k)
    fragment_round(run, round_steps)  # fragment 0 synchronised; fragment 1 goes on training
    train(run, round_steps)
    a, b = run.fragments.for_round(1)
    start = run.prepare_round()
    theta = local(run)
    assert torch.equal(start.delta, run.trainer.global_flat[a:b] - theta[a:b])  # 2·H/K steps of work


def test_the_overlapped_fragment_step_without_progress_is_the_blocking_one() -> None:
    blocking, overlapped = fragment_run(3), fragment_run(3)
    for run, overlap in ((blocking, False), (overlapped, True)):
        fragment_round(run, 2)
        train(run, 2)
        start = run.prepare_round()
        run.apply_outer(own_average(start.delta), {}, None, overlapped=start if overlap else None)
    assert torch.equal(overlapped.trainer.global_flat, blocking.trainer.global_flat)
    assert torch.equal(overlapped.trainer.outer_momentum, blocking.trainer.outer_momentum)
    torch.testing.assert_close(local(overlapped), local(blocking), rtol=0, atol=1e-6)


def test_a_snapshot_mid_cycle_resumes_the_fragment_schedule_exactly(tmp_path: Path) -> None:
    straight = fragment_run(3)
    for _ in range(4):  # one cycle and one fragment round
        fragment_round(straight, 2)
    train(straight, 1)  # and a step into the next round
    info, _ = write_snapshot(tmp_path, straight.state_tensors(), straight.state_metadata(), kind="hot")
    for _ in range(3):
        fragment_round(straight, 1 if _ == 0 else 2)
    loaded = read_snapshot(info.path)
    resumed = fragment_run(3)
    resumed.restore_own(loaded, SnapshotMetadata.parse(loaded.metadata))
    assert resumed.fragments.for_round(resumed.progress.outer_step) == straight.fragments.fragment(1)
    for _ in range(3):
        fragment_round(resumed, 1 if _ == 0 else 2)
    assert torch.equal(resumed.trainer.global_flat, straight.trainer.global_flat)
    assert torch.equal(resumed.trainer.outer_momentum, straight.trainer.outer_momentum)
    assert torch.equal(local(resumed), local(straight))
    assert resumed.progress.committed_cursor == straight.progress.committed_cursor


def test_k_rounds_make_h_steps_when_k_does_not_divide_h() -> None:
    assert [round_steps(50, 4, r) for r in range(8)] == [12, 13, 12, 13, 12, 13, 12, 13]
    assert [round_steps(10, 1, r) for r in range(3)] == [10, 10, 10]  # K = 1: H every round
    assert all(steps_in_rounds(50, 4, r) == sum(round_steps(50, 4, i) for i in range(r)) for r in range(9))
