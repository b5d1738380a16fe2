"""SparseLoCo's outer step in `DilocoTrainer` (top-k wire): the error feedback, what the outer step does
with it on covered, carried and uncovered ranges, and where snapshots keep it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_diloco import batches, flat

from swarmnode.core import sparse
from swarmnode.core.diloco import EF_PREFIX, AveragedDelta, DilocoConfig, DilocoTrainer
from swarmnode.core.model import build_model
from swarmnode.core.presets import ModelConfig

CFG = ModelConfig(n_layer=1, n_embd=32, n_head=2, context=16, vocab_size=64)
TOPK = DilocoConfig(inner_lr=3e-3, outer_lr=1.0, outer_momentum=0.0, outer_mix=0.0, topk=41, ef_decay=0.9)


def trained(cfg: DilocoConfig = TOPK, seed: int = 5) -> DilocoTrainer:
    trainer = DilocoTrainer(build_model(CFG, 0, torch.device("cpu")), cfg, torch.device("cpu"))
    for b in batches(3, seed):
        trainer.inner_step(b)
    return trainer


def test_the_sent_delta_is_the_compressed_feedback_and_the_rest_waits_in_it() -> None:
    trainer = trained()
    dense = trainer.global_flat - flat(trainer.model)
    sent = trainer.pseudo_gradient().clone()
    assert torch.equal(sent, sparse.compress(dense, 41))  # e was 0: β·0 + Δ
    n = sent.numel()
    before = trainer.global_flat.clone()
    trainer.outer_step(AveragedDelta(sent, ((0, n),), 1))
    assert torch.equal(trainer.global_flat, before - sent)  # α = 1, no momentum
    assert torch.equal(trainer.error_feedback, dense - sent)
    assert torch.equal(flat(trainer.model), trainer.global_flat)  # θ ← θ_g': the progress is in e
    for b in batches(2, 9):
        trainer.inner_step(b)
    dense2 = trainer.global_flat - flat(trainer.model)
    expected = sparse.compress(torch.add(dense2, dense - sent, alpha=0.9), 41)  # β·e + Δ
    assert torch.equal(trainer.pseudo_gradient(), expected)


def test_a_round_prepared_twice_counts_its_delta_once() -> None:
    trainer = trained()
    first = trainer.pseudo_gradient().clone()
    assert torch.equal(trainer.pseudo_gradient(), first)  # held round: e has not moved


def test_left_out_or_uncovered_ranges_keep_all_of_the_rounds_delta_in_the_feedback() -> None:
    trainer = trained()
    dense = trainer.global_flat - flat(trainer.model)
    sent = trainer.pseudo_gradient().clone()
    n = sent.numel()
    before = trainer.global_flat.clone()
    others = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    covered = ((0, n // 2),)
    carried = ((0, n // 4),)
    trainer.outer_step(AveragedDelta(others, covered, 3, carried))
    q = n // 4
    assert torch.equal(trainer.error_feedback[:q], dense[:q])  # our ĉ is not in that average
    assert torch.equal(trainer.error_feedback[q : n // 2], (dense - sent)[q : n // 2])
    assert torch.equal(trainer.error_feedback[n // 2 :], dense[n // 2 :])  # not averaged at all
    assert torch.equal(trainer.global_flat[n // 2 :], before[n // 2 :])
    assert torch.equal(flat(trainer.model), trainer.global_flat)


def test_the_feedback_is_in_every_snapshot_and_restored_only_from_the_nodes_own() -> None:
    trainer = trained()
    sent = trainer.pseudo_gradient().clone()
    trainer.outer_step(AveragedDelta(sent, ((0, sent.numel()),), 1))
    state = {k: v.clone() for k, v in trainer.state_tensors().items()}
    names = [k for k in state if k.startswith(EF_PREFIX)]
    assert len(names) == len(trainer.slots)
    assert torch.equal(torch.cat([state[k].reshape(-1) for k in names]), trainer.error_feedback)
    meta = trainer.state_metadata()
    own = DilocoTrainer(build_model(CFG, 1, torch.device("cpu")), TOPK, torch.device("cpu"))
    own.load_state(state, meta)
    assert torch.equal(own.error_feedback, trainer.error_feedback)
    peer = DilocoTrainer(build_model(CFG, 1, torch.device("cpu")), TOPK, torch.device("cpu"))
    peer.error_feedback.fill_(0.5)  # this node's own residual
    peer.load_state(state, meta, restore_rng=False)
    assert torch.equal(peer.error_feedback, torch.full_like(peer.error_feedback, 0.5))
    assert torch.equal(peer.global_flat, trainer.global_flat)


def test_dense_runs_have_no_feedback_and_topk_refuses_fragments() -> None:
    dense = trained(replace(TOPK, topk=0))
    assert not any(k.startswith(EF_PREFIX) for k in dense.state_tensors())
    with pytest.raises(ValueError, match="fragments"):
        replace(TOPK, fragments=2)
