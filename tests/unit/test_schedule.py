"""The inner learning-rate schedule: its shape, the trainer following it, and its position surviving
a snapshot round trip and a peer's restore (which restarts the round, so the schedule restarts it too)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from swarmnode.core.data import Batch
from swarmnode.core.diloco import DilocoConfig, DilocoTrainer
from swarmnode.core.model import build_model
from swarmnode.core.presets import ModelConfig
from swarmnode.core.schedule import DEFAULT_FINAL_FRACTION, InnerSchedule, LrSchedule
from swarmnode.node.config import NodeConfig
from swarmnode.util.errors import ConfigError

CFG = ModelConfig(n_layer=1, n_embd=32, n_head=2, context=16, vocab_size=64)
COSINE = InnerSchedule(LrSchedule.COSINE, warmup_steps=4, total_steps=20)


def batches(n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (n, 3, 17), generator=g)
    return [Batch(x[i, :, :-1].contiguous(), x[i, :, 1:].contiguous(), 0, i) for i in range(n)]


def trainer(schedule: InnerSchedule) -> DilocoTrainer:
    model = build_model(CFG, 0, torch.device("cpu"))
    return DilocoTrainer(model, DilocoConfig(inner_lr=1e-2, schedule=schedule), torch.device("cpu"))


@pytest.mark.parametrize("floor", [DEFAULT_FINAL_FRACTION, 0.1])
def test_warm_up_is_linear_then_cosine_decays_to_its_floor(floor: float) -> None:
    schedule = InnerSchedule(LrSchedule.COSINE, warmup_steps=4, total_steps=20, final_fraction=floor)
    factors = [schedule.factor(t) for t in range(24)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and all(a > b for a, b in zip(factors[4:20], factors[5:20], strict=False))
    assert factors[12] == pytest.approx(floor + (1 - floor) / 2)
    assert factors[20:] == [floor] * 4
    constant = InnerSchedule(LrSchedule.CONSTANT, warmup_steps=2)
    assert [constant.factor(t) for t in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_trainer_steps_at_the_schedules_learning_rate() -> None:
    t = trainer(COSINE)
    for step, batch in enumerate(batches(6)):
        t.inner_step(batch)
        for group in t.inner_opt.param_groups:
            assert math.isclose(group["lr"], 1e-2 * COSINE.factor(step))
    assert t.schedule_step == 6 and t.state_metadata()["schedule_step"] == 6


def test_schedule_position_survives_a_state_round_trip_bitwise() -> None:
    data = batches(10)
    straight = trainer(COSINE)
    for b in data:
        straight.inner_step(b)
    first = trainer(COSINE)
    for b in data[:5]:
        first.inner_step(b)
    saved = {k: v.clone() for k, v in first.state_tensors().items()}
    resumed = trainer(COSINE)
    resumed.load_state(saved, copy.deepcopy(first.state_metadata()))
    assert resumed.schedule_step == 5
    for b in data[5:]:
        resumed.inner_step(b)
    for name, tensor in straight.state_tensors().items():
        if not name.startswith("rng/"):
            assert torch.equal(tensor, resumed.state_tensors()[name]), name


def test_the_floor_is_bounded_and_tells_schedules_apart() -> None:
    with pytest.raises(ValueError, match="final learning-rate fraction"):
        InnerSchedule(LrSchedule.COSINE, 0, 10, final_fraction=1.5)
    # Nodes whose cosines end apart never average together: the floor is part of the run's digest.
    assert InnerSchedule(LrSchedule.COSINE, 4, 20, final_fraction=0.1).describe() != COSINE.describe()
    assert "final_fraction" not in InnerSchedule().describe()  # a constant schedule has no end


def test_cosine_needs_an_end_and_a_warm_up_shorter_than_it() -> None:
    with pytest.raises(ConfigError, match="--lr-schedule"):
        NodeConfig(lr_schedule="cosine")
    with pytest.raises(ConfigError, match="--total-steps"):
        NodeConfig(lr_schedule="cosine", total_steps=10, inner_warmup_steps=10)
    derived = NodeConfig(lr_schedule="cosine", max_outer_steps=3, inner_steps=50).inner_schedule
    assert derived == InnerSchedule(LrSchedule.COSINE, 0, 150)
    assert NodeConfig(max_outer_steps=3).inner_schedule.total_steps is None  # constant: no end


def test_a_peer_restore_restarts_the_schedule_at_the_peers_round_start() -> None:
    import threading
    from types import SimpleNamespace

    from swarmnode.bench.runner import trained_run
    from swarmnode.snapshot.metadata import SnapshotMetadata

    peer = trained_run("tiny", 7, 32, 2)  # 7 inner steps into its first round
    meta = SnapshotMetadata.parse({**peer.state_metadata(), "kind": "hot", "layout": "planes"})
    assert (meta.schedule_step, meta.round_step) == (7, 7)
    tensors = {name: t.clone() for name, t in peer.state_tensors().items()}
    node = trained_run("tiny", 3, 32, 2)
    node.restore_from_peer(SimpleNamespace(tensors=tensors), meta, None, (3, 0))  # type: ignore[arg-type]
    assert node.trainer.schedule_step == 0  # the round restarts from θ_g, and so does its schedule
    node.inner_phase(2, None, threading.Event(), lambda: None)
    assert node.trainer.schedule_step == 2
