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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from swarmnode.snapshot.format import LAYOUTS, SnapshotError
from swarmnode.util.validate import is_sha256_hex, parse_count, parse_cursor

Cursor = dict[str, int]
_NODE_ID = re.compile(r"[0-9a-f]{40}")
KINDS = ("hot", "cold")


class _BadField(Exception):
    pass


def _field(raw: Mapping[str, Any], name: str, parse: Any) -> Any:
    value = raw[name]
    try:
        return parse(value)
    except (ValueError, TypeError) as exc:
        raise _BadField(f"{name} = {_short(value)}: {exc}") from None


def _present(raw: Mapping[str, Any], f: Any) -> Any:
    """A field's parsed value; its `absent` value when an optional field is missing."""
    if f.name not in raw and f.metadata["absent"] is not ...:
        return f.metadata["absent"]
    return _field(raw, f.name, f.metadata["parse"])


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


def _optimizer(value: Any) -> Mapping[str, Any]:
    optimizer = _object(value)
    _field(optimizer, "adam_step", parse_count)
    _field(optimizer, "schedule_step", parse_count)
    if "grad_scaler" in optimizer:  # (fp16 runs only; older snapshots have none)
        _field(optimizer, "grad_scaler", parse_grad_scaler)
    return optimizer


def parse_grad_scaler(value: Any) -> tuple[float, int]:
    """(scale, growth tracker) of the optimizer's `grad_scaler` entry (`core/precision.py`); ValueError
    unless the scale is a positive finite number and the tracker a count."""
    scaler = _object(value)
    scale = _finite_number(scaler.get("scale"))
    if not scale > 0:
        raise ValueError("scale: not positive")
    return scale, parse_count(scaler.get("growth_tracker"))


MAX_RANKS = 64
"""The most training ranks a snapshot may record (`ranks`)."""


def _rank_cursors(value: Any) -> tuple[Cursor, ...] | None:
    """Every training rank's cursor, in rank order (None: a snapshot from before ranks were recorded,
    or of a node that did not gather them)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_RANKS:
        raise ValueError(f"not a list of 1 to {MAX_RANKS} cursors")
    return tuple(parse_cursor(cursor) for cursor in value)


def _checked(parse: Callable[[Any], Any], *, absent: Any = ...) -> Any:
    """A metadata field and the check its value gets when a snapshot is read (`absent`: the value a
    snapshot that lacks the field gets; none: the field is required)."""
    return field(metadata={"parse": parse, "absent": absent})


@dataclass(frozen=True)
class StateMetadata:
    """The training state's identity, counters and cursors, as the training run describes itself for a
    snapshot (`TrainingRun.state_metadata`). Each field declares the check its value gets on reading."""

    run_id: str = _checked(_text)
    node_id: str = _checked(_node_id)
    """Hex id of the node that wrote the snapshot."""
    run_digest: str = _checked(_sha256)
    """Hash of everything that must agree across a run (see `training.run_digest`)."""
    corpus_digest: str = _checked(_sha256)
    model: str = _checked(_text)
    outer_step: int = _checked(parse_count)
    inner_step: int = _checked(parse_count)
    round_step: int = _checked(parse_count)
    """Inner steps of the round in progress when the snapshot was taken."""
    round_tokens: int = _checked(parse_count)
    tokens: int = _checked(parse_count)
    last_loss: float | None = _checked(_optional_number)
    heldout_loss: float | None = _checked(_optional_number)
    cursor: Cursor = _checked(parse_cursor)
    """The writer's loader position."""
    committed_cursor: Cursor = _checked(parse_cursor)
    """Where the writer's batches in the global params end (its last applied round)."""
    swarm_cursors: Mapping[str, Cursor] = _checked(_cursor_table)
    """The lineage's record of every node: how far its batches are in the global params."""
    last_round: Mapping[str, Any] | None = _checked(_optional_object)
    global_digest: str = _checked(_sha256)
    optimizer: Mapping[str, Any] = _checked(_optimizer)
    """The optimisers' hyper-parameters, the inner optimizer's step (`adam_step`) and the inner
    learning-rate schedule's position (`schedule_step`, with the schedule and its current `lr`)."""
    created_at: float = _checked(_finite_number)
    """Unix seconds by the writer's clock."""
    ranks: tuple[Cursor, ...] | None = _checked(_rank_cursors, absent=None)
    """Every training rank's cursor, in rank order (`core/ranks.py`; [cursor] on a one-rank node)."""

    @property
    def adam_step(self) -> int:
        return int(self.optimizer["adam_step"])

    @property
    def schedule_step(self) -> int:
        return int(self.optimizer["schedule_step"])

    def to_dict(self) -> dict[str, Any]:
        """The JSON object a snapshot stores."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SnapshotMetadata(StateMetadata):
    """A snapshot's metadata as read back: the training state's, plus what the writer added."""

    kind: str = _checked(_one_of(KINDS))
    layout: str = _checked(_one_of(LAYOUTS))

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> SnapshotMetadata:
        """The metadata of a snapshot, or SnapshotError naming the first field that is missing or wrong."""
        try:
            return cls(**{f.name: _present(raw, f) for f in fields(cls)})
        except KeyError as exc:
            raise SnapshotError(f"malformed snapshot metadata: {exc.args[0]!r} is missing") from None
        except _BadField as exc:
            raise SnapshotError(f"malformed snapshot metadata: {exc}") from None
