"""One owner for the training state: with the check on, a change made off the training thread fails,
and the same change handed to the training thread succeeds."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmnode.bench.runner import trained_run
from swarmnode.core.training import TrainingRun
from swarmnode.snapshot.checkpointer import CheckpointerConfig, SpeculativeCheckpointer
from swarmnode.util.metrics import Metrics
from swarmnode.util.threads import OwnershipError, TrainingThread, check_ownership


@pytest.fixture
def checked() -> Iterator[None]:
    check_ownership(True)
    try:
        yield
    finally:
        check_ownership(False)


@pytest.fixture(scope="module")
def run() -> TrainingRun:
    return trained_run("tiny", 0, 64, 2)


def one_step(run: TrainingRun) -> None:
    run.inner_phase(run.progress.round_step + 1, None, threading.Event(), lambda: None)


def test_a_step_off_the_training_thread_is_refused_and_on_it_taken(run: TrainingRun, checked: None) -> None:
    before = run.sample.inner_step
    with pytest.raises(OwnershipError, match="not the training thread"):
        one_step(run)
    assert run.sample.inner_step == before
    training = TrainingThread()
    try:
        asyncio.run(training.run(one_step, run))
        start = asyncio.run(training.run(run.prepare_round))
    finally:
        training.close()
    assert run.sample.inner_step == before + 1
    with pytest.raises(OwnershipError):
        run.prepare_round()
    assert start.outer_step == run.sample.outer_step and start.global_digest == run.sample.global_digest


def test_staging_a_snapshot_off_the_training_thread_is_refused(
    run: TrainingRun, checked: None, tmp_path: Path
) -> None:
    checkpointer = SpeculativeCheckpointer(CheckpointerConfig(tmp_path), Metrics())
    training = TrainingThread()
    try:
        with pytest.raises(OwnershipError):
            checkpointer.snapshot(run.state_tensors(), run.state_metadata(), "hot")

        def stage() -> bool:
            return checkpointer.snapshot(run.state_tensors(), run.state_metadata(), "hot")

        assert asyncio.run(training.run(stage))
        assert checkpointer.wait_idle(30)
    finally:
        training.close()
        checkpointer.close()


def test_the_published_sample_is_a_new_value_after_every_step(run: TrainingRun) -> None:
    first = run.sample
    one_step(run)  # (the check is off here: tests and benches may drive a run on their own thread)
    assert run.sample is not first and run.sample.inner_step == first.inner_step + 1
    with pytest.raises(AttributeError):
        run.sample.inner_step = 0  # type: ignore[misc]
