"""Shard claims: the least-claimed shard, a departed node's first, nodes starting together spread out
and never share while shards are free; the swarm-wide ledger view finds batches trained twice or skipped."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from swarmnode.core.ledger import Ledger, read_ledger, shard_windows
from swarmnode.swarm import shards
from swarmnode.swarm.shards import ClaimView, ShardClaim, ShardClaims, choose_shard, should_move, view_of

RUN = "ab" * 32
IDS = [f"{i:02x}" * 20 for i in range(1, 9)]


def announcement(shard: int, position: int) -> dict[str, Any]:
    return {
        "addr": "127.0.0.1:5",
        "id": "cd" * 32,
        "size": 1,
        "o": 3,
        "i": 30,
        "kind": "hot",
        "t": 1.0,
        "run": RUN,
        "cur": {"shard": shard, "epoch": 0, "position": position},
    }


def test_the_least_claimed_shard_and_a_departed_nodes_first() -> None:
    claims = {IDS[0]: {"s": 0, "since": 1.0, "run": RUN}, IDS[1]: {"s": 1, "since": 2.0, "run": RUN}}
    claims[IDS[2]] = {"s": 2, "since": 1.0, "run": "ef" * 32}  # another run's: not counted
    claims[IDS[3]] = {"s": "x", "since": 1.0, "run": RUN}  # malformed: not counted
    view = view_of(claims, {IDS[4]: announcement(3, 40), IDS[5]: announcement(2, 0)}, RUN, 4)
    assert set(view.live) == {0, 1} and view.abandoned == {3}  # shard 2 was never trained
    assert choose_shard(view, 4, IDS[6]) == 3
    assert choose_shard(ClaimView(view.live, frozenset()), 4, IDS[6]) in (2, 3)
    full = view_of({i: {"s": n % 2, "since": 1.0, "run": RUN} for n, i in enumerate(IDS[:4])}, {}, RUN, 2)
    assert choose_shard(full, 2, IDS[6]) in (0, 1)  # more nodes than shards: they share


def test_only_the_later_claimant_moves_and_only_to_a_freer_shard() -> None:
    view = ClaimView({0: [(1.0, IDS[0]), (1.0, IDS[1])]}, frozenset())
    assert not should_move(view, 0, 1.0, IDS[0], 2) and should_move(view, 0, 1.0, IDS[1], 2)
    assert not should_move(view, 0, 1.0, IDS[1], 1)  # nowhere freer to go
    assert ShardClaim.from_value(IDS[0], {"s": -1, "since": 1.0, "run": RUN}) is None


class SharedDHT:
    """The claims of nodes in one process, each seeing the others' a little late (as over a network)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {}

    def node(self, node_id: str) -> Any:
        shared = self

        class NodeDHT:
            def peer_count(self) -> int:
                return 1

            async def get(self, key: str) -> dict[str, Any]:
                await asyncio.sleep(0.01)
                entries = shared.values.get(key, {})
                return {n: SimpleNamespace(value=v) for n, v in entries.items()}

            async def publish(self, key: str, value: dict[str, Any], ttl_s: float) -> bool:
                await asyncio.sleep(0.02)
                shared.values.setdefault(key, {})[node_id] = value
                return True

        return NodeDHT()


def claims_of(dht: SharedDHT, tmp_path: Path, node_id: str, num_shards: int) -> ShardClaims:
    run = SimpleNamespace(node_id=node_id, run_digest=RUN)
    return ShardClaims(dht.node(node_id), "run", run, num_shards, tmp_path / node_id, 600.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("count", [4, 8])
def test_nodes_starting_together_never_share_while_shards_are_free(tmp_path, monkeypatch, count) -> None:
    monkeypatch.setattr(shards, "SETTLE_S", 0.3)
    monkeypatch.setattr(shards, "POLL_S", 0.05)
    dht = SharedDHT()
    for node_id in IDS[:count]:
        (tmp_path / node_id).mkdir()

    async def start_all() -> list[int]:
        stop = threading.Event()
        return await asyncio.gather(*(claims_of(dht, tmp_path, n, 8).claim(stop) for n in IDS[:count]))

    chosen = asyncio.run(start_all())
    assert sorted(set(chosen)) == sorted(chosen), chosen
    again = asyncio.run(claims_of(dht, tmp_path, IDS[0], 8).claim(threading.Event()))
    assert again == chosen[0]  # kept in the data dir across a restart


def cursor(position: int, shard: int = 2) -> dict[str, int]:
    return {"shard": shard, "epoch": 0, "position": position}


def departed_and_taker(tmp_path: Path, taker_starts: int) -> dict[str, list[dict]]:
    """The departed node trains rounds 0–1 of shard 2 and dies in round 2 (no average holds it); the
    taker claims shard 2 and starts at `taker_starts`."""
    departed, taker = Ledger(tmp_path / "d", IDS[0]), Ledger(tmp_path / "t", IDS[1])
    departed.adopt(cursor(0), "fresh", 0)
    for step in range(2):
        departed.round(step, cursor(40 * step), cursor(40 * step + 40))
        departed.settle(step, "applied", 2, "d", group=(IDS[0], IDS[2]), included=(IDS[0], IDS[2]))
    departed.round(2, cursor(80), cursor(120))
    taker.adopt(cursor(taker_starts), "takeover", 3)
    taker.round(3, cursor(taker_starts), cursor(taker_starts + 40))
    taker.settle(3, "applied", 2, "d", group=(IDS[1], IDS[2]), included=(IDS[1], IDS[2]))
    return {IDS[0]: read_ledger(tmp_path / "d"), IDS[1]: read_ledger(tmp_path / "t")}


def test_a_takeover_at_the_committed_cursor_trains_every_window_once(tmp_path: Path) -> None:
    windows, errors = shard_windows(departed_and_taker(tmp_path, taker_starts=80))
    assert errors == []
    assert [(w.start[2], w.end[2], w.node_id) for w in windows[2]] == [
        (0, 40, IDS[0]),
        (40, 80, IDS[0]),
        (80, 120, IDS[1]),
    ]


def test_a_takeover_from_the_start_or_past_the_cursor_is_found(tmp_path: Path) -> None:
    _, twice = shard_windows(departed_and_taker(tmp_path / "a", taker_starts=0))
    assert len(twice) == 1 and "trained twice" in twice[0], twice
    _, gap = shard_windows(departed_and_taker(tmp_path / "b", taker_starts=120))
    assert len(gap) == 1 and "gap" in gap[0] and "skipped" in gap[0], gap
