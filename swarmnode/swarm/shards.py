"""Which shard a node trains: claimed in the DHT, not hashed from its id.

Under `swarmnode/<run>/shards` each node keeps one signed entry (the DHT layer proves who wrote it):
the shard it trains and when it first claimed it. The entry is re-announced while the node runs and
lapses `--shard-claim-ttl` seconds (default 600) after it stops: a claim that is present is a live one.

A node that starts without a shard of its own (none kept in DATA_DIR/shard.json for this run, no
`--shard`) claims one of the shards with the fewest live claimants, preferring a shard some departed
node had trained (its snapshot announcement still names a cursor there) so that its batches go on
being trained, then an order of its own (a hash of its id) so that nodes starting together spread out.
It publishes its claim and watches the claims for `SETTLE_S`: when another live claimant of its shard
claimed first (earlier, then lower id) and a shard with fewer claimants exists, it moves there. Two live
nodes share a shard only when there are more nodes than shards. The shard is kept in DATA_DIR/shard.json,
so a restart trains the same shard; `--shard` pins one (and is claimed like any other).

Where a taken-over shard resumes is recovery's business (swarm/recovery/restore.py): the furthest committed
cursor on the shard in the adopted lineage (every snapshot carries its round's members' cursors), so
the departed node's batches are neither lost nor trained twice. A DHT value is only a claim: each is
decoded field by field (`ShardClaim.from_value`), and one of another run digest is ignored.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from swarmnode.core.training import RunIdentity
from swarmnode.net.dht import SwarmDHT
from swarmnode.net.dht_records import decode_typed_value
from swarmnode.swarm.announcements import Announcement, snapshots_key
from swarmnode.util import clock
from swarmnode.util.validate import is_node_id_hex, is_sha256_hex

logger = logging.getLogger(__name__)

SHARD_FILE = "shard.json"
"""DATA_DIR/shard.json: the shard this node trains in a run (kept across restarts)."""
SETTLE_S = 1.5
"""How long a new claim is watched for an earlier claimant of the same shard (none when this node
knows no peer yet: it starts the swarm)."""
POLL_S = 0.25
MAX_MOVES = 16


def shards_key(run_id: str) -> str:
    return f"swarmnode/{run_id}/shards"


class ShardClaim(msgspec.Struct, frozen=True):
    """One node's claim as it publishes it (the node id is the entry's signed publisher)."""

    node_id: str = msgspec.field(name="node")
    shard: int = msgspec.field(name="s")
    since: float = msgspec.field(name="since")
    run_digest: str = msgspec.field(name="run")

    def __post_init__(self) -> None:
        if self.shard < 0 or self.since < 0:
            raise ValueError("negative shard or time")
        if not is_sha256_hex(self.run_digest):
            raise ValueError("the run digest must be a sha256 hex digest")
        if not is_node_id_hex(self.node_id):
            raise ValueError("not a node id")

    def to_value(self) -> dict[str, Any]:
        """The DHT value (the node id travels as the entry's publisher, not in it)."""
        value: dict[str, Any] = msgspec.to_builtins(self)
        del value["node"]
        value["since"] = round(self.since, 3)
        return value

    @classmethod
    def from_value(cls, node_id: str, value: Any) -> ShardClaim | None:
        return decode_typed_value(cls, node_id, value)


@dataclass(frozen=True)
class ClaimView:
    """The run's live claims (shard -> [(since, node id)]) and the shards departed nodes trained."""

    live: Mapping[int, list[tuple[float, str]]]
    abandoned: frozenset[int]

    def claimants(self, shard: int, besides: str) -> list[tuple[float, str]]:
        return [claim for claim in self.live.get(shard, []) if claim[1] != besides]


def view_of(
    claims: Mapping[str, Any], announcements: Mapping[str, Any], run_digest: str, num_shards: int
) -> ClaimView:
    """The claims and announcements of this run (values of other runs or malformed ones left out)."""
    live: dict[int, list[tuple[float, str]]] = {}
    for node_id, value in claims.items():
        claim = ShardClaim.from_value(node_id, value)
        if claim is not None and claim.run_digest == run_digest and claim.shard < num_shards:
            live.setdefault(claim.shard, []).append((claim.since, node_id))
    trained: set[int] = set()
    for node_id, value in announcements.items():
        announced = Announcement.from_value(node_id, value)
        cursor = announced.cursor if announced is not None and announced.run_digest == run_digest else None
        if cursor is not None and (cursor["epoch"], cursor["position"]) != (0, 0):
            trained.add(cursor["shard"])
    abandoned = frozenset(s for s in trained if s < num_shards and s not in live)
    return ClaimView({s: sorted(c) for s, c in live.items()}, abandoned)


def choose_shard(view: ClaimView, num_shards: int, node_id: str) -> int:
    """One of the shards with the fewest live claimants besides this node: a departed node's first,
    then in this node's own order."""
    counts = [len(view.claimants(shard, node_id)) for shard in range(num_shards)]
    fewest = [shard for shard in range(num_shards) if counts[shard] == min(counts)]
    return min(fewest, key=lambda shard: (shard not in view.abandoned, _preference(node_id, shard)))


def _preference(node_id: str, shard: int) -> bytes:
    return hashlib.sha256(f"swarmnode-shard\0{node_id}\0{shard}".encode()).digest()


def should_move(view: ClaimView, shard: int, since: float, node_id: str, num_shards: int) -> bool:
    """Whether this node should leave `shard`: a live claimant came first (earlier, then lower id) and
    some shard has fewer claimants than this one has besides this node."""
    others = view.claimants(shard, node_id)
    if not any((their_since, their_id) < (since, node_id) for their_since, their_id in others):
        return False
    return any(len(view.claimants(s, node_id)) < len(others) for s in range(num_shards) if s != shard)


@dataclass(frozen=True)
class KeptShard:
    shard: int
    since: float


class ShardClaims:
    """This node's claim: chosen (or kept, or pinned), published, and kept in the data dir."""

    def __init__(
        self,
        dht: SwarmDHT,
        dht_run: str,
        run: RunIdentity,
        num_shards: int,
        data_dir: Path,
        ttl_s: float,
        pinned: int | None = None,
    ) -> None:
        self.dht, self.run, self.num_shards, self.ttl_s = dht, run, num_shards, ttl_s
        self.key, self.announcements_key = shards_key(dht_run), snapshots_key(dht_run)
        self.path, self.pinned = data_dir / SHARD_FILE, pinned

    async def claim(self, stop: threading.Event) -> int:
        """The shard this node trains, claimed in the DHT (see the module notes)."""
        kept = self._kept()
        if self.pinned is not None:
            kept = KeptShard(self.pinned, kept.since if kept and kept.shard == self.pinned else _now())
        if kept is None:
            kept = await self._settle(stop)
        else:
            await self._publish(kept)
        self._keep(kept)
        logger.info("node %s trains shard %d of %d", self.run.node_id[:12], kept.shard, self.num_shards)
        return kept.shard

    async def view(self) -> ClaimView:
        claims, announced = await asyncio.gather(self.dht.get(self.key), self.dht.get(self.announcements_key))
        return view_of(
            {node: e.value for node, e in claims.items()},
            {node: e.value for node, e in announced.items()},
            self.run.run_digest,
            self.num_shards,
        )

    async def _settle(self, stop: threading.Event) -> KeptShard:
        """Choose, publish, and move while an earlier claimant shares the shard and a freer one exists."""
        mine = KeptShard(choose_shard(await self.view(), self.num_shards, self.run.node_id), _now())
        await self._publish(mine)
        moves, quiet_until = 0, time.monotonic() + (SETTLE_S if self.dht.peer_count() else 0.0)
        while time.monotonic() < quiet_until and not stop.is_set() and moves < MAX_MOVES:
            await asyncio.sleep(POLL_S)  # others' claims arrive over the network: a poll with a deadline
            view = await self.view()
            if should_move(view, mine.shard, mine.since, self.run.node_id, self.num_shards):
                mine = KeptShard(choose_shard(view, self.num_shards, self.run.node_id), _now())
                await self._publish(mine)
                moves, quiet_until = moves + 1, time.monotonic() + SETTLE_S
        return mine

    async def _publish(self, kept: KeptShard) -> None:
        claim = ShardClaim(self.run.node_id, kept.shard, kept.since, self.run.run_digest)
        await self.dht.publish(self.key, claim.to_value(), self.ttl_s)

    def _kept(self) -> KeptShard | None:
        """The shard this node trained in this run before (none for another run or shard count)."""
        try:
            kept = json.loads(self.path.read_text())
            if kept["run_digest"] == self.run.run_digest and 0 <= int(kept["shard"]) < self.num_shards:
                return KeptShard(int(kept["shard"]), float(kept["since"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def _keep(self, kept: KeptShard) -> None:
        record = {"run_digest": self.run.run_digest, "shard": kept.shard, "since": kept.since}
        try:
            partial = self.path.with_suffix(".json.partial")
            partial.write_text(json.dumps(record) + "\n")
            partial.replace(self.path)
        except OSError as exc:  # a full disk: the claim stands; a restart chooses again
            logger.error("shard choice not kept in %s: %s", self.path, exc)


def _now() -> float:
    """A claim's time as it travels (ms): a node compares its own claim as its peers see it."""
    return round(clock.now(), 3)
