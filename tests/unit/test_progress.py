"""Progress for people: a bar on a terminal, plain lines otherwise, JSON with --log-format json."""

from __future__ import annotations

import dataclasses
import io
import json

from swarmnode.node.progress import ProgressReporter, ProgressSample

SAMPLE = ProgressSample(
    round=3,
    step=120,
    steps_per_round=500,
    loss=2.3456,
    heldout_loss=2.5,
    tokens_per_s=5400.0,
    peers=3,
    snapshot_age_s=12.0,
    phase="inner",
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_when_no_terminal_is_attached() -> None:
    stream = io.StringIO()
    reporter = ProgressReporter.for_stream(stream, "text")
    reporter.report(SAMPLE)
    line = stream.getvalue()
    assert reporter.mode == "lines" and line.endswith("\n") and "\r" not in line
    for part in ("round 3", "step 120/500", "loss 2.3456", "tok/s 5400", "peers 3", "snapshot 12s ago"):
        assert part in line


def test_a_redrawn_bar_on_a_terminal() -> None:
    stream = Terminal()
    reporter = ProgressReporter.for_stream(stream, "text")
    reporter.report(SAMPLE)
    reporter.report(SAMPLE)
    reporter.finish()
    out = stream.getvalue()
    assert reporter.mode == "bar" and reporter.interval_s == 1.0
    assert out.count("\r") == 2 and out.endswith("\n") and "[####" in out


def test_json_lines_for_machines() -> None:
    stream = Terminal()
    ProgressReporter.for_stream(stream, "json").report(SAMPLE)
    event = json.loads(stream.getvalue())
    assert event["event"] == "progress" and event["round"] == 3 and event["peers"] == 3


def test_holding_and_waiting_for_the_swarm_have_phases_of_their_own() -> None:
    """Between a round that found no group (or that the swarm closed without this node) and its next
    inner phase the line says so, instead of repeating the last inner figures as `[inner]`."""
    from swarmnode.node.progress import Phase
    from swarmnode.node.round_loop import phase_before_round
    from swarmnode.swarm.averaging.matchmaking import Offer
    from swarmnode.swarm.averaging.rounds import RoundResult

    held = RoundResult(None, ("n1",), coverage=0.0, held=True)
    offer = Offer("0a", "h:1", 1.0, "0" * 64, "0" * 64, 1.0, None, 3)
    assert phase_before_round(held) == Phase.HOLDING
    assert phase_before_round(dataclasses.replace(held, missed=True)) == Phase.WAITING_FOR_SWARM
    assert phase_before_round(RoundResult(None, repair_from=(offer,))) == Phase.WAITING_FOR_SWARM
    assert phase_before_round(RoundResult(None, ("n1", "n2"))) == Phase.INNER
    assert phase_before_round(None) == Phase.INNER
    stream = io.StringIO()
    ProgressReporter.for_stream(stream, "text").report(
        dataclasses.replace(SAMPLE, step=500, phase=Phase.HOLDING)
    )
    assert (
        stream.getvalue()
        .rstrip()
        .endswith("step 500/500 loss 2.3456 heldout 2.5000 tok/s 5400 peers 3 snapshot 12s ago [holding]")
    )
    stream = io.StringIO()
    ProgressReporter.for_stream(stream, "json").report(
        dataclasses.replace(SAMPLE, phase=Phase.WAITING_FOR_SWARM)
    )
    assert json.loads(stream.getvalue())["phase"] == "waiting for the swarm"
