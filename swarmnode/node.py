"""The daemon: wires identity, data, training, snapshots and services, then runs rounds until told to stop.

Training compute runs on a worker thread (`asyncio.to_thread`); the event loop owns all network I/O and
never waits on a training step. SIGTERM/SIGINT end the inner phase after the current step, write a final
snapshot and leave cleanly. The pieces it runs: services.py (metrics, gRPC, DHT, node.json, status),
joining.py (the restore at start), membership.py (announcements, expected peers, when to repair).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmnode import clock, faults, rpc
from swarmnode.checkpointer import CheckpointerConfig, SnapshotOwner, SpeculativeCheckpointer
from swarmnode.config import ConfigError, NodeConfig
from swarmnode.data import Corpus, ShardLoader, load_corpus, shard_for_node
from swarmnode.diloco import DilocoConfig
from swarmnode.identity import Identity
from swarmnode.joining import peer_fetcher, restore_at_start
from swarmnode.ledger import Ledger
from swarmnode.matchmaking import Offer
from swarmnode.membership import DuplicateIdentity, Membership
from swarmnode.metrics import Metrics
from swarmnode.model import ModelConfig, configure_determinism, count_parameters, preset, select_device
from swarmnode.progress import Phase, ProgressReporter, ProgressSample
from swarmnode.recovery import Receipt, Recovery, append_receipt
from swarmnode.rounds import RoundResult
from swarmnode.security import Security
from swarmnode.services import node_status, progress_sample, report_progress, start_services, write_node_file
from swarmnode.snapshot import SnapshotInfo
from swarmnode.training import RunIdentity, TrainingRun, run_digest

logger = logging.getLogger(__name__)

REJOIN_POLL_S = 0.25
"""How often a repaired node checks whether the swarm closed the round it rejoined."""
LOCK_FILE = "node.lock"
"""DATA_DIR/node.lock: the running node's pid, under an exclusive flock while it runs."""


def phase_before_round(last_round: RoundResult | None, missed: bool, repair_pending: bool) -> Phase:
    """What a node does from the end of one round to its next inner phase: after a missed round (or a
    lost digest vote) the catch-up waits for the swarm's next step; after a round without a group it
    holds its outer step until the next try; otherwise it trains."""
    if missed or repair_pending:
        return Phase.WAITING_FOR_SWARM
    if last_round is not None and last_round.held:
        return Phase.HOLDING
    return Phase.INNER


# ----- start-up checks -----


@dataclass(frozen=True)
class StartChecks:
    """What the start-up checks loaded on the way; `Node.build` goes on from it."""

    corpus: Corpus
    model_cfg: ModelConfig
    device: torch.device
    security: Security


def preflight(cfg: NodeConfig) -> StartChecks:
    """Every check a start makes before anything listens, with no side effect (`--dry-run` runs it
    too): the data dir, the identity file, the listening host, the TLS files, the
    device, the corpus, the preset's context and the shard loader. Raises ValueError (ConfigError or
    the loader's own, each one line naming the flag and the value) for the first that fails."""
    _check_writable_dir(cfg.data_dir, "--data-dir")
    _check_writable_dir(cfg.snapshot_dir, "--data-dir", cfg.data_dir)
    _check_identity_file(cfg)
    _check_bindable(cfg.host)
    security = Security.from_files(cfg.swarm_token, cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    device = select_device(cfg.device)
    try:
        corpus = load_corpus(cfg.data)
    except OSError as exc:
        raise ConfigError(f"--data: cannot read it ({exc.strerror}), got {cfg.data!r}") from None
    model_cfg = preset(cfg.model, corpus.vocab_size)
    if cfg.seq_len > model_cfg.context:
        raise ConfigError(
            f"--seq-len: at most the {cfg.model} preset's context {model_cfg.context}, got {cfg.seq_len}"
        )
    # Every shard has the same length, so the node's own (not known before its key exists) builds too.
    ShardLoader(corpus, cfg.shard or 0, cfg.num_shards, cfg.batch_size, cfg.seq_len, cfg.seed)
    return StartChecks(corpus, model_cfg, device, security)


def _check_writable_dir(directory: Path, flag: str, value: Path | None = None) -> None:
    """`directory` is one this process may write in, or may create (its nearest existing ancestor is
    writable); probed with a nameless temporary file, so nothing is left behind. `value`: what the
    flag gave, if not `directory` itself."""
    value = value or directory
    existing, missing = directory, False
    try:
        existing = directory.absolute()
        while not existing.exists():
            existing, missing = existing.parent, True
        if not existing.is_dir():
            raise ConfigError(f"{flag}: {str(existing)!r} is not a directory, got {str(value)!r}")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        where = repr(str(existing)) if missing or value != directory else "it"
        raise ConfigError(f"{flag}: cannot write in {where} ({exc.strerror}), got {str(value)!r}") from None


def _check_identity_file(cfg: NodeConfig) -> None:
    """The key file is a readable key, or can be created (it is created only by a real start)."""
    flag, path = ("--identity" if cfg.identity is not None else "--data-dir"), cfg.identity_path
    if not path.exists():
        _check_writable_dir(path.parent, flag, path)
        return
    try:
        Identity.load_or_create(path)  # the file exists: this only reads it
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read the key ({exc.strerror}), got {str(path)!r}") from None
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}, got {str(path)!r}") from None


