"""Parsers of `swarmnode run`'s flag values: each takes the text of a flag, its variable or its TOML key
and returns the value, or raises ValueError with the reason (`config.parse_flag` names the source)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from swarmnode.swarm.averaging.grouping import MIN_GROUP_SIZE
from swarmnode.swarm.averaging.wire import MAX_GROUP_SIZE
from swarmnode.util.validate import parse_host_port


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be a positive integer")
    return value


def group_size(text: str) -> int:
    value = int(text)
    if not MIN_GROUP_SIZE <= value <= MAX_GROUP_SIZE:
        raise ValueError(f"must be in {MIN_GROUP_SIZE}..{MAX_GROUP_SIZE}")
    return value


MAX_RECOVERY_PEERS = 16


def recovery_peers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_RECOVERY_PEERS:
        raise ValueError(f"must be in 1..{MAX_RECOVERY_PEERS}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be ≥ 0")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number 0-65535 (0 = pick a free port)")
    return value


def bulk_port(text: str) -> int | None:
    if text == "off":
        return None
    try:
        return port(text)
    except ValueError:
        raise ValueError("must be a port number 0-65535 (0 = pick a free port) or off") from None


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a positive number")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be between 0 and 1")
    return value


def density(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError("must be above 0 and at most 1")
    return value


def mix(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError("must be at least 0 and below 1")
    return value


def peer_list(text: str) -> tuple[str, ...]:
    peers = tuple(p.strip() for p in text.split(",") if p.strip())
    for peer in peers:
        parse_host_port(peer)
    return peers


def host(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("must be a host name or IP address")
    try:
        ipaddress.ip_address(text)
    except ValueError:
        if not all(part.replace("-", "").replace("_", "").isalnum() for part in text.split(".")):
            raise ValueError("must be a host name or IP address") from None
    return text


def run_id(text: str) -> str:
    if not text or len(text) > 64 or not all(c.isalnum() or c in "-_." for c in text):
        raise ValueError("must be 1-64 characters of letters, digits, '-', '_' or '.'")
    return text


def zstd_level(text: str) -> int:
    value = int(text)
    if not -7 <= value <= 19:
        raise ValueError("must be a zstd level between -7 and 19")
    return value


def non_empty(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return text


def choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError("must be one of " + "|".join(choices))
        return text

    return parse
