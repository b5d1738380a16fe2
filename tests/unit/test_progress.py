"""Progress for people: a bar on a terminal, plain lines otherwise, JSON with --log-format json."""

from __future__ import annotations

import io
import json

from swarmnode.progress import ProgressReporter, ProgressSample

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
