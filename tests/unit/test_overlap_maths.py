"""The overlapped outer step (DilocoTrainer.outer_step_overlapped): with no overlap progress it is the
blocking step (θ_g bitwise, θ to rounding); with progress δ, θ lands where the blocking step puts θ_r,
plus δ; it moves θ by the node's own Δ, never by what it sent (a poisoned copy under the test faults)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from swarmnode.core.data import Batch
from swarmnode.core.diloco import AveragedDelta, DilocoConfig, DilocoTrainer
from swarmnode.core.model import build_model
from swarmnode.core.presets import ModelConfig
from swarmnode.core.training import TrainingRun
from swarmnode.util import faults

CFG = ModelConfig(n_layer=1, n_embd=32, n_head=2, context=16, vocab_size=64)
ALPHA = DilocoConfig().outer_mix


def batch(seed: int) -> Batch:
    x = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(seed))
    return Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous(), 0, seed)


def local(trainer: DilocoTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.params]).clone()


def trained() -> DilocoTrainer:
    trainer = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), DilocoConfig(), torch.device("cpu"))
    for seed in range(3):
        trainer.inner_step(batch(seed))
    return trainer


def averaged_for(trainer: DilocoTrainer) -> AveragedDelta:
    """A partial average: a third covered with our Δ in, a third covered without it, a third not."""
    n = trainer.global_flat.numel()
    other = torch.randn(n, generator=torch.Generator().manual_seed(9)) * 1e-3
    mean = (trainer.pseudo_gradient() + other) / 2
    mean[2 * n // 3 :] = 0
    return AveragedDelta(mean, ((0, 2 * n // 3),), 2, carried=((n // 3, 2 * n // 3),))


def test_without_overlap_progress_it_is_the_blocking_step() -> None:
    blocking = trained()
    overlapped = copy.deepcopy(blocking)
    averaged = averaged_for(blocking)
    theta_r = local(blocking)
    blocking.pseudo_gradient()
    blocking.outer_step(averaged)
    overlapped.pseudo_gradient()
    overlapped.outer_step_overlapped(averaged)
    assert torch.equal(overlapped.global_flat, blocking.global_flat)
    assert torch.equal(overlapped.outer_momentum, blocking.outer_momentum)
    torch.testing.assert_close(local(overlapped), local(blocking), rtol=0, atol=1e-6)
    assert not torch.allclose(local(blocking), blocking.global_flat, rtol=0, atol=1e-6)  # α > 0: merged
    n = theta_r.numel()
    merged = ALPHA * theta_r + (1 - ALPHA) * blocking.global_flat
    torch.testing.assert_close(local(blocking)[: n // 3], merged[: n // 3], rtol=0, atol=1e-6)


def test_the_overlaps_progress_lands_whole_on_top_of_the_blocking_steps_merge() -> None:
    trainer = trained()
    n = trainer.global_flat.numel()
    averaged = averaged_for(trainer)
    delta = trainer.pseudo_gradient().clone()
    before, theta_r = trainer.global_flat.clone(), local(trainer)
    for seed in (10, 11):  # inner steps of the next round while the all-reduce runs
        trainer.inner_step(batch(seed))
    progress = local(trainer) - theta_r
    trainer.outer_step_overlapped(averaged)
    new_global, theta = trainer.global_flat, local(trainer)
    third, two = n // 3, 2 * n // 3
    merged = ALPHA * theta_r + (1 - ALPHA) * new_global  # where the blocking step puts θ_r
    torch.testing.assert_close(theta[:third], merged[:third] + progress[:third], rtol=0, atol=1e-6)
    carried = slice(third, two)  # our Δ is not in this average: it stays local work
    torch.testing.assert_close(
        theta[carried], new_global[carried] - delta[carried] + progress[carried], rtol=0, atol=1e-6
    )
    rest = slice(two, n)  # not covered: nothing moves but our own training
    assert torch.equal(new_global[rest], before[rest])
    torch.testing.assert_close(theta[rest], theta_r[rest] + progress[rest], rtol=0, atol=1e-6)


def overlapped_round(run: TrainingRun, fault: str | None, average: torch.Tensor | None) -> torch.Tensor:
    """One overlapped round of `run` whose Δ is taken under `fault`: two inner steps while it is in
    flight, then its step with `average` (None: its own Δ as sent); returns what it sent."""
    faults.configure(fault)
    try:
        start = run.prepare_round()
    finally:
        faults.configure(None)
    sent = start.delta.clone()
    n = sent.numel()
    run.inner_phase(run.progress.round_step + 2, None, threading.Event(), lambda: None)
    averaged = AveragedDelta(sent if average is None else average, ((0, n),), 2)
    run.apply_outer(averaged, {}, None, overlapped=start)
    return sent


@pytest.mark.parametrize("fault", ["scale@delta", "nan@delta"])
def test_the_overlapped_step_moves_theta_by_the_nodes_own_delta_not_what_it_sent(fault: str) -> None:
    from swarmnode.bench.runner import trained_run

    honest, poisoner = trained_run("tiny", 3, 32, 2), trained_run("tiny", 3, 32, 2)
    own = overlapped_round(honest, None, None)
    sent = overlapped_round(poisoner, fault, own)
    assert not torch.equal(sent, own)  # the fault did poison what went on the wire
    assert torch.equal(poisoner.trainer.global_flat, honest.trainer.global_flat)
    theta = local(poisoner.trainer)
    assert theta.isfinite().all()
    assert torch.equal(theta, local(honest.trainer))


def trained_topk() -> DilocoTrainer:
    cfg = DilocoConfig(topk=41, outer_lr=2.0, outer_momentum=0.0, outer_mix=0.0)
    trainer = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), cfg, torch.device("cpu"))
    trainer.error_feedback.normal_(0, 1e-3, generator=torch.Generator().manual_seed(5))  # rounds before
    for seed in range(3):
        trainer.inner_step(batch(seed))
    return trainer


def test_topk_without_overlap_progress_it_is_the_blocking_step() -> None:
    blocking = trained_topk()
    overlapped = copy.deepcopy(blocking)
    averaged = averaged_for(blocking)
    blocking.outer_step(averaged)
    overlapped.pseudo_gradient()
    overlapped.outer_step_overlapped(averaged)
    assert torch.equal(overlapped.global_flat, blocking.global_flat)
    assert torch.equal(overlapped.error_feedback, blocking.error_feedback)
    torch.testing.assert_close(local(overlapped), blocking.global_flat, rtol=0, atol=1e-6)
    assert torch.equal(local(blocking), blocking.global_flat)  # θ restarts from θ_g': its progress is in e


def test_topk_overlap_progress_lands_on_the_new_global_model_and_e_takes_the_round_whole() -> None:
    trainer = trained_topk()
    blocking = copy.deepcopy(trainer)
    averaged = averaged_for(blocking)  # (takes blocking's ĉ and β·e + Δ, as the node does at round end)
    blocking.outer_step(averaged)
    trainer.pseudo_gradient()
    theta_r = local(trainer)
    for seed in (10, 11):  # inner steps of the next round while the all-reduce runs
        trainer.inner_step(batch(seed))
    progress = local(trainer) - theta_r
    assert progress.abs().max() > 0
    trainer.outer_step_overlapped(averaged)
    assert torch.equal(trainer.global_flat, blocking.global_flat)
    assert torch.equal(trainer.error_feedback, blocking.error_feedback)  # the round's Δ whole, not δ
    torch.testing.assert_close(local(trainer), trainer.global_flat + progress, rtol=0, atol=1e-6)
