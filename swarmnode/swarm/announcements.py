"""What a node announces in the DHT about its snapshots, and how a reader checks what peers announced.

Under `swarmnode/<run>/snapshots` each node keeps one signed entry (the DHT layer proves who wrote it):
its advertised gRPC address, its newest snapshot (id, size, steps, kind, created-at), its data cursor and
its run digest. A signature only proves authorship: the content is still checked field by field here,
since a peer is never trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarmnode.util.validate import is_sha256_hex, parse_count, parse_cursor, parse_host_port

ANNOUNCE_TTL_S = 900.0


def snapshots_key(run_id: str) -> str:
    return f"swarmnode/{run_id}/snapshots"


@dataclass(frozen=True)
class Announcement:
    node_id: str
    address: str
    snapshot_id: str
    size_bytes: int
    outer_step: int
    inner_step: int
    kind: str
    created_at: float
    run_digest: str
    cursor: dict[str, int] | None

    @property
    def freshness(self) -> tuple[int, int]:
        return self.outer_step, self.inner_step

    def to_value(self) -> dict[str, Any]:
        """The DHT value (short keys: a record must stay under ~1,200 bytes)."""
        return {
            "addr": self.address,
            "id": self.snapshot_id,
            "size": self.size_bytes,
            "o": self.outer_step,
            "i": self.inner_step,
            "kind": self.kind,
            "t": round(self.created_at, 3),
            "run": self.run_digest,
            "cur": self.cursor,
        }

    @classmethod
    def from_value(cls, node_id: str, value: dict[str, Any]) -> Announcement | None:
        """The announcement in a peer's DHT value, or None when any field is malformed."""
        try:
            announcement = cls(
                node_id,
                str(value["addr"]),
                str(value["id"]),
                parse_count(value["size"]),
                parse_count(value["o"]),
                parse_count(value["i"]),
                str(value["kind"]),
                float(value["t"]),
                str(value["run"]),
                _cursor(value.get("cur")),
            )
            parse_host_port(announcement.address)
        except (KeyError, TypeError, ValueError):
            return None
        ok = (
            is_sha256_hex(announcement.snapshot_id)
            and is_sha256_hex(announcement.run_digest)
            and announcement.kind in ("hot", "cold")
        )
        return announcement if ok else None


def _cursor(value: Any) -> dict[str, int] | None:
    return None if value is None else parse_cursor(value)
