"""The receipts ledger: which batch ranges of its shard each node put into the swarm's model, per round.

Each node appends to DATA_DIR/ledger.jsonl:
- `{"event": "round", ...}` before every outer step: the cursor range [start, end) its inner phase
  trained (the node may die while its pseudo-gradient is on the wire: the range is then pending);
- `{"event": "settle", ...}` after it: what became of the round: `applied` (averaged in a group),
  `solo` (applied alone), `carried` (the step was skipped for low coverage, or the average left this
  node's Δ out of a part) or `held` (no group: not applied) — in both the work stays local progress and
  the next round's range covers it again — or `dropped` (its global params had gone astray: trained
  again after a repair). A group's settle also lists the `group` and the members `included` in every
  part of its average: the recorder's testimony of whose batches the round's model holds;
- `{"event": "adopt", ...}` whenever it takes a state and cursor from elsewhere (a start, a recovery,
  a repair): the cursor it continues from.
`round` and `settle` entries also carry the node's training figures at that moment (`STATS`: time,
losses, tokens/s), which `swarmnode plot` draws.

`check` replays a node's ledger as a chain of ranges: every round must start where the chain ends, and
an adopted cursor must be a point of the chain (the rounds after it are dropped: trained again) or the
shard's start. A round left pending by a death is settled by the next adopted cursor: the swarm's
record of the node says whether its last contribution made it into the model. A chain that replays
proves that no batch of the shard was counted twice or skipped, except the batches of rounds whose
node died or went astray, which were trained again.

With `--fragments K` a round is a fragment round (`fragments.py`): its range is the batches since the
previous applied round, its work entering θ_g over the next K fragment steps; the chain is the same.

`cross_check` holds each node's chain against the others' testimony: a round a node's chain keeps (its
batches counted in the model) must not be one whose average another member recorded without it — the
batches of a member that died mid-round are in no average, so it must come back at the round's start.
Only a member that ended the round in the node's model testifies (the same global digest, or either
unknown): one that applied a part the node never received (or the reverse) holds another model, and
whichever of the two went astray is repaired onto the other's lineage and its record.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmnode.util import clock
from swarmnode.util.threads import LEDGER_THREAD, assert_on_thread

if TYPE_CHECKING:
    from swarmnode.core.training import TrainingSample

logger = logging.getLogger(__name__)

LEDGER_FILE = "ledger.jsonl"


class RoundStatus(StrEnum):
    """What became of a round (see the module notes)."""

    APPLIED = "applied"
    SOLO = "solo"
    CARRIED = "carried"
    HELD = "held"
    DROPPED = "dropped"


ROUND_STATUSES = tuple(RoundStatus)
TAKEOVER = "takeover"
"""The adopt source of a node that took a departed node's shard over at its committed cursor."""
Point = tuple[int, int, int]


def _point(cursor: dict[str, int]) -> Point:
    return int(cursor["shard"]), int(cursor["epoch"]), int(cursor["position"])


class Ledger:
    """Appends this node's ledger entries (one JSON line each, written at once)."""

    def __init__(self, data_dir: Path, node_id: str) -> None:
        self.path = data_dir / LEDGER_FILE
        self.node_id = node_id
        self._failed = False

    def round(
        self,
        outer_step: int,
        start: dict[str, int],
        end: dict[str, int],
        stats: Mapping[str, float | None] | None = None,
    ) -> None:
        """`stats`: how the round's inner phase went (`training_stats`), for `swarmnode plot`."""
        entry = {"event": "round", "outer_step": outer_step, "start": start, "end": end}
        self._append({**entry, **(stats or {})})

    def settle(
        self,
        outer_step: int,
        status: str,
        group_size: int,
        global_digest: str | None,
        *,
        group: Sequence[str] = (),
        included: Sequence[str] = (),
        weights: Mapping[str, float] | None = None,
        stats: Mapping[str, float | None] | None = None,
    ) -> None:
        """What became of round `outer_step`, and the global params' digest after it (None: unchanged);
        for a group, its members, those whose contributions are in every part of the average and the
        token weight each offered (the most its contribution weighed);
        `stats`: the training's figures after it (`training_stats`: the held-out loss of the new θ_g)."""
        assert status in ROUND_STATUSES, status
        entry = {"event": "settle", "outer_step": outer_step, "status": status, "group_size": group_size}
        if group:
            entry.update(group=list(group), included=list(included))
            if weights:
                entry["weights"] = {node_id: weights[node_id] for node_id in group if node_id in weights}
        entry.update(stats or {})
        self._append({**entry, "global_digest": global_digest})

    def adopt(self, cursor: dict[str, int], source: str, outer_step: int) -> None:
        self._append({"event": "adopt", "cursor": cursor, "source": source, "outer_step": outer_step})

    def _append(self, entry: dict[str, Any]) -> None:
        assert_on_thread(LEDGER_THREAD, "a ledger entry")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps({"node_id": self.node_id, **entry}, sort_keys=True) + "\n")
        except OSError as exc:  # a full disk must not stop training; the gap shows in `check`
            if not self._failed:
                logger.error("ledger %s not written (%s); training goes on", self.path, exc)
            self._failed = True


