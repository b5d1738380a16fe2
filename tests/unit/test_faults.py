"""Test-only fault points (swarmnode.util.faults): declared once, misspellings refused, and a sleep at a point
on the event loop pauses only its own task."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmnode.cli import main as cli
from swarmnode.util import faults

PACKAGE = Path(faults.__file__).parents[1]


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    yield
    faults.configure(None)


def test_a_misspelled_point_is_refused() -> None:
    with pytest.raises(ValueError, match=r"SWARMNODE_FAULTS: unknown point in 'kill@inner_stpe#3'"):
        faults.parse("sleep@inner_step=0.1,kill@inner_stpe#3")
    assert faults.parse("kill@inner_step#3")[0].point == "inner_step"


def test_a_misspelled_point_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SWARMNODE_FAULTS", "kill@allreduce_sned#2")
    assert cli.main(["run", "--dry-run", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SWARMNODE_FAULTS" in err[0] and "allreduce_sned" in err[0], err


def test_every_point_the_code_names_is_declared() -> None:
    """The points are the literals of `hit(`, `ahit(`, `armed(`, `find(` and `due(` calls across the package
    (the kind-prefixed snapshot points and the clock are spelled out)."""
    named: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"faults\.a?hit\(\s*\"([a-z_]+)\"", text))
        named |= set(re.findall(r"faults\.armed\(\s*\"([a-z_]+)\"", text))
        named |= set(re.findall(r"faults\.find\(\s*\"[a-z]+\",\s*\"([a-z_]+)\"", text))
        named |= set(re.findall(r"faults\.due\(\s*\"[a-z]+\",\s*\"([a-z_]+)\"", text))
    named |= {"hot_snapshot_halfway", "cold_snapshot_halfway"}  # hit(f"{job.kind}_snapshot_halfway")
    named.add("clock")  # skew@clock: looked up by faults.configure itself
    assert "inner_step" in named and "allreduce_send" in named  # the scan sees the calls
    assert named == set(faults.POINTS)


def test_a_sleep_at_a_loop_point_leaves_the_loop_serving() -> None:
    """While one task sleeps at `allreduce_send`, another keeps ticking: `ahit` waits with asyncio."""
    faults.configure("sleep@allreduce_send=0.5")

    async def scenario() -> tuple[float, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker is running
        started = time.monotonic()
        assert await faults.ahit("allreduce_send") is None
        slept = time.monotonic() - started
        ticking.cancel()
        return slept, ticks

    slept, ticks = asyncio.run(scenario())
    assert slept >= 0.5
    assert ticks >= 10  # a blocking sleep of 0.5 s would have let it tick at most once


def test_loop_points_keep_their_kill_and_data_faults() -> None:
    faults.configure("corrupt@global_params#2")

    async def hits() -> list[faults.Fault | None]:
        return [await faults.ahit("global_params", step) for step in (1, 2, 3)]

    first, second, third = asyncio.run(hits())
    assert first is None and third is None and second is not None and second.action == "corrupt"


def test_a_point_is_hit_on_its_own_side() -> None:
    """A loop point hit with the blocking `hit` (or a thread point awaited) is a bug of the caller."""
    with pytest.raises(AssertionError):
        faults.hit("allreduce_send")
    with pytest.raises(AssertionError):
        asyncio.run(faults.ahit("inner_step"))
