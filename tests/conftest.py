"""Shared fixtures: every child process a test starts is reaped when the test ends. The fast tier
(`pytest -m unit`): every test in tests/unit but the modules that run whole benches in processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmtest import ProcessReaper

UNIT_DIR = Path(__file__).parent / "unit"
NOT_FAST = frozenset({"test_bench_smoke.py", "test_bench_train_anchor.py"})
"""Unit modules left out of the fast tier: each starts bench processes (nodes, workers) and trains, about
two and a half minutes together on 2 cores; the default suite still runs them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path)
        if path.parent == UNIT_DIR and path.name not in NOT_FAST and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)


@pytest.fixture
def reaper():
    procs = ProcessReaper()
    try:
        yield procs
    finally:
        procs.kill_all()