def _resolve(flag: str, host: str, passive: bool = False) -> tuple[Any, ...]:
    """The first address `host` resolves to (family, type, proto, canonname, sockaddr)."""
    flags = socket.AI_PASSIVE if passive else 0
    try:
        return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=flags)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"{flag}: cannot resolve it ({exc.strerror}), got {host!r}") from None
    except UnicodeError:  # a label too long for IDNA
        raise ConfigError(f"{flag}: not a valid host name, got {host!r}") from None


def _check_bindable(host: str) -> None:
    """--host is an address of this machine: a socket binds to it (port 0, closed at once)."""
    family, kind, proto, _, address = _resolve("--host", host, passive=True)
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        raise ConfigError(f"--host: cannot listen on it ({exc.strerror}), got {host!r}") from None


def lock_data_dir(data_dir: Path) -> int:
    """Takes DATA_DIR/node.lock for this process's life (an exclusive flock, which the kernel drops
    when the process ends, however it ends) and writes the pid in it; returns the lock's descriptor,
    to be kept open. ConfigError naming the holder's pid while another process holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"--data-dir: in use by another swarmnode process (pid {holder}), got {str(data_dir)!r}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class Node:
    """One swarm member. `run()` returns the process exit code."""

    def __init__(
        self, cfg: NodeConfig, metrics: Metrics | None = None, progress: ProgressReporter | None = None
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.progress = progress
        self.started_at = time.time()
        self.phase = Phase.STARTING
        self._stop = threading.Event()
        self._pending_receipt: Receipt | None = None
        self._repair_from: tuple[Offer, ...] = ()
        self._missed_round = False
        self._open_round: int | None = None  # a round whose ledger range awaits its settle entry
        self.last_round: RoundResult | None = None
        self.repairs = 0
        self._duplicate: DuplicateIdentity | None = None

    # ----- building -----

    def build(self) -> None:
        """Everything that can fail on bad input, before any socket opens (ValueError: exit 2): the
        start-up checks, then the data dir's lock, then the pieces."""
        cfg = self.cfg
        checked = preflight(cfg)
        corpus, model_cfg, device = checked.corpus, checked.model_cfg, checked.device
        self._data_dir_lock = lock_data_dir(cfg.data_dir)
        self.identity = Identity.load_or_create(cfg.identity_path)
        self.node_id = self.identity.node_id_hex
        configure_determinism(device, cfg.threads)
        shard = cfg.shard if cfg.shard is not None else shard_for_node(self.identity.node_id, cfg.num_shards)
        loader = ShardLoader(corpus, shard, cfg.num_shards, cfg.batch_size, cfg.seq_len, cfg.seed)
        diloco = DilocoConfig(inner_lr=cfg.inner_lr, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum)
        digest = run_digest(
            cfg.model, model_cfg, cfg.seq_len, cfg.num_shards, cfg.seed, diloco, corpus.digest
        )
        identity = RunIdentity(cfg.run_id, self.node_id, digest, corpus.digest, cfg.model)
        self.security = checked.security
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
            owner=SnapshotOwner(self.node_id, digest, self.run_state.template()),
        )
        self.metrics.track_snapshot_age(self.checkpointer.newest_created_at, clock.now)
        self._log_built(corpus, device, shard)

    def _log_built(self, corpus: Corpus, device: torch.device, shard: int) -> None:
        cfg = self.cfg
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
        async with contextlib.AsyncExitStack() as stack:
            await self._start_services(stack)
            await self._wait_for_peers()
            await self._recover()
            reporter = asyncio.create_task(
                report_progress(self.progress, self.cfg.progress_interval_s, self.progress_sample)
            )
            try:
                await self._round_loop()
            finally:
                reporter.cancel()
            await asyncio.to_thread(self._final_snapshot)
            if self._pending_receipt is not None:  # stopped before a single inner step
                self._write_receipt(self._pending_receipt)
            await self.membership.flush()
            self.phase = Phase.STOPPING
        logger.info(
            "node %s stopped at outer step %d, inner step %d",
            self.node_id[:12],
            self.run_state.progress.outer_step,
            self.run_state.progress.inner_step,
        )
        if self._duplicate is not None:
            raise self._duplicate
        return 0

    async def _start_services(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.cfg
        services = await start_services(
            stack,
            cfg,
            self.identity,
            self.security,
            self.checkpointer,
            self.metrics,
            self.run_state.identity.run_digest,
            self.dht_run,
            self.rpc_status,
        )
        self.ports, self.dht, self.rounds = services.ports, services.dht, services.rounds
        ahead_wait_s = cfg.matchmaking_timeout_s + cfg.allreduce_timeout_s
        self.membership = Membership(
            self.dht,
            self.dht_run,
            self.run_state.identity,
            services.address,
            self._stop,
            ahead_wait_s,
            uptime_s=lambda: time.time() - self.started_at,
            on_duplicate=self._on_duplicate,
        )
        write_node_file(cfg, self.ports, self.run_state)

    def _on_duplicate(self, duplicate: DuplicateIdentity) -> None:
        """This running node is the younger of two with one identity: it stops, and exits 2 (the CLI
        prints the reason)."""
        self._duplicate = duplicate
        self.request_stop()

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
            self.phase = phase_before_round(self.last_round, self._missed_round, bool(self._repair_from))
            if await self._catch_up():
                await self._rejoin_phase()
            else:
                if self.run_state.progress.round_step < self.cfg.inner_steps:
                    self.phase = Phase.INNER  # (a held round's steps are done: it goes on holding)
                await asyncio.to_thread(self._inner_phase)
            if self._stop.is_set():
                break
            self.phase = Phase.OUTER
            try:
                await self._outer_step()
            except Exception:  # a round must never take the daemon down: count it, go on
                await self._round_failed()

    async def _round_failed(self) -> None:
        logger.exception("round %d failed; its work stays local progress", self.run_state.progress.outer_step)
        self.metrics.round_failures.labels("error").inc()
        if self._open_round is not None:  # the ledger's pending range is covered again by the next round
            await asyncio.to_thread(self.ledger.settle, self._open_round, "held", 1, None)
            self._open_round = None

    def _inner_phase(self, stop: threading.Event | None = None) -> None:
        deadline = time.monotonic() + self.cfg.inner_seconds if self.cfg.inner_seconds else None
        self.run_state.inner_phase(self.cfg.inner_steps, deadline, stop or self._stop, self._after_inner_step)

    async def _rejoin_phase(self) -> None:
        """A repaired node adopted a round the swarm is training: it trains that round only until the
        members offer for it (their inner phase is over), then joins its outer step with the tokens
        it did (none when they already offer), rather than trail a round behind forever."""
        closing = threading.Event()
        round_step = self.run_state.progress.outer_step

        async def watch() -> None:
            while not closing.is_set():
                if self._stop.is_set() or await self.rounds.matchmaker.peer_offers(round_step):
                    closing.set()
                    return
                await asyncio.sleep(REJOIN_POLL_S)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.to_thread(self._inner_phase, closing)
        finally:
            closing.set()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher

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
        round_step, start, end = p.outer_step, p.committed_cursor, run.loader.state_dict()
        assert start is not None
        delta, digest = await asyncio.to_thread(
            lambda: (run.trainer.pseudo_gradient(), run.trainer.global_digest())
        )
        await asyncio.to_thread(self.ledger.round, round_step, start, end)
        self._open_round = round_step
        in_swarm = len(p.swarm_cursors.keys() - {self.node_id}) > 0
        expected = await self.membership.expected_peers(p.outer_step)
        result = await self.rounds.average(
            delta, float(p.round_tokens), round_step, digest, end, expected, in_swarm=in_swarm
        )
        self.last_round = result
        if result.averaged is None:
            status = "held" if result.held else "dropped"
            await asyncio.to_thread(self.ledger.settle, round_step, status, len(result.group), None)
            self._open_round = None
            self._repair_from, self._missed_round = result.repair_from, result.missed
            return
        digest = await asyncio.to_thread(run.apply_outer, result.averaged, result.cursors, result.info())
        if await faults.ahit("global_params", p.outer_step) is not None:  # test-only: make it go astray
            run.trainer.global_flat[:16] += 1e-3
            run.trainer.global_changed()
            digest = await asyncio.to_thread(run.trainer.global_digest)
        kept = result.averaged.covered and not result.averaged.carried  # this node's batches all in
        status = "carried" if not kept else "applied" if len(result.group) > 1 else "solo"
        await asyncio.to_thread(
            functools.partial(
                self.ledger.settle,
                *(round_step, status, len(result.group), digest),
                group=result.group if len(result.group) > 1 else (),
                included=result.included,
            )
        )
        self._open_round = None
        if p.outer_step % self.cfg.cold_every == 0:
            await asyncio.to_thread(self._snapshot, "cold")

    # ----- catching up with the swarm -----

    async def _catch_up(self) -> bool:
        """Before an inner phase: if this node's global params went astray (a digest in the minority) or
        its outer step is behind the swarm's, adopt an up-to-date member's snapshot (a repair)."""
        p = self.run_state.progress
        agreeing, missed = {o.node_id for o in self._repair_from}, self._missed_round
        self._repair_from, self._missed_round = (), False
        ahead, why = await self.membership.repair_sources(p.outer_step, agreeing, missed)
        if not ahead:
            return False
        self.phase = Phase.REPAIRING
        behind = not agreeing  # a straggler must move ahead; a node astray may stay at its step
        if await self.recovery.repair(ahead, p.outer_step + 1 if behind else p.outer_step) is None:
            return False
        self.rounds.reset_hold()
        self.repairs += 1
        self.ledger.adopt(self.run_state.loader.state_dict(), "repair", p.outer_step)
        self.metrics.repairs.inc()
        logger.warning("repaired: %s; now at outer step %d with the swarm's global params", why, p.outer_step)
        await asyncio.to_thread(self._snapshot, "hot")
        return True

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
        self.loop.call_soon_threadsafe(self.membership.announce, info)

    # ----- recovery -----

    async def _wait_for_peers(self) -> None:
        wanted = self.cfg.wait_peers
        if wanted and self.dht.peer_count() < wanted:
            self.phase = Phase.WAITING_FOR_PEERS
            logger.info("waiting for %d peers (--wait-peers) before training", wanted)
        while self.dht.peer_count() < wanted and not self._stop.is_set():
            await asyncio.sleep(0.2)

    async def _recover(self) -> None:
        self.phase = Phase.RECOVERING
        self.recovery = Recovery(
            self.run_state,
            peer_fetcher(self.run_state, self.metrics),
            lambda reason: self.metrics.fetch_failures.labels(reason).inc(),
        )
        receipt = await restore_at_start(
            self.recovery, self.membership, self.dht, self.checkpointer, bool(self.cfg.peers)
        )
        progress = self.run_state.progress
        assert progress.committed_cursor is not None
        self.ledger.adopt(progress.committed_cursor, receipt.source, progress.outer_step)
        self.metrics.recoveries.labels(receipt.source).inc()
        self.metrics.recovery_seconds.set(receipt.seconds)
        self._pending_receipt = receipt
        if receipt.source == "peer":  # keep the adopted state on local disk at once
            await asyncio.to_thread(self._snapshot, "hot")

    def _write_receipt(self, receipt: Receipt) -> None:
        append_receipt(self.cfg.data_dir, receipt)
        logger.info("restart receipt: %s", receipt.to_json())

    # ----- what it reports -----

    def progress_sample(self) -> ProgressSample:
        created = self.checkpointer.newest_created_at()
        return progress_sample(
            self.run_state, self.cfg.inner_steps, self.phase, self.dht.peer_count(), created
        )

    def rpc_status(self, peers: int) -> rpc.NodeStatus:
        uptime_s = time.time() - self.started_at
        return node_status(self.run_state, self.phase, uptime_s, peers, self.last_round, self.repairs)
