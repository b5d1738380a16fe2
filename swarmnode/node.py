"""The daemon: wires identity, data, training, snapshots and services, then runs rounds until told to stop.

Training compute runs on a worker thread (`asyncio.to_thread`); the event loop owns all network I/O and
never waits on a training step. SIGTERM/SIGINT end the inner phase after the current step, write a final
snapshot and leave cleanly. Once its services listen, a node writes DATA_DIR/node.json (node id, ports,
pid) so scripts and tests learn the ports it picked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server

from swarmnode import clock, faults, rpc, rpc_client, rpc_server
from swarmnode.announcements import ANNOUNCE_TTL_S, Announcement, snapshots_key
from swarmnode.averaging import propose_group
from swarmnode.checkpointer import CheckpointerConfig, SpeculativeCheckpointer
from swarmnode.config import ConfigError, NodeConfig
from swarmnode.data import ShardLoader, load_corpus, shard_for_node
from swarmnode.dht import DHTConfig, SwarmDHT
from swarmnode.diloco import DilocoConfig
from swarmnode.identity import Identity
from swarmnode.ledger import Ledger
from swarmnode.matchmaking import Matchmaker, Offer
from swarmnode.metrics import Metrics
from swarmnode.model import configure_determinism, count_parameters, preset, select_device
from swarmnode.progress import ProgressReporter, ProgressSample
from swarmnode.recovery import Receipt, Recovery, append_receipt
from swarmnode.reducer import AveragingServicer
from swarmnode.rounds import RoundResult, SwarmRounds
from swarmnode.security import Security
from swarmnode.snapshot import SnapshotInfo, sha256_file
from swarmnode.training import RunIdentity, TrainingRun, run_digest
from swarmnode.wire import GroupSpec

logger = logging.getLogger(__name__)

JOIN_WAIT_S = 15.0
"""How long a starting node waits for its --peers to answer before it recovers without them."""


@dataclass
class Ports:
    grpc: int = 0
    dht: int = 0
    metrics: int = 0


class Node:
    """One swarm member. `run()` returns the process exit code."""

    def __init__(
        self, cfg: NodeConfig, metrics: Metrics | None = None, progress: ProgressReporter | None = None
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.progress = progress
        self.ports = Ports()
        self.started_at = time.time()
        self.phase = "starting"
        self._stop = threading.Event()
        self._pending_receipt: Receipt | None = None
        self._repair_from: tuple[Offer, ...] = ()
        self.last_round: RoundResult | None = None
        self.repairs = 0
        self._ignored_runs: set[str] = set()
        self._announce_task: asyncio.Task[None] | None = None

    # ----- building -----

    def build(self) -> None:
        """Everything that can fail on bad input, before any socket opens (ValueError: exit 2)."""
        cfg = self.cfg
        self.identity = Identity.load_or_create(cfg.identity_path)
        self.node_id = self.identity.node_id_hex
        corpus = load_corpus(cfg.data)
        model_cfg = preset(cfg.model, corpus.vocab_size)
        if cfg.seq_len > model_cfg.context:
            raise ConfigError(
                f"--seq-len: at most the {cfg.model} preset's context {model_cfg.context}, got {cfg.seq_len}"
            )
        device = select_device(cfg.device)
        configure_determinism(device, cfg.threads)
        shard = cfg.shard if cfg.shard is not None else shard_for_node(self.identity.node_id, cfg.num_shards)
        loader = ShardLoader(corpus, shard, cfg.num_shards, cfg.batch_size, cfg.seq_len, cfg.seed)
        diloco = DilocoConfig(inner_lr=cfg.inner_lr, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum)
        digest = run_digest(
            cfg.model, model_cfg, cfg.seq_len, cfg.num_shards, cfg.seed, diloco, corpus.digest
        )
        identity = RunIdentity(cfg.run_id, self.node_id, digest, corpus.digest, cfg.model)
        self.security = Security.from_files(cfg.swarm_token, cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        rpc.configure_client(self.security)
        self.dht_run = self.security.dht_namespace(cfg.run_id)  # the run's name in DHT keys
        self.run_state = TrainingRun(
            model_cfg, diloco, loader, corpus, identity, cfg.seed, device, self.metrics
        )
        self.ledger = Ledger(cfg.data_dir, self.node_id)
        self.checkpointer = SpeculativeCheckpointer(
            CheckpointerConfig(
                cfg.snapshot_dir, cfg.keep_hot, cfg.keep_cold, cfg.layout, cfg.hot_level, cfg.cold_level
            ),
            self.metrics,
            on_written=self._on_snapshot_written,
        )
        self.metrics.track_snapshot_age(self.checkpointer.newest_created_at, clock.now)
        logger.info(
            "node %s: run %s, model %s (%d params, state %.1f MB) on %s, corpus %s (%d tokens, "
            "sha256 %s…), shard %d/%d",
            self.node_id[:12],
            cfg.run_id,
            cfg.model,
            count_parameters(self.run_state.model),
            self.run_state.state_bytes() / 1e6,
            device,
            corpus.description,
            len(corpus.tokens),
            corpus.digest[:12],
            shard,
            cfg.num_shards,
        )

    # ----- running -----

    async def run(self) -> int:
        """Serve, recover, train rounds until done or stopped; `build()` must have run."""
        self._install_signal_handlers()
        self.loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as services:
            await self._start_services(services)
            self._write_node_file()
            await self._wait_for_peers()
            await self._recover()
            reporter = asyncio.create_task(self._report_progress())
            try:
                await self._round_loop()
            finally:
                reporter.cancel()
            await asyncio.to_thread(self._final_snapshot)
            if self._pending_receipt is not None:  # stopped before a single inner step
                self._write_receipt(self._pending_receipt)
            await self._flush_announcement()
            self.phase = "stopping"
        logger.info(
            "node %s stopped at outer step %d, inner step %d",
            self.node_id[:12],
            self.run_state.progress.outer_step,
            self.run_state.progress.inner_step,
        )
        return 0

    def request_stop(self) -> None:
        if not self._stop.is_set():
            logger.info("stop requested: finishing the current step")
        self._stop.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def _finished(self) -> bool:
        limit = self.cfg.max_outer_steps
        return self._stop.is_set() or (limit is not None and self.run_state.progress.outer_step >= limit)

    async def _round_loop(self) -> None:
        while not self._finished():
            # A repaired node adopted a round the swarm is already training: it joins that round's outer
            # step at once, with no work of its own (weight 0), rather than trail a round behind forever.
            if not await self._catch_up():
                self.phase = "inner"
                await asyncio.to_thread(self._inner_phase)
            if self._stop.is_set():
                break
            self.phase = "outer"
            await self._outer_step()

    def _inner_phase(self) -> None:
        deadline = time.monotonic() + self.cfg.inner_seconds if self.cfg.inner_seconds else None
        self.run_state.inner_phase(self.cfg.inner_steps, deadline, self._stop, self._after_inner_step)

    def _after_inner_step(self) -> None:
        p = self.run_state.progress
        if self._pending_receipt is not None:
            self._pending_receipt.first_loss_after = p.last_loss
            self._write_receipt(self._pending_receipt)
            self._pending_receipt = None
        if p.inner_step % self.cfg.hot_every == 0:
            self._snapshot("hot")

    async def _outer_step(self) -> None:
        run = self.run_state
        p = run.progress
        round_step, delta = p.outer_step, run.trainer.pseudo_gradient()
        assert p.committed_cursor is not None
        self.ledger.round(round_step, p.committed_cursor, run.loader.state_dict())
        result = await self.rounds.average(
            delta,
            float(p.round_tokens),
            round_step,
            run.trainer.global_digest(),
            run.loader.state_dict(),
            await self._expected_peers(),
            in_swarm=len(p.swarm_cursors.keys() - {self.node_id}) > 0,
        )
        self.last_round = result
        if result.held:
            self.ledger.settle(round_step, "held", 1, None)
            return
        if result.averaged is None:
            self.ledger.settle(round_step, "dropped", len(result.group), None)
            self._repair_from = result.repair_from
            return
        await asyncio.to_thread(run.apply_outer, result.averaged, result.cursors, result.info())
        if faults.hit("global_params", p.outer_step) is not None:  # test-only: make this node go astray
            run.trainer.global_flat[:16] += 1e-3
            run.trainer.global_changed()
        status = "carried" if not result.averaged.covered else "applied" if len(result.group) > 1 else "solo"
        self.ledger.settle(round_step, status, len(result.group), run.trainer.global_digest())
        if p.outer_step % self.cfg.cold_every == 0:
            await asyncio.to_thread(self._snapshot, "cold")

    async def _expected_peers(self) -> frozenset[str] | None:
        """Peers that announced this round or the last are expected to offer (matchmaking may end as
        soon as they have); None when the routing table is empty (nobody to wait for)."""
        if not self.dht.peer_count():
            return None
        outer_step = self.run_state.progress.outer_step
        return frozenset(
            a.node_id for a in await self._peer_announcements() if a.outer_step >= outer_step - 1
        )

    # ----- catching up with the swarm -----

    async def _catch_up(self) -> bool:
        """Before an inner phase: if this node's global params went astray (a digest in the minority) or
        its outer step is behind the swarm's, adopt an up-to-date member's snapshot (a repair)."""
        p = self.run_state.progress
        agreeing = {o.node_id for o in self._repair_from}
        self._repair_from = ()
        peers = await self._peer_announcements()
        ahead = [a for a in peers if a.outer_step > p.outer_step]
        if agreeing and not ahead:  # the majority may still be finishing the round's outer step
            ahead = await self._wait_for_peers_ahead(p.outer_step) or [
                a for a in peers if a.node_id in agreeing
            ]
        if not ahead:
            return False
        why = (
            "its global params disagreed with the swarm's"
            if agreeing
            else (f"it was behind the swarm (outer step {p.outer_step} < {max(a.outer_step for a in ahead)})")
        )
        self.phase = "repairing"
        ahead.sort(key=lambda a: a.freshness, reverse=True)
        if await self.recovery.repair(ahead) is None:
            return False
        self.repairs += 1
        self.ledger.adopt(self.run_state.loader.state_dict(), "repair", p.outer_step)
        self.metrics.repairs.inc()
        logger.warning("repaired: %s; now at outer step %d with the swarm's global params", why, p.outer_step)
        await asyncio.to_thread(self._snapshot, "hot")
        return True

    async def _wait_for_peers_ahead(self, outer_step: int) -> list[Announcement]:
        deadline = time.monotonic() + self.cfg.matchmaking_timeout_s + self.cfg.allreduce_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            ahead = [a for a in await self._peer_announcements() if a.outer_step > outer_step]
            if ahead:
                return ahead
            await asyncio.sleep(0.5)
        return []

    def _snapshot(self, kind: str) -> bool:
        run = self.run_state
        return self.checkpointer.snapshot(run.state_tensors(), run.state_metadata(), kind)

    def _final_snapshot(self) -> None:
        p = self.run_state.progress
        self.checkpointer.wait_idle()
        newest = self.checkpointer.find(None)
        if newest is not None and (newest.outer_step, newest.inner_step) == (p.outer_step, p.inner_step):
            return
        self._snapshot("hot")
        self.checkpointer.wait_idle()

    def _on_snapshot_written(self, info: SnapshotInfo) -> None:
        """Called on the writer thread after each snapshot: announce it from the event loop."""
        self.loop.call_soon_threadsafe(self._schedule_announcement, info)

    def _schedule_announcement(self, info: SnapshotInfo) -> None:
        previous = self._announce_task
        self._announce_task = asyncio.create_task(self._announce(info, previous))

    async def _announce(self, info: SnapshotInfo, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and not previous.done():
            previous.cancel()  # a newer snapshot supersedes it
            with contextlib.suppress(asyncio.CancelledError):
                await previous
        announcement = Announcement(
            self.node_id,
            f"{self.cfg.advertised_host}:{self.ports.grpc}",
            info.snapshot_id,
            info.size_bytes,
            info.outer_step,
            info.inner_step,
            info.kind,
            info.created_at,
            self.run_state.identity.run_digest,
            info.cursor,
        )
        try:
            await self.dht.publish(snapshots_key(self.dht_run), announcement.to_value(), ANNOUNCE_TTL_S)
        except ValueError as exc:  # a record over the size cap is a bug, but must not stop training
            logger.error("announcement of %s refused locally: %s", info.snapshot_id[:12], exc)
        except (OSError, AttributeError, RuntimeError) as exc:  # the DHT socket closed under a late task
            logger.debug("announcement of %s not sent: %s", info.snapshot_id[:12], exc)

    async def _flush_announcement(self) -> None:
        task = self._announce_task
        if task is not None and not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=5.0)

    # ----- recovery -----

    async def _wait_for_peers(self) -> None:
        wanted = self.cfg.wait_peers
        if wanted and self.dht.peer_count() < wanted:
            self.phase = "waiting for peers"
            logger.info("waiting for %d peers (--wait-peers) before training", wanted)
        while self.dht.peer_count() < wanted and not self._stop.is_set():
            await asyncio.sleep(0.2)

    async def _recover(self) -> None:
        self.phase = "recovering"
        started = time.perf_counter()
        if self.cfg.peers and not await self.dht.wait_for_peers(JOIN_WAIT_S):
            logger.warning(
                "no peer reachable after %.0f s: recovering from local snapshots only", JOIN_WAIT_S
            )
        peers, own = await self._lookup_announcements()
        lookup_s = time.perf_counter() - started
        self.recovery = recovery = Recovery(
            self.run_state,
            self.cfg.snapshot_dir,
            self._fetch_for_recovery,
            lambda reason: self.metrics.fetch_failures.labels(reason).inc(),
        )
        receipt = await recovery.recover(peers, own, lookup_s)
        receipt.seconds = time.perf_counter() - started
        verified = recovery.verified
        await asyncio.to_thread(
            self.checkpointer.adopt_existing, lambda path, sid: sid in verified or sha256_file(path) == sid
        )
        self._log_recovery(receipt)
        progress = self.run_state.progress
        assert progress.committed_cursor is not None
        self.ledger.adopt(progress.committed_cursor, receipt.source, progress.outer_step)
        self.metrics.recoveries.labels(receipt.source).inc()
        self.metrics.recovery_seconds.set(receipt.seconds)
        self._pending_receipt = receipt
        if receipt.source == "peer":  # keep the adopted state on local disk at once
            await asyncio.to_thread(self._snapshot, "hot")

    def _log_recovery(self, receipt: Receipt) -> None:
        if receipt.source == "fresh":
            logger.info(
                "no snapshot to resume from: starting at outer step 0 with %s cursor %s",
                receipt.cursor_source,
                receipt.cursor,
            )
        else:
            logger.info(
                "recovered from %s snapshot %s%s at outer step %d, inner step %d in %.2f s "
                "(cursor %s from %s)",
                receipt.source,
                (receipt.snapshot_id or "")[:12],
                f" of {receipt.peer}" if receipt.peer else "",
                receipt.outer_step,
                receipt.inner_step,
                receipt.seconds,
                receipt.cursor,
                receipt.cursor_source,
            )

    async def _lookup_announcements(self) -> tuple[list[Announcement], Announcement | None]:
        """Peers' announcements of this run, and this node's own last one (for its cursor)."""
        entries = await self.dht.get(snapshots_key(self.dht_run))
        peers: list[Announcement] = []
        own = None
        for node_id, entry in entries.items():
            announcement = Announcement.from_value(node_id, entry.value)
            if announcement is None:
                self._warn_once(node_id, "ignoring a malformed announcement from %s", node_id[:12])
            elif node_id == self.node_id:
                own = announcement
            elif self._same_run(announcement):
                peers.append(announcement)
        return peers, own

    async def _peer_announcements(self) -> list[Announcement]:
        return (await self._lookup_announcements())[0]

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._ignored_runs:
            self._ignored_runs.add(key)
            logger.warning(message, *args)

    def _same_run(self, announcement: Announcement) -> bool:
        if announcement.run_digest == self.run_state.identity.run_digest:
            return True
        self._warn_once(
            announcement.node_id,
            "peer %s (%s) runs another configuration (run digest %s… vs ours %s…): not using it",
            announcement.node_id[:12],
            announcement.address,
            announcement.run_digest[:12],
            self.run_state.identity.run_digest[:12],
        )
        return False

    async def _fetch_for_recovery(self, peer: Announcement, target: Path) -> str:
        """Fetch the announced snapshot, or the peer's newest if it has rotated the announced one out
        (a node keeps training after it announces); returns the id of what was fetched and verified."""
        limit = int(self.run_state.state_bytes() * 1.25) + (4 << 20)
        fetch = functools.partial(
            rpc_client.fetch_snapshot, peer.address, target, max_bytes=limit, on_bytes=self._count_fetched
        )
        try:
            result = await fetch(snapshot_id=peer.snapshot_id, expected_sha256=peer.snapshot_id)
        except rpc.PeerUnavailable as exc:
            if exc.reason != "refused":
                raise
            result = await fetch()  # the newest it serves; still verified against its own id
        return result.snapshot_id

    def _write_receipt(self, receipt: Receipt) -> None:
        append_receipt(self.cfg.data_dir, receipt)
        logger.info("restart receipt: %s", receipt.to_json())

    def _count_fetched(self, size: int) -> None:
        self.metrics.fetch_bytes.inc(size)
        faults.hit("fetch_chunk")

    # ----- services -----

    async def _start_services(self, services: contextlib.AsyncExitStack) -> None:
        """Metrics, gRPC and the DHT; each is stopped by `services` on every way out."""
        cfg = self.cfg
        metrics_server, _thread = start_http_server(
            cfg.metrics_port, addr=cfg.host, registry=self.metrics.registry
        )
        services.callback(metrics_server.shutdown)
        self.ports.metrics = metrics_server.server_port
        services.push_async_callback(asyncio.to_thread, self.checkpointer.close)
        self.averaging = AveragingServicer(
            self.node_id,
            on_proposal=self._on_proposal,
            on_rejected=lambda reason: self.metrics.rpc_rejected.labels(reason).inc(),
        )
        self.rpc_server = await rpc_server.start_server(
            cfg.host,
            cfg.grpc_port,
            self.checkpointer,
            self.rpc_status,
            max_serving=cfg.max_serving,
            on_served=self._on_served,
            extra_servicers=[self.averaging.register],
            faults=_serve_faults(),
            security=self.security,
            on_rejected=lambda reason: self.metrics.rpc_rejected.labels(reason).inc(),
        )
        services.push_async_callback(self.rpc_server.stop, 1.0)
        self.ports.grpc = self.rpc_server.port
        self.dht = SwarmDHT(
            self.identity,
            DHTConfig(host=cfg.host, port=cfg.dht_port),
            on_reject=lambda reason: self.metrics.dht_rejected.labels(reason).inc(),
        )
        await self.dht.start(cfg.peers)
        services.push_async_callback(self.dht.stop)
        self.ports.dht = self.dht.port
        self.metrics.dht_peers.set_function(self.dht.peer_count)
        self.matchmaker = Matchmaker(
            self.dht,
            self.node_id,
            f"{cfg.advertised_host}:{self.ports.grpc}",
            self.dht_run,
            self.run_state.identity.run_digest,
            cfg.wire_dtype,
            cfg.matchmaking_timeout_s,
            cfg.allreduce_timeout_s,
            propose_group,
        )
        self.rounds = SwarmRounds(
            self.matchmaker, self.averaging, self.node_id, cfg.min_coverage, self.metrics
        )
        logger.info(
            "listening on %s: gRPC %d, DHT (UDP) %d, metrics http://%s:%d/metrics; advertising %s",
            cfg.host,
            self.ports.grpc,
            self.ports.dht,
            cfg.host,
            self.ports.metrics,
            cfg.advertised_host,
        )

    async def _on_proposal(self, spec: GroupSpec) -> bool:
        matchmaker = getattr(self, "matchmaker", None)
        return matchmaker is not None and await matchmaker.on_proposal(spec)

    def _on_served(self, snapshot_id: str) -> None:
        self.metrics.snapshots_served.inc()
        info = self.checkpointer.find(snapshot_id)
        if info is not None:
            self.metrics.served_bytes.inc(info.size_bytes)

    def _write_node_file(self) -> None:
        info = {
            "node_id": self.node_id,
            "pid": os.getpid(),
            "run_id": self.cfg.run_id,
            "host": self.cfg.advertised_host,
            "grpc_port": self.ports.grpc,
            "dht_port": self.ports.dht,
            "metrics_port": self.ports.metrics,
            "run_digest": self.run_state.identity.run_digest,
            "shard": self.run_state.loader.shard,
        }
        path = self.cfg.data_dir / "node.json"
        tmp = path.with_name("node.json.tmp")
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, path)

    async def _report_progress(self) -> None:
        reporter = self.progress
        if reporter is None:
            return
        interval = reporter.interval_s or self.cfg.progress_interval_s
        try:
            while True:
                await asyncio.sleep(interval)
                reporter.report(self.progress_sample())
        finally:
            reporter.finish()

    def progress_sample(self) -> ProgressSample:
        p = self.run_state.progress
        created = self.checkpointer.newest_created_at()
        return ProgressSample(
            round=p.outer_step,
            step=p.round_step,
            steps_per_round=self.cfg.inner_steps,
            loss=p.last_loss,
            heldout_loss=p.heldout_loss,
            tokens_per_s=round(self.run_state.tokens_per_second, 1),
            peers=self.dht.peer_count(),
            snapshot_age_s=None if created is None else clock.now() - created,
            phase=self.phase,
        )

    def rpc_status(self) -> rpc.NodeStatus:
        run = self.run_state
        p = run.progress
        cursor = run.loader.state_dict()
        return rpc.NodeStatus(
            node_id=self.node_id,
            run_id=self.cfg.run_id,
            phase=self.phase,
            uptime_s=time.time() - self.started_at,
            outer_step=p.outer_step,
            inner_step=p.inner_step,
            last_loss=p.last_loss,
            tokens_per_s=run.tokens_per_second,
            cursor=rpc.CursorStatus(cursor["shard"], cursor["epoch"], cursor["position"]),
            peers=self.dht.peer_count(),
            global_digest=run.trainer.global_digest(),
            **self._round_status(),
        )

    def _round_status(self) -> dict[str, Any]:
        last = self.last_round
        if last is None:
            return {"repairs": self.repairs}
        return {
            "last_group": last.group,
            "last_coverage": last.coverage,
            "last_allreduce_s": last.seconds,
            "repairs": self.repairs,
        }


def _serve_faults() -> rpc.ServeFaults | None:
    """Test-only misbehaviour of the snapshot server, from SWARMNODE_FAULTS (inert when unset)."""
    if not faults.armed("serve_chunk") and not faults.armed("serve_stream"):
        return None

    def chunk_filter(offset: int, data: bytes) -> bytes:
        fault = faults.hit("serve_chunk")
        if fault is not None and fault.action == "corrupt" and data:
            return bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    truncate = faults.find("truncate", "serve_stream")
    return rpc.ServeFaults(
        chunk_filter=chunk_filter, cut_at_offset=int(truncate.arg or 1 << 20) if truncate else None
    )


def _sha_matches(path: Path, snapshot_id: str) -> bool:
    return sha256_file(path) == snapshot_id
