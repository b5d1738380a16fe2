"""What a training-state snapshot says about itself: its `__metadata__["swarmnode"]` JSON as one typed
record, validated field by field in one place.

Every reader of a node's snapshots — the catalogue scan at start, a restore of its own file, a peer's
download — goes through `SnapshotMetadata.parse`, so a crafted or damaged file (even one whose sha256
matches its name) is refused with one `SnapshotError` naming the field, never a `ValueError` or
`KeyError` from deep inside a restore. The file format itself (names, header, tensors) is `snapshot.py`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarmnode.snapshot.format import LAYOUTS, SnapshotError
from swarmnode.util.validate import is_sha256_hex, parse_count, parse_cursor

Cursor = dict[str, int]
_NODE_ID = re.compile(r"[0-9a-f]{40}")
KINDS = ("hot", "cold")


@dataclass(frozen=True)
class SnapshotMetadata:
    """The training state's counters, cursors and identity as one snapshot recorded them."""

    run_id: str
    node_id: str
    """Hex id of the node that wrote the snapshot."""
    run_digest: str
    """Hash of everything that must agree across a run (see `training.run_digest`)."""
    corpus_digest: str
    model: str
    kind: str
    layout: str
    outer_step: int
    inner_step: int
    round_step: int
    """Inner steps of the round in progress when the snapshot was taken."""
    round_tokens: int
    tokens: int
    last_loss: float | None
    heldout_loss: float | None
    cursor: Cursor
    """The writer's loader position."""
    committed_cursor: Cursor
    """Where the writer's batches in the global params end (its last applied round)."""
    swarm_cursors: Mapping[str, Cursor]
    """The lineage's record of every node: how far its batches are in the global params."""
    last_round: Mapping[str, Any] | None
    global_digest: str
    adam_step: int
    optimizer: Mapping[str, Any]
    created_at: float
    """Unix seconds by the writer's clock."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> SnapshotMetadata:
        """The metadata of a snapshot, or SnapshotError naming the first field that is missing or wrong."""
        try:
            return cls._parse(raw)
        except KeyError as exc:
            raise SnapshotError(f"malformed snapshot metadata: {exc.args[0]!r} is missing") from None
        except _BadField as exc:
            raise SnapshotError(f"malformed snapshot metadata: {exc}") from None

    @classmethod
    def _parse(cls, raw: Mapping[str, Any]) -> SnapshotMetadata:
        optimizer = _field(raw, "optimizer", _object)
        return cls(
            run_id=_field(raw, "run_id", _text),
            node_id=_field(raw, "node_id", _node_id),
            run_digest=_field(raw, "run_digest", _sha256),
            corpus_digest=_field(raw, "corpus_digest", _sha256),
            model=_field(raw, "model", _text),
            kind=_field(raw, "kind", _one_of(KINDS)),
            layout=_field(raw, "layout", _one_of(LAYOUTS)),
            outer_step=_field(raw, "outer_step", parse_count),
            inner_step=_field(raw, "inner_step", parse_count),
            round_step=_field(raw, "round_step", parse_count),
            round_tokens=_field(raw, "round_tokens", parse_count),
            tokens=_field(raw, "tokens", parse_count),
            last_loss=_field(raw, "last_loss", _optional_number),
            heldout_loss=_field(raw, "heldout_loss", _optional_number),
            cursor=_field(raw, "cursor", parse_cursor),
            committed_cursor=_field(raw, "committed_cursor", parse_cursor),
            swarm_cursors=_field(raw, "swarm_cursors", _cursor_table),
            last_round=_field(raw, "last_round", _optional_object),
            global_digest=_field(raw, "global_digest", _sha256),
            adam_step=_field(optimizer, "adam_step", parse_count),
            optimizer=optimizer,
            created_at=_field(raw, "created_at", _finite_number),
        )


class _BadField(Exception):
    pass


def _field(raw: Mapping[str, Any], name: str, parse: Any) -> Any:
    value = raw[name]
    try:
        return parse(value)
    except (ValueError, TypeError) as exc:
        raise _BadField(f"{name} = {_short(value)}: {exc}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ValueError("not a short non-empty string")
    return value


def _node_id(value: Any) -> str:
    if not isinstance(value, str) or not _NODE_ID.fullmatch(value):
        raise ValueError("not a node id (40 lowercase hex digits)")
    return value


def _sha256(value: Any) -> str:
    if not is_sha256_hex(value):
        raise ValueError("not a sha256 hex digest")
    return str(value)


def _one_of(choices: tuple[str, ...]) -> Any:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError("not one of " + "|".join(choices))
        return str(value)

    return parse


def _finite_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError("not a finite number")
    return float(value)


def _optional_number(value: Any) -> float | None:
    """A loss: a number (NaN allowed: a run without held-out data) or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("not a number")
    return float(value)


def _object(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _optional_object(value: Any) -> Mapping[str, Any] | None:
    return None if value is None else _object(value)


def _cursor_table(value: Any) -> Mapping[str, Cursor]:
    table = _object(value)
    return {_node_id(node): parse_cursor(cursor) for node, cursor in table.items()}
