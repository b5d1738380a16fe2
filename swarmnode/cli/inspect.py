"""`swarmnode inspect`: look into a snapshot file (its metadata, its tensors, its hash)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from swarmnode.snapshot.format import SnapshotError, parse_snapshot_name
from swarmnode.snapshot.read import verify_snapshot


def inspect_command(path: Path, as_json: bool) -> int:
    """Print a snapshot's metadata and tensor table after checking its hash; exit 1 on a bad file."""
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
        _print_report(report)
    return 0


def _print_report(report: dict[str, Any]) -> None:
    print(f"file        {report['file']}")
    print(f"snapshot id {report['snapshot_id']}  ({report['hash_check']})")
    ratio = report["size_bytes"] / max(report["raw_bytes"], 1)
    print(
        f"size        {report['size_bytes']:,} bytes compressed, {report['raw_bytes']:,} raw "
        f"(ratio {ratio:.3f}), layout {report['layout']}"
    )
    for key, value in sorted(report["metadata"].items()):
        print(f"  {key:<14} {json.dumps(value)}")
    print(f"{len(report['tensors'])} tensors:")
    width = max((len(t["name"]) for t in report["tensors"]), default=4)
    for t in report["tensors"]:
        shape = str(t["shape"])
        print(f"  {t['name']:<{width}}  {t['dtype']:<4} {shape:<16} {t['bytes']:>12,}  {t['stored_as']}")
