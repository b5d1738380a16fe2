"""Checks of values that arrive from people (flags, files) or peers (DHT records, snapshot metadata, gRPC
messages): each returns the value or raises ValueError saying why, so every layer validates the same way."""

from __future__ import annotations

import re
from typing import Any

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_NODE_ID_HEX = re.compile(r"[0-9a-f]{40}")
CURSOR_KEYS = ("shard", "epoch", "position")


def is_sha256_hex(value: object) -> bool:
    """Whether `value` is a sha256 digest as the swarm writes it: exactly 64 lowercase hex digits."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


def is_node_id_hex(value: object) -> bool:
    """Whether `value` is a node id as the swarm writes it: exactly 40 lowercase hex digits."""
    return isinstance(value, str) and _NODE_ID_HEX.fullmatch(value) is not None


def parse_host_port(text: str) -> tuple[str, int]:
    """Split "host:port" (host may be a name, IPv4 or [IPv6]); raise ValueError when malformed."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError("expected HOST:PORT")
    port = int(port_text)
    if not 0 < port <= 65535:
        raise ValueError("port out of range in HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, port


def parse_count(value: Any) -> int:
    """`value` if it is a non-negative int (not a bool); ValueError otherwise (peer input)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def parse_cursor(value: Any) -> dict[str, int]:
    """A data cursor from JSON (a peer's record, a snapshot's metadata): exactly shard, epoch and
    position, each a count; ValueError otherwise."""
    try:
        if not isinstance(value, dict) or set(value) != set(CURSOR_KEYS):
            raise ValueError
        return {key: parse_count(count) for key, count in value.items()}
    except ValueError:
        raise ValueError(f"not a cursor: {value!r}") from None
