"""What a node announces in the DHT about its snapshots, and how a reader checks what peers announced.

Under `swarmnode/<run>/snapshots` each node keeps one signed entry (the DHT layer proves who wrote it):
its advertised gRPC address (none for a client, which nobody can dial: docs/design.md "Behind NAT"), its
reachability, its newest snapshot (id, size, steps, kind, created-at), its data cursor and
its run digest. A signature only proves authorship: the content is still checked field by field when it
is decoded (`Announcement.from_entry`), since a peer is never trusted.
"""

from __future__ import annotations

from typing import Any

import msgspec

from swarmnode.net.dht_records import decode_typed_value
from swarmnode.util.labels import SnapshotKind
from swarmnode.util.validate import is_node_id_hex, is_sha256_hex, parse_cursor, parse_host_port

ANNOUNCE_TTL_S = 900.0


def snapshots_key(run_id: str) -> str:
    return f"swarmnode/{run_id}/snapshots"


class Announcement(msgspec.Struct, frozen=True):
    """One node's newest snapshot as it announces it. The DHT value's short keys (a record must stay
    under ~1,200 bytes) are the fields' wire names; the node id is the entry's signed publisher."""

    node_id: str = msgspec.field(name="node")
    address: str = msgspec.field(name="addr")
    snapshot_id: str = msgspec.field(name="id")
    size_bytes: int = msgspec.field(name="size")
    outer_step: int = msgspec.field(name="o")
    inner_step: int = msgspec.field(name="i")
    kind: SnapshotKind = msgspec.field(name="kind")
    created_at: float = msgspec.field(name="t")
    run_digest: str = msgspec.field(name="run")
    cursor: dict[str, int] | None = msgspec.field(name="cur", default=None)
    reachable: bool = msgspec.field(name="r", default=True)
    """False: a client; it serves no one, so its address is empty."""

    def __post_init__(self) -> None:
        if self.reachable or self.address:
            parse_host_port(self.address)
        if self.cursor is not None:
            parse_cursor(self.cursor)
        if min(self.size_bytes, self.outer_step, self.inner_step) < 0:
            raise ValueError("negative size or step")
        if not (is_sha256_hex(self.snapshot_id) and is_sha256_hex(self.run_digest)):
            raise ValueError("snapshot id and run digest must be sha256 hex digests")
        if not is_node_id_hex(self.node_id):
            raise ValueError("not a node id")

    @property
    def serves(self) -> bool:
        """Whether peers may fetch from this node (a client's snapshots serve its own restarts only)."""
        return self.reachable and bool(self.address)

    @property
    def freshness(self) -> tuple[int, int]:
        return self.outer_step, self.inner_step

    def to_value(self) -> dict[str, Any]:
        """The DHT value (the node id travels as the entry's publisher, not in it)."""
        value: dict[str, Any] = msgspec.to_builtins(self)
        del value["node"]
        value["t"] = round(self.created_at, 3)
        if self.reachable:
            del value["r"]  # as before clients existed
        return value

    @classmethod
    def from_value(cls, node_id: str, value: Any) -> Announcement | None:
        """The announcement in a peer's DHT value, or None when any field is malformed."""
        return decode_typed_value(cls, node_id, value)


PRESENCE_TTL_S = 180.0
"""A presence record outlives its node by at most this (it is re-announced every third of it)."""


def members_key(run_id: str) -> str:
    return f"swarmnode/{run_id}/members"


class Presence(msgspec.Struct, frozen=True):
    """ "This node runs in this run": published from the node's start (before it trained or wrote any
    snapshot) for as long as it runs, so that --wait-peers counts members — clients too, which are in
    nobody's routing table — not routing contacts."""

    run_digest: str = msgspec.field(name="run")
    reachable: bool = msgspec.field(name="r", default=True)

    def __post_init__(self) -> None:
        if not is_sha256_hex(self.run_digest):
            raise ValueError("the run digest must be a sha256 hex digest")

    @classmethod
    def from_value(cls, node_id: str, value: Any) -> Presence | None:
        return decode_typed_value(cls, node_id, value)
