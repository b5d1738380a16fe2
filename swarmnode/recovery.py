"""Coming back after a crash: pick the freshest verified state, restore it, and leave a receipt.

A receipt is one JSON line appended to DATA_DIR/receipts.jsonl per start: where the state came from,
which snapshot, how long each stage took, the cursor used, and the first loss after vs. the loss the
snapshot recorded, so an operator can see that a restart continued rather than started over.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swarmnode.checkpointer import quarantine
from swarmnode.snapshot import SnapshotError, iter_snapshot_files, parse_snapshot_name, read_snapshot
from swarmnode.training import TrainingRun

logger = logging.getLogger(__name__)

RECEIPTS_FILE = "receipts.jsonl"


@dataclass
class Receipt:
    source: str  # "local" | "peer" | "fresh"
    snapshot_id: str | None = None
    peer: str | None = None
    bytes: int = 0
    outer_step: int = 0
    inner_step: int = 0
    cursor: dict[str, int] = field(default_factory=dict)
    cursor_source: str = "fresh"  # "own_snapshot" | "announcement" | "round_metadata" | "fresh"
    stages_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    loss_before: float | None = None
    first_loss_after: float | None = None
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def restore_local(run: TrainingRun, snapshot_dir: Path) -> tuple[Receipt, set[str]] | None:
    """Restore the newest of this node's own snapshots that verifies; corrupt ones are set aside.

    Returns the receipt and the ids verified on the way, or None when no usable snapshot exists.
    """
    template = run.template()
    verified: set[str] = set()
    for path in iter_snapshot_files(snapshot_dir):
        parsed = parse_snapshot_name(path.name)
        assert parsed is not None
        started = time.perf_counter()
        try:
            loaded = read_snapshot(path, expected_id=parsed[3], template=template)
        except SnapshotError as exc:
            quarantine(path, str(exc))
            continue
        verified.add(loaded.snapshot_id)
        if loaded.metadata.get("run_digest") != run.identity.run_digest:
            logger.warning("snapshot %s belongs to another run configuration; not resuming from it",
                           path.name)
            continue
        load_started = time.perf_counter()
        run.restore_own(loaded)
        done = time.perf_counter()
        receipt = Receipt(
            source="local", snapshot_id=loaded.snapshot_id, bytes=path.stat().st_size,
            outer_step=run.progress.outer_step, inner_step=run.progress.inner_step,
            cursor=run.loader.state_dict(), cursor_source="own_snapshot",
            stages_s={"read_verify": load_started - started, "load": done - load_started},
            seconds=done - started, loss_before=loaded.metadata.get("last_loss"))
        return receipt, verified
    return None


def append_receipt(data_dir: Path, receipt: Receipt) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / RECEIPTS_FILE).open("a") as f:
        f.write(receipt.to_json() + "\n")


def read_receipts(data_dir: Path) -> list[dict[str, Any]]:
    path = data_dir / RECEIPTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
