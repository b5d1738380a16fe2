"""Shared fixtures: every child process a test starts is reaped when the test ends."""

from __future__ import annotations

import pytest

from swarmtest import ProcessReaper


@pytest.fixture
def reaper():
    procs = ProcessReaper()
    try:
        yield procs
    finally:
        procs.kill_all()
