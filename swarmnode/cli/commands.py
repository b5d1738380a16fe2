"""The `swarmnode status`, `fetch` and `ledger check` commands: what they print and their exit codes
(`main.py` parses the arguments). Imports no torch, so a status answers in well under a second."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from swarmnode.cli.units import duration, percent, rate, size
from swarmnode.core.ledger import Window, check_dirs, cross_check, shard_windows
from swarmnode.net.rpc import NodeStatus, PeerUnavailable, client_security
from swarmnode.net.snapshot_client import fetch_snapshot, get_status
from swarmnode.util.labels import FetchFailure


def fetch_command(address: str, snapshot: str | None, out: Path) -> int:
    """`swarmnode fetch`: fetches and verifies a snapshot into `out`; prints one line. Returns the
    exit code: 0 done, 1 the peer could not deliver, 2 bad arguments."""
    snapshot_id = None if snapshot in (None, "", "latest") else snapshot
    try:
        result = asyncio.run(fetch_snapshot(address, Path(out), snapshot_id=snapshot_id))
    except ValueError as exc:
        print(f"swarmnode fetch: {exc}", file=sys.stderr)
        return 2
    except PeerUnavailable as exc:
        print(refusal_line("fetch", address, exc), file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"swarmnode fetch: {exc}", file=sys.stderr)
        return 1
    meta = result.metadata
    rate = result.size_bytes / max(result.seconds, 1e-9) / 1e6
    print(
        f"{out}: snapshot {meta.snapshot_id} ({meta.kind}, outer step {meta.outer_step}, inner step "
        f"{meta.inner_step}), {result.size_bytes} bytes in {result.seconds:.2f} s ({rate:.0f} MB/s), "
        "sha256 ok"
    )
    return 0


def status_command(address: str, as_json: bool) -> int:
    """`swarmnode status`: prints a node's live state (as JSON with `as_json`). Returns the exit code:
    0 done, 1 the node did not answer, 2 bad arguments."""
    try:
        status = asyncio.run(get_status(address))
    except ValueError as exc:
        print(f"swarmnode status: {exc}", file=sys.stderr)
        return 2
    except PeerUnavailable as exc:
        print(refusal_line("status", address, exc), file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(status), indent=2) if as_json else format_status(status))
    return 0


_HANDSHAKE_SIGNS = ("Socket closed", "handshake", "SSL", "Connection reset", "Broken pipe")
"""What gRPC's UNAVAILABLE detail says when the server ended the connection during the TLS handshake
(a node with --tls-ca requires a client certificate its CA signed; gRPC cannot tell the caller more).
A node that crashed mid-call says some of the same, so they count only from a client without one."""


def refusal_line(command: str, address: str, exc: PeerUnavailable) -> str:
    """The one line a failed call prints; a refused TLS handshake is named as such when the client
    had no certificate to show (`rpc.configure_client` without --tls-cert)."""
    detail = str(exc)
    uncertified = client_security().tls_cert is None
    if uncertified and exc.reason == FetchFailure.UNREACHABLE and any(s in detail for s in _HANDSHAKE_SIGNS):
        return (
            f"swarmnode {command}: {address} refused the TLS handshake (UNAVAILABLE): a node with --tls-ca "
            "requires a client certificate its CA signed; give --tls-ca, --tls-cert and --tls-key "
            "(or SWARMNODE_TLS_CA/_CERT/_KEY)"
        )
    return f"swarmnode {command}: {detail}"


def format_status(status: NodeStatus) -> str:
    """A node's status as a few human-readable lines, figures rounded and with their units (`--json`
    has them exact)."""
    loss = "-" if status.last_loss is None else f"{status.last_loss:.4f}"
    cur = status.cursor
    cursor = "-" if cur is None else f"shard {cur.shard} epoch {cur.epoch} position {cur.position:,}"
    lines = [
        f"node {status.node_id}  run {status.run_id}  phase {status.phase}  up {duration(status.uptime_s)}",
        f"step outer {status.outer_step} inner {status.inner_step:,}  loss {loss}  "
        f"{rate(status.tokens_per_s, 'tokens')}",
        f"cursor {cursor}  peers {status.peers}  digest {status.global_digest[:12] or '-'}",
    ]
    if status.reachability:
        lines.append(f"reachability {status.reachability}")
    if status.snapshot_error:
        lines.append(f"WARNING: {status.snapshot_error}")
    if status.last_group:
        coverage = "-" if status.last_coverage is None else percent(status.last_coverage)
        took = "-" if status.last_allreduce_s is None else duration(status.last_allreduce_s)
        lines.append(
            f"last round: group of {len(status.last_group)}, coverage {coverage}, all-reduce {took}, "
            f"repairs {status.repairs}"
        )
    lines += [
        f"snapshot {m.snapshot_id[:12]} {m.kind} outer {m.outer_step} inner {m.inner_step:,} "
        f"{size(m.size_bytes)}"
        for m in status.snapshots
    ]
    return "\n".join(lines)


def ledger_check_command(dirs: list[Path], as_json: bool) -> int:
    """`swarmnode ledger check`: one line per node, the swarm-wide view (per shard, which windows
    which node trained), then one line per violation across them (`cross_check`, `shard_windows`: a
    window trained twice, a gap behind a committed cursor), or JSON; exit 1 on any violation, 2 for a
    directory without a ledger."""
    replayed = check_dirs(dirs)  # ValueError for a directory without a ledger: exit 2
    nodes = [{k: v for k, v in node.items() if k != "entries"} for node in replayed]
    windows: dict[int, list[Window]] = {}
    across: list[str] = []
    if not any(node["violations"] for node in nodes):  # a malformed ledger: its chain is not evidence
        across += cross_check({node["node_id"]: node["entries"] for node in replayed})
        windows, seams = shard_windows({node["node_id"]: node["entries"] for node in replayed})
        across += seams
    ok = not across and not any(node["violations"] for node in nodes)
    shards = _shard_spans(windows)
    if as_json:
        print(json.dumps({"ok": ok, "nodes": nodes, "across_nodes": across, "shards": shards}, indent=2))
        return 0 if ok else 1
    for node in nodes:
        head = f"{node['dir']}: node {node['node_id'][:12]}"
        if node["violations"]:
            print(f"{head}: {len(node['violations'])} violation(s): " + "; ".join(node["violations"]))
        else:
            print(f"{head}: ok ({node['rounds']} rounds in the chain, {node['retrained']} trained again)")
    for shard, spans in shards.items():
        print(
            f"shard {shard}: "
            + ", ".join(
                f"{s['start']}→{s['end']} by {s['node_id'][:12]} (rounds {s['rounds'][0]}–{s['rounds'][1]})"
                for s in spans
            )
        )
    for violation in across:
        print(f"across nodes: {violation}")
    return 0 if ok else 1


def _shard_spans(windows: dict[int, list[Window]]) -> dict[int, list[dict[str, Any]]]:
    """Each shard's windows, consecutive ones of one node joined: who trained which batches, once."""
    spans: dict[int, list[dict[str, Any]]] = {}
    for shard, ordered in sorted(windows.items()):
        joined: list[dict[str, Any]] = []
        for w in ordered:
            last = joined[-1] if joined else None
            if last is not None and last["node_id"] == w.node_id and last["end"] == _cursor_text(w.start):
                last["end"], last["rounds"][1] = _cursor_text(w.end), w.outer_step
            else:
                joined.append(
                    {
                        "node_id": w.node_id,
                        "start": _cursor_text(w.start),
                        "end": _cursor_text(w.end),
                        "rounds": [w.outer_step, w.outer_step],
                    }
                )
        spans[shard] = joined
    return spans


def _cursor_text(point: tuple[int, int, int]) -> str:
    return f"e{point[1]}:{point[2]}"