STATS = ("ts", "inner_step", "tokens", "loss", "heldout_loss", "tokens_per_s")
"""The figures `round` and `settle` entries carry besides their cursors (optional: older ledgers lack
them; `check` ignores them): unix seconds, the node's inner steps and tokens so far, its last inner
loss, the held-out loss of its global params and its training tokens per second."""


def training_stats(sample: TrainingSample) -> dict[str, float | None]:
    """A ledger entry's `STATS`, from the node's published training sample, at the node's clock's now
    (`util.clock`: a skewed node's ledger shows its skew, as its snapshots' `created_at` does)."""
    s = sample
    figures = (round(clock.now(), 3), s.inner_step, s.tokens, s.last_loss, s.heldout_loss, s.tokens_per_s)
    return dict(zip(STATS, figures, strict=True))


def read_ledger(data_dir: Path) -> list[dict[str, Any]]:
    path = data_dir / LEDGER_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class LedgerReport:
    """The replayed chain of one node: ranges that hold, ranges trained again, and any violation."""

    chain: list[tuple[Point, Point]] = field(default_factory=list)
    retrained: list[tuple[Point, Point]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    anchor: Point | None = None  # the last adopted cursor: where an empty chain starts
    chain_steps: list[int] = field(default_factory=list)  # the outer step of each range in `chain`

    @property
    def end(self) -> Point | None:
        return self.chain[-1][1] if self.chain else self.anchor


def digests_by_round(entries: list[dict[str, Any]]) -> dict[int, str]:
    """outer step -> the global digest this node held after that round's outer step."""
    return {
        e["outer_step"] + 1: e["global_digest"]
        for e in entries
        if e["event"] == "settle" and e.get("global_digest")
    }


def check(entries: list[dict[str, Any]]) -> LedgerReport:
    """Replay one node's ledger (see the module docstring)."""
    report = LedgerReport()
    for entry in entries:
        if entry["event"] == "adopt":
            _adopt(report, _point(entry["cursor"]), entry["source"])
        elif entry["event"] == "round":
            _round(report, entry)
        elif entry["event"] == "settle" and report.chain:
            _settle(report, entry["status"])
    return report


def _settle(report: LedgerReport, status: str) -> None:
    if status == RoundStatus.DROPPED:  # trained again after the repair
        report.retrained.append(report.chain.pop())
        report.chain_steps.pop()
    elif status in (
        RoundStatus.HELD,
        RoundStatus.CARRIED,
    ):  # still local progress: the next round's range covers it again
        report.chain.pop()
        report.chain_steps.pop()


def _adopt(report: LedgerReport, point: Point, source: str) -> None:
    ends = [end for _, end in report.chain]
    if point in ends:
        keep = ends.index(point) + 1
    elif point[1:] == (0, 0) or point == report.anchor or source == TAKEOVER:
        keep = 0  # (a takeover continues another node's chain: `shard_windows` checks the seam)
    else:
        report.errors.append(f"adopted cursor {point} ({source}) is no point of the chain {ends[-3:]}")
        keep = len(report.chain)
    report.retrained += report.chain[keep:]
    report.chain = report.chain[:keep]
    report.chain_steps = report.chain_steps[:keep]
    report.anchor = point if keep == 0 else report.anchor


def _round(report: LedgerReport, entry: dict[str, Any]) -> None:
    start, end = _point(entry["start"]), _point(entry["end"])
    expected = report.end
    if expected is not None and start != expected:
        kind = "skipped" if start > expected else "counted twice"
        report.errors.append(
            f"round {entry['outer_step']}: starts at {start}, the chain ends at {expected}: batches {kind}"
        )
    report.chain.append((start, end))
    report.chain_steps.append(int(entry["outer_step"]))


def cross_check(ledgers: Mapping[str, list[dict[str, Any]]]) -> list[str]:
    """Violations of the swarm's ledgers (node id -> entries) taken together: a range a node's chain
    keeps for round r while a member of r's group recorded an average without it (see the module
    notes). Each node's own replay (`check`) is separate.

    A recorder testifies of the model it applied: a member whose round ended in another model than the
    node's (another global digest: one of them missed a part the other applied, so one of them went
    astray and was repaired from the other's lineage, whose record of the node decides its cursor)
    says nothing of the batches the node's model holds."""
    left_out: dict[tuple[int, str], list[tuple[str, str | None]]] = {}
    """(round, node) -> the members whose average lacked it, with the digest each held after it."""
    for recorder, entries in ledgers.items():
        for entry in entries:
            if entry.get("event") == "settle" and entry.get("group"):
                for member in set(entry["group"]) - set(entry.get("included", ())):
                    testimony = (recorder, entry.get("global_digest"))
                    left_out.setdefault((int(entry["outer_step"]), str(member)), []).append(testimony)
    errors = []
    for node_id, entries in ledgers.items():
        report = check(entries)
        own = digests_by_round(entries)
        for (start, end), step in zip(report.chain, report.chain_steps, strict=True):
            digest = own.get(step + 1)
            witness = next(
                (
                    recorder
                    for recorder, theirs in left_out.get((step, node_id), ())
                    if digest is None or theirs is None or theirs == digest
                ),
                None,
            )
            if witness is not None:
                errors.append(
                    f"node {node_id[:12]}: round {step}'s batches {start}→{end} are counted in its chain, "
                    f"but {witness[:12]}'s average of that round left them out"
                )
    return errors


def check_dirs(dirs: list[Path]) -> list[dict[str, Any]]:
    """Each node's ledger in these data dirs, replayed with `check`: per node its dir, node id, entries,
    rounds in the chain, rounds trained again and violations (a line that is no entry is one).
    ValueError for a directory without a ledger."""
    missing = [d for d in dirs if not (d / LEDGER_FILE).is_file()]
    if missing:
        raise ValueError(f"{str(missing[0])!r} has no {LEDGER_FILE} (is it a node's --data-dir?)")
    nodes: list[dict[str, Any]] = []
    for directory in dirs:
        by_node: dict[str, list[dict[str, Any]]] = {}
        bad_lines = []
        lines = (directory / LEDGER_FILE).read_text(errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
                by_node.setdefault(str(entry["node_id"]), []).append(entry)
            except (ValueError, TypeError, KeyError):
                if line.strip():
                    bad_lines.append(f"line {number} is not a ledger entry")
        for node_id, entries in by_node.items() or {"?": []}.items():
            try:
                report = check(entries)
            except (KeyError, TypeError, ValueError) as exc:  # an entry without the fields of its event
                report = LedgerReport(errors=[f"malformed entry {exc!r}"])
            found: dict[str, Any] = {"rounds": len(report.chain), "retrained": len(report.retrained)}
            found["violations"] = bad_lines + report.errors
            nodes.append({"dir": str(directory), "node_id": node_id, "entries": entries, **found})
    return nodes


@dataclass(frozen=True)
class Window:
    """A range of a shard's batches that one node's chain counts in the model."""

    start: Point
    end: Point
    node_id: str
    outer_step: int


def shard_windows(ledgers: Mapping[str, list[dict[str, Any]]]) -> tuple[dict[int, list[Window]], list[str]]:
    """The swarm-wide view over many nodes' ledgers (node id -> entries): per shard, the windows each
    node's chain counts, in order, and the violations — a window trained twice (it overlaps another
    node's), or a gap (a window starts past where the shard's previous one ended). A node's last round
    that no settle closed (it died with its Δ on the wire) counts only when another member's average
    included it; otherwise the shard goes on from its start (taken over: trained again)."""
    included = _included_rounds(ledgers)
    shards: dict[int, list[Window]] = {}
    for node_id, entries in ledgers.items():
        report = check(entries)
        pending = _pending_round(entries)
        for (start, end), step in zip(report.chain, report.chain_steps, strict=True):
            if step == pending and (step, node_id) not in included:
                continue
            shards.setdefault(start[0], []).append(Window(start, end, node_id, step))
    errors = []
    for shard, windows in sorted(shards.items()):
        windows.sort(key=lambda w: (w.start, w.end))
        errors += _seams(shard, windows)
    return shards, errors


def _included_rounds(ledgers: Mapping[str, list[dict[str, Any]]]) -> set[tuple[int, str]]:
    """(round, node) pairs some member's settle names among the included."""
    return {
        (int(e["outer_step"]), str(member))
        for entries in ledgers.values()
        for e in entries
        if e.get("event") == "settle"
        for member in e.get("included", ())
    }


def _pending_round(entries: list[dict[str, Any]]) -> int | None:
    """The outer step of a node's last round when no settle or adopt followed it."""
    for entry in reversed(entries):
        if entry.get("event") == "round":
            return int(entry["outer_step"])
        if entry.get("event") in ("settle", "adopt"):
            return None
    return None


def _seams(shard: int, windows: list[Window]) -> list[str]:
    errors, previous = [], None
    if windows and windows[0].start[1:] != (0, 0):
        errors.append(
            f"shard {shard}: its first window starts at {windows[0].start}: batches before it skipped"
        )
    for window in windows:
        if previous is not None and window.start < previous.end:
            errors.append(
                f"shard {shard}: {window.node_id[:12]}'s round {window.outer_step} "
                f"{window.start}→{window.end} overlaps {previous.node_id[:12]}'s round "
                f"{previous.outer_step} (ending {previous.end}): batches trained twice"
            )
        elif previous is not None and window.start > previous.end:
            errors.append(
                f"shard {shard}: a gap {previous.end}→{window.start} before {window.node_id[:12]}'s round "
                f"{window.outer_step}: batches skipped"
            )
        previous = window if previous is None or window.end > previous.end else previous
    return errors
