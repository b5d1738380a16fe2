"""DiLoCo math: rounds equal a hand-written reference; partial coverage moves only what was averaged."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from swarmnode.core.data import Batch
from swarmnode.core.diloco import AveragedDelta, DilocoConfig, DilocoTrainer
from swarmnode.core.model import build_model
from swarmnode.core.presets import ModelConfig

CFG = ModelConfig(n_layer=1, n_embd=32, n_head=2, context=16, vocab_size=64)
DILOCO = DilocoConfig(inner_lr=3e-3, outer_lr=0.7, outer_momentum=0.9, outer_mix=0.0)  # Algorithm 1


def batches(n: int, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randint(0, 64, (3, 17), generator=g)
        out.append(Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous(), 0, i))
    return out


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def reference_rounds(rounds: list[list[Batch]]) -> torch.Tensor:
    """Algorithm 1 of the DiLoCo paper written out by hand for one worker."""
    model = build_model(CFG, 0, torch.device("cpu"))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    inner = torch.optim.AdamW(
        [{"params": decay, "weight_decay": DILOCO.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=DILOCO.inner_lr,
        betas=DILOCO.betas,
        foreach=False,
    )
    theta_global = flat(model)
    momentum = torch.zeros_like(theta_global)
    for round_batches in rounds:
        for b in round_batches:
            loss = model.loss(b.inputs, b.targets)
            inner.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), DILOCO.grad_clip, foreach=False)
            inner.step()
        delta = theta_global - flat(model)
        # m ← μ·m + Δ;  θ_g ← θ_g − lr·(Δ + μ·m)   (Nesterov), in the same float op order as the trainer
        momentum = momentum.mul(DILOCO.outer_momentum).add(delta)
        theta_global = theta_global.add(
            delta.add(momentum, alpha=DILOCO.outer_momentum), alpha=-DILOCO.outer_lr
        )
        offset = 0
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(theta_global[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    return theta_global


def test_two_rounds_equal_the_hand_written_reference() -> None:
    rounds = [batches(4, 1), batches(4, 2)]
    trainer = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), DILOCO, torch.device("cpu"))
    for round_batches in rounds:
        for b in round_batches:
            trainer.inner_step(b)
        delta = trainer.pseudo_gradient()
        averaged = AveragedDelta(delta, ((0, delta.numel()),), 1)  # a group of one
        trainer.outer_step(averaged)
    expected = reference_rounds(rounds)
    torch.testing.assert_close(trainer.global_flat, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(flat(trainer.model), trainer.global_flat, rtol=0, atol=0)


def test_outer_step_matches_torch_sgd_nesterov_bitwise() -> None:
    trainer = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), DILOCO, torch.device("cpu"))
    param = torch.nn.Parameter(trainer.global_flat.clone())
    sgd = torch.optim.SGD([param], lr=DILOCO.outer_lr, momentum=DILOCO.outer_momentum, nesterov=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        delta = torch.randn(param.numel(), generator=g) * 1e-3
        param.grad = delta.clone()
        sgd.step()
        trainer.outer_step(AveragedDelta(delta, ((0, delta.numel()),)))
    assert torch.equal(trainer.global_flat, param.detach())


def test_uncovered_parts_keep_local_progress_and_global_params() -> None:
    trainer = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), DILOCO, torch.device("cpu"))
    before_global = trainer.global_flat.clone()
    for b in batches(3, 5):
        trainer.inner_step(b)
    local_before = flat(trainer.model)
    delta = trainer.pseudo_gradient().clone()
    n = delta.numel()
    covered = ((0, n // 3), (2 * n // 3, n))
    trainer.outer_step(AveragedDelta(delta, covered, group_size=2))
    middle = slice(n // 3, 2 * n // 3)
    assert torch.equal(trainer.global_flat[middle], before_global[middle])
    assert torch.equal(trainer.outer_momentum[middle], torch.zeros(middle.stop - middle.start))
    assert torch.equal(flat(trainer.model)[middle], local_before[middle])
    assert not torch.equal(trainer.global_flat[: n // 3], before_global[: n // 3])
    assert torch.equal(flat(trainer.model)[: n // 3], trainer.global_flat[: n // 3])
    # the next pseudo-gradient still carries the uncovered local work
    assert torch.equal(trainer.pseudo_gradient()[middle], delta[middle])


def test_a_part_averaged_without_this_node_carries_its_delta_to_the_next_round() -> None:
    """Error feedback: where the swarm's average left this node's Δ out, θ_g moves with the others
    and θ ← θ_g − Δ, so the next Δ there is exactly the work the average did not receive."""
    trainer = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), DILOCO, torch.device("cpu"))
    for b in batches(3, 7):
        trainer.inner_step(b)
    delta = trainer.pseudo_gradient().clone()
    n = delta.numel()
    others = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    left_out = (n // 2, n)
    trainer.outer_step(AveragedDelta(others, ((0, n),), group_size=3, carried=(left_out,)))
    kept, carried = slice(0, n // 2), slice(*left_out)
    local = flat(trainer.model)
    assert torch.equal(local[kept], trainer.global_flat[kept])
    assert torch.allclose(trainer.pseudo_gradient()[carried], delta[carried], rtol=0, atol=1e-6)
    assert torch.equal(trainer.pseudo_gradient()[kept], torch.zeros(n // 2))


def test_the_merge_keeps_a_share_of_the_local_params_and_moves_global_params_as_diloco() -> None:
    """outer_mix α: θ ← α·θ + (1 − α)·θ_g' where the step covered θ with our Δ in it; θ_g and its
    momentum take exactly DiLoCo's step; carried and uncovered ranges follow the same rules as α = 0."""
    mixed = replace(DILOCO, outer_mix=0.5)
    trainers = [
        DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), c, torch.device("cpu"))
        for c in (DILOCO, mixed)
    ]
    n = trainers[0].global_flat.numel()
    covered, left_out = ((0, 2 * n // 3),), (n // 3, 2 * n // 3)
    for trainer in trainers:
        for b in batches(3, 7):
            trainer.inner_step(b)
    theta_r, delta = flat(trainers[1].model), trainers[1].pseudo_gradient().clone()
    trainers[0].pseudo_gradient()
    others = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    for trainer in trainers:
        trainer.outer_step(AveragedDelta(others, covered, group_size=3, carried=(left_out,)))
    plain, merged = trainers
    assert torch.equal(merged.global_flat, plain.global_flat)
    assert torch.equal(merged.outer_momentum, plain.outer_momentum)
    theta, new_global = flat(merged.model), merged.global_flat
    kept, carried, rest = slice(0, n // 3), slice(*left_out), slice(2 * n // 3, n)
    torch.testing.assert_close(theta[kept], 0.5 * theta_r[kept] + 0.5 * new_global[kept], rtol=0, atol=1e-7)
    assert not torch.equal(theta[kept], new_global[kept])
    assert torch.equal(theta[carried], new_global[carried] - delta[carried])
    assert torch.equal(theta[rest], theta_r[rest])
    assert torch.equal(flat(plain.model)[kept], plain.global_flat[kept])  # α = 0: DiLoCo's θ ← θ_g'


def test_outer_mix_is_a_share_below_one() -> None:
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="outer mix"):
            DilocoConfig(outer_mix=bad)


def test_state_round_trip_restores_training_bitwise() -> None:
    def trainer_after(steps: list[Batch]) -> DilocoTrainer:
        t = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), DILOCO, torch.device("cpu"))
        for b in steps:
            t.inner_step(b)
        return t

    data = batches(6, 7)
    straight = trainer_after(data)
    first = trainer_after(data[:3])
    saved = {k: v.clone() for k, v in first.state_tensors().items()}
    meta = copy.deepcopy(first.state_metadata())
    resumed = DilocoTrainer(build_model(CFG, 99, torch.device("cpu")), DILOCO, torch.device("cpu"))
    resumed.load_state(saved, meta)
    for b in data[3:]:
        resumed.inner_step(b)
    for name, tensor in straight.state_tensors().items():
        if not name.startswith("rng/"):
            assert torch.equal(tensor, resumed.state_tensors()[name]), name
