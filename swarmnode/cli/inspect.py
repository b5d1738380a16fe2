"""`swarmnode inspect`: look into a snapshot file (its metadata, its tensors, its hash)."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

from swarmnode.cli.units import size
from swarmnode.snapshot.format import SnapshotError, parse_snapshot_name
from swarmnode.snapshot.read import verify_snapshot


def inspect_command(path: Path, as_json: bool, list_tensors: bool = False) -> int:
    """Print a snapshot's summary after checking its hash (`list_tensors`: every tensor too; `as_json`:
    everything, metadata and tensors, as JSON); exit 1 on a bad file."""
    parsed = parse_snapshot_name(path.name)
    expected = parsed[3] if parsed else None
    try:
        snapshot_id, header = verify_snapshot(path, expected_id=expected)
    except SnapshotError as exc:
        print(f"swarmnode inspect: {path}: {exc}", file=sys.stderr)
        return 1
    tensors = [
        {
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "bytes": e.end - e.begin,
            "stored_as": "planes" if e.planes else "plain",
        }
        for e in header.entries
    ]
    report: dict[str, Any] = {
        "file": str(path),
        "snapshot_id": snapshot_id,
        "hash_check": "matches file name" if expected else "computed (name has no id)",
        "size_bytes": path.stat().st_size,
        "raw_bytes": header.data_bytes,
        "layout": header.layout,
        "metadata": header.metadata,
        "tensors": tensors,
    }
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(summary_lines(report)))
        if list_tensors:
            print("\n".join(tensor_lines(report["tensors"])))
    return 0


SUMMARY_FIELDS = ("kind", "run_id", "node_id", "model", "outer_step", "inner_step", "tokens")
"""The metadata a summary shows, in this order; the rest is in `--json`."""


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What `inspect` prints by default: the file, its check, its size and the training state's gist."""
    meta = report["metadata"]
    ratio = report["size_bytes"] / max(report["raw_bytes"], 1)
    lines = [
        f"file         {report['file']}",
        f"snapshot id  {report['snapshot_id']} ({report['hash_check']})",
        f"size         {size(report['size_bytes'])} compressed, {size(report['raw_bytes'])} raw "
        f"(ratio {ratio:.3f}), layout {report['layout']}",
    ]
    lines += [f"{name:<12} {meta[name]}" for name in SUMMARY_FIELDS if name in meta]
    if isinstance(meta.get("created_at"), int | float):
        when = datetime.datetime.fromtimestamp(meta["created_at"], datetime.UTC)
        lines.append(f"created      {when:%Y-%m-%d %H:%M:%S} UTC")
    losses = [f"{name} {meta[name]:.4f}" for name in ("last_loss", "heldout_loss") if _number(meta.get(name))]
    if losses:
        lines.append("loss         " + ", ".join(losses))
    lines.append("tensors      " + _tensor_groups(report["tensors"]) + " (--tensors: each)")
    hidden = len(set(meta) - set(SUMMARY_FIELDS) - {"created_at", "last_loss", "heldout_loss"})
    lines.append(f"metadata     {hidden} more fields (--json shows everything)")
    return lines


def tensor_lines(tensors: list[dict[str, Any]]) -> list[str]:
    """`--tensors`: one line per tensor: name, dtype, shape, bytes, how it is stored."""
    width = max((len(t["name"]) for t in tensors), default=4)
    lines = [f"{len(tensors)} tensors:"]
    for t in tensors:
        shape = str(t["shape"])
        lines.append(
            f"  {t['name']:<{width}}  {t['dtype']:<4} {shape:<16} {t['bytes']:>12,}  {t['stored_as']}"
        )
    return lines


def _tensor_groups(tensors: list[dict[str, Any]]) -> str:
    """ "141 in model/ 40 (4.1 MB), …": the tensors counted by their name's first part."""
    groups: dict[str, list[int]] = {}
    for t in tensors:
        count_bytes = groups.setdefault(t["name"].split("/", 1)[0] + "/", [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += t["bytes"]
    parts = [f"{prefix} {n} ({size(total)})" for prefix, (n, total) in groups.items()]
    return f"{len(tensors)}: " + ", ".join(parts)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
