"""The gRPC channel and server arguments we set are ones gRPC knows: it ignores a misspelt name
silently (the server's ping policy once was, and its GOAWAY "too_many_pings" cut all-reduce calls)."""

from __future__ import annotations

from pathlib import Path

import grpc._cython.cygrpc as cygrpc
import pytest

from swarmnode.net import rpc


@pytest.mark.parametrize("name", sorted({name for name, _ in [*rpc.SERVER_OPTIONS, *rpc.CLIENT_OPTIONS]}))
def test_every_channel_argument_is_known_to_grpc(name: str) -> None:
    assert name.encode() in Path(cygrpc.__file__).read_bytes(), f"gRPC has no channel argument {name}"


def test_the_server_welcomes_the_clients_keepalive_pings() -> None:
    server = dict(rpc.SERVER_OPTIONS)
    client = dict(rpc.CLIENT_OPTIONS)
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
