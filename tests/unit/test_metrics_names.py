"""Every metric a node exposes follows Prometheus' naming rules and ours (docs/operations.md "Metrics"): the
`swarmnode_` prefix, `_total` counters, base units as the last word, and labels from small fixed sets."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from swarmnode.util import metrics as metrics_module
from swarmnode.util.metrics import Metrics

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Labels a node may use: each takes values from a fixed tuple in swarmnode/metrics.py, never an id.
ALLOWED_LABELS = {"kind", "reason", "source"}
SAMPLE_LABELS = {"le", "quantile"}  # added by histograms and summaries themselves
BASE_UNITS = ("seconds", "bytes", "ratio")
NON_BASE_UNIT = re.compile(
    r"_(ms|us|ns|millis|(milli|micro|nano)seconds|minutes|hours|days"
    r"|[kmg]i?b|(kilo|mega|giga)bytes|bits|percent|pct)(_|$)"
)
# Words in a metric's HELP that say what unit its name must end with.
HELP_UNITS = {
    r"\b(bytes|size)\b": "bytes",
    r"\b(time|duration|age|seconds|latency)\b": "seconds",
    r"\b(fraction|ratio|share)\b": "ratio",
}


@pytest.fixture(scope="module")
def exposition() -> str:
    metrics = Metrics(CollectorRegistry())
    metrics.track_snapshot_age(lambda: None, time.time)  # as the daemon wires it
    return generate_latest(metrics.registry).decode()


@pytest.fixture(scope="module")
def families(exposition: str) -> dict[str, tuple[str, str, list[Sample]]]:
    return parse_families(exposition)


def parse_families(text: str) -> dict[str, tuple[str, str, list[Sample]]]:
    """Family name -> (type, help, samples), without the `_created` gauges prometheus-client adds next to
    every counter and histogram (they are its bookkeeping, not ours)."""
    parsed = {f.name: (f.type, f.documentation, f.samples) for f in text_string_to_metric_families(text)}
    typed = {name for name, (kind, _, _) in parsed.items() if kind in ("counter", "histogram", "summary")}
    bookkeeping = {name + "_created" for name in typed}
    return {name: family for name, family in parsed.items() if name not in bookkeeping}


def base_name(family: str, kind: str) -> str:
    """The name without what the type adds (`_total` of a counter is checked on its own)."""
    return family.removesuffix("_total") if kind == "counter" else family


def test_metric_and_label_names_follow_prometheus_syntax(exposition: str, families) -> None:
    names = re.findall(r"^# (?:HELP|TYPE) (\S+)", exposition, re.M)
    assert names, "empty exposition"
    for name in names:
        assert METRIC_NAME.fullmatch(name), name
    for _, _, samples in families.values():
        for sample in samples:
            assert METRIC_NAME.fullmatch(sample.name), sample.name
            for label in sample.labels:
                assert LABEL_NAME.fullmatch(label), f"{sample.name}: label {label!r}"
                assert not label.startswith("__"), f"{sample.name}: label {label!r} is reserved"


def test_every_metric_starts_with_swarmnode_and_has_help(families) -> None:
    for name, (_, help_text, _) in families.items():
        assert name.startswith("swarmnode_"), name
        assert help_text.strip(), f"{name} has no HELP"


def test_counters_end_in_total_and_nothing_else_does(families) -> None:
    for name, (kind, _, samples) in families.items():
        values = [s.name for s in samples if not s.name.endswith("_created")]
        if kind == "counter":
            assert values and all(v == name + "_total" for v in values), (name, values)
            assert not name.endswith("_total"), f"{name}: _total doubled by the client library"
        else:
            assert not name.endswith("_total"), f"{name} is a {kind}, only counters end in _total"
            assert not re.search(r"_(count|sum|bucket)$", name) or kind == "histogram", name


def test_units_are_base_units_named_last(families) -> None:
    for name, (kind, help_text, _) in families.items():
        words = base_name(name, kind).split("_")
        assert not NON_BASE_UNIT.search(name), f"{name}: use a base unit ({', '.join(BASE_UNITS)})"
        for unit in BASE_UNITS:
            if unit in words:
                assert words[-1] == unit, f"{name}: the unit {unit} goes last"
        if kind == "histogram":
            assert words[-1] in ("seconds", "bytes"), f"{name}: a histogram measures seconds or bytes"
        for pattern, unit in HELP_UNITS.items():
            if re.search(pattern, help_text, re.I):
                assert words[-1] == unit, f"{name} ({help_text!r}) should end in _{unit}"


def test_labels_are_bounded_and_pre_initialised(families) -> None:
    bounded_values = set(metrics_module.SNAPSHOT_KINDS) | set(metrics_module.RECOVERY_SOURCES)
    for reasons in (
        metrics_module.FETCH_FAILURE_REASONS,
        metrics_module.DHT_REJECT_REASONS,
        metrics_module.SNAPSHOT_FAILURE_REASONS,
        metrics_module.ROUND_FAILURE_REASONS,
        metrics_module.PROBE_RESULTS,
        metrics_module.DIAL_BACK_RESULTS,
        metrics_module.DHT_REQUEST_KINDS,
        ("unauthenticated",),
        metrics_module.AVERAGING_REJECT_REASONS,
        metrics_module.EXCLUSION_REASONS,
    ):
        bounded_values |= set(reasons)
    for name, (_, _, samples) in families.items():
        # Dashboards rely on every family being there (at 0) before anything happened.
        assert samples, f"{name} exposes no sample until first used"
        for sample in samples:
            labels = set(sample.labels) - SAMPLE_LABELS
            assert labels <= ALLOWED_LABELS, f"{name}: unbounded label(s) {labels - ALLOWED_LABELS}"
            for label in labels:
                assert sample.labels[label] in bounded_values, f"{name}: {label}={sample.labels[label]!r}"


def test_promtool_finds_no_problems(exposition: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("`promtool` is not installed here (CI installs it: see .ci/run)")
    out = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
