"""The daemon: builds a node's parts, starts its services, then runs rounds until told to stop.

Who owns what: the training thread (`util/threads.py`) runs every inner step, outer step, restore and
staging copy and publishes an immutable `TrainingSample` after each; the event loop runs gRPC, the DHT,
matchmaking, the all-reduce transport and the status, and reads only that sample; the snapshot writer
compresses and writes what the training thread handed it. One round's outcome (`RoundResult`) is what
the next catch-up decides on. SIGTERM/SIGINT end the inner phase after the current step, write a final
snapshot and leave cleanly. The pieces it runs: services.py (metrics, gRPC, DHT, node.json, status),
swarm/recovery/joining.py (the restore at start), swarm/membership.py (announcements, expected peers,
repairs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from swarmnode.core.data import ShardLoader
from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.ledger import Ledger, RoundStatus, training_stats
from swarmnode.core.model import configure_determinism, count_parameters
from swarmnode.core.training import (
    RoundStart,
    RunIdentity,
    TrainingRun,
    digest_of_settings,
    run_settings,
    settings_json,
)
from swarmnode.net import rpc
from swarmnode.net.identity import Identity
from swarmnode.net.security import Security
from swarmnode.node.config import NodeConfig
from swarmnode.node.overlap import OverlappedRounds
from swarmnode.node.progress import Phase, ProgressReporter, ProgressSample
from swarmnode.node.rank import RankProcesses, RankSpec
from swarmnode.node.round_loop import BlockingRounds
from swarmnode.node.services import Services, StatusBoard, report_progress, start_services, write_node_file
from swarmnode.node.startup import (
    FreshDataDir,
    StartChecks,
    exposure_warning,
    lock_data_dir,
    preflight,
)
from swarmnode.snapshot.checkpointer import CheckpointerConfig, SnapshotOwner, SpeculativeCheckpointer
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.swarm.averaging.rounds import RoundResult
from swarmnode.swarm.membership import DuplicateIdentity, Membership
from swarmnode.swarm.recovery.joining import peer_fetcher, restore_at_start
from swarmnode.swarm.recovery.many_peers import ManyPeerFetch
from swarmnode.swarm.recovery.restore import Receipt, Recovery, append_receipt
from swarmnode.swarm.shards import ShardClaims
from swarmnode.util import clock, faults
from swarmnode.util.aio import settle
from swarmnode.util.errors import ConfigError, StateNotSaved
from swarmnode.util.labels import CursorSource, RecoverySource, RoundFailure
from swarmnode.util.metrics import Metrics
from swarmnode.util.threads import LEDGER_THREAD, OwnedThread, TrainingThread

logger = logging.getLogger(__name__)

REJOIN_POLL_S = 0.25
"""How often a repaired node checks whether the swarm closed the round it rejoined."""
WAIT_PEERS_POLL_S = 0.5
"""How often --wait-peers looks the run's members up."""
PRESENCE_REPUBLISH_S = 5.0
"""While --wait-peers waits, how often the node publishes its presence again."""


@dataclass(frozen=True)
class NodeParts:
    """A node before anything listens: everything that can fail on bad input (ConfigError: exit 2)."""

    cfg: NodeConfig
    identity: Identity
    security: Security
    dht_run: str
    """The run's name in DHT keys (namespaced by the swarm token)."""
    run: TrainingRun
    checkpointer: SpeculativeCheckpointer
    ledger: Ledger
    metrics: Metrics
    data_dir_lock: int
    """The descriptor holding DATA_DIR/node.lock for the process's life."""
    fresh: FreshDataDir
    """What the data dir held before this start (undone if the services cannot start)."""
    ranks: RankProcesses | None = None
    """The node's training ranks 1..N−1 (--nproc-per-node N > 1), stopped when the node ends."""

    def end_ranks(self, failed: bool) -> None:
        """The node's other ranks leave (killed at once when the node failed)."""
        if self.ranks is not None and failed:
            self.ranks.kill()
        elif self.ranks is not None:
            self.ranks.stop()


def build_parts(cfg: NodeConfig, metrics: Metrics | None = None) -> NodeParts:
    """The start-up checks, then the data dir's lock, then the pieces (ValueError: exit 2). A failure
    after the checks leaves the data dir as it was (`FreshDataDir`)."""
    checked = preflight(cfg)
    if (warning := exposure_warning(cfg)) is not None:
        logger.warning("%s", warning)
    fresh = FreshDataDir.note(cfg)
    lock = lock_data_dir(cfg.data_dir)
    try:
        return _assemble(cfg, checked, lock, fresh, metrics or Metrics())
    except BaseException:
        os.close(lock)
        fresh.undo()
        raise


def _assemble(
    cfg: NodeConfig, checked: StartChecks, lock: int, fresh: FreshDataDir, metrics: Metrics
) -> NodeParts:
    identity = Identity.load_or_create(cfg.identity_path)
    checked.security.check_node_certificate(identity.node_id_hex)
    configure_determinism(checked.device, cfg.threads)
    shard = cfg.shard or 0  # (moved to the shard the node claims once the DHT runs: swarm/shards.py)
    loader = ShardLoader(checked.corpus, shard, cfg.num_shards, cfg.batch_size, cfg.seq_len, cfg.seed)
    diloco = _diloco_config(cfg, checked)
    ranks = _start_ranks(cfg, checked, identity.node_id_hex, diloco)
    try:
        return _assemble_run(cfg, checked, lock, fresh, metrics, identity, loader, diloco, ranks)
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise


def _diloco_config(cfg: NodeConfig, checked: StartChecks) -> DilocoConfig:
    return DilocoConfig(
        inner_lr=cfg.inner_lr,
        schedule=cfg.inner_schedule,
        outer_lr=cfg.outer_step_lr,
        outer_momentum=0.0 if cfg.topk else cfg.outer_momentum,  # SparseLoCo: e is the momentum
        outer_mix=0.0 if cfg.topk else cfg.outer_mix,  # (its local progress lives in e, not in θ)
        fragments=cfg.fragments,
        round_tokens=cfg.round_tokens,
        precision=checked.precision,
        topk=cfg.topk,
        ef_decay=cfg.ef_decay,
    )


def _start_ranks(
    cfg: NodeConfig, checked: StartChecks, node_id: str, diloco: DilocoConfig
) -> RankProcesses | None:
    """Ranks 1..N−1 of a node of --nproc-per-node N, joined in its process group (None for N = 1)."""
    if cfg.nproc_per_node == 1:
        return None
    spec = RankSpec(
        rank=0,
        world=cfg.nproc_per_node,
        store_port=0,
        parent_pid=os.getpid(),
        node_id=node_id,
        model=cfg.model,
        data=cfg.data,
        device=str(checked.device),
        precision=str(checked.precision),
        threads=cfg.threads,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        num_shards=cfg.num_shards,
        seed=cfg.seed,
        weight_decay=diloco.weight_decay,
        betas=diloco.betas,
        grad_clip=diloco.grad_clip,
        shard_model=cfg.shard_model == "on",
    )
    return RankProcesses.start(spec, checked.device)


def _assemble_run(
    cfg: NodeConfig,
    checked: StartChecks,
    lock: int,
    fresh: FreshDataDir,
    metrics: Metrics,
    identity: Identity,
    loader: ShardLoader,
    diloco: DilocoConfig,
    ranks: RankProcesses | None,
) -> NodeParts:
    corpus_digest = checked.corpus.digest
    settings = run_settings(checked.model, cfg.seq_len, cfg.num_shards, cfg.seed, diloco, corpus_digest)
    run_identity = RunIdentity(
        cfg.run_id,
        identity.node_id_hex,
        digest_of_settings(settings),
        corpus_digest,
        checked.model.label,
        settings_json(settings),
    )
    digest = run_identity.run_digest
    run = TrainingRun(
        checked.model,
        diloco,
        loader,
        checked.corpus,
        run_identity,
        cfg.seed,
        checked.device,
        metrics,
        ranks.ranks if ranks is not None else None,
        shard_model=cfg.shard_model == "on",
    )
    checkpointer = SpeculativeCheckpointer(
        CheckpointerConfig(
            cfg.snapshot_dir, cfg.keep_hot, cfg.keep_cold, cfg.layout, cfg.hot_level, cfg.cold_level
        ),
        metrics,
        owner=SnapshotOwner(identity.node_id_hex, digest, run.template()),
    )
    metrics.track_snapshot_age(checkpointer.newest_created_at, clock.now)
    parts = NodeParts(
        cfg,
        identity,
        checked.security,
        checked.security.dht_namespace(cfg.run_id),
        run,
        checkpointer,
        Ledger(cfg.data_dir, identity.node_id_hex),
        metrics,
        lock,
        fresh,
        ranks,
    )
    _log_built(parts, checked.corpus.description, len(checked.corpus.tokens))
    return parts


def _log_built(parts: NodeParts, corpus: str, tokens: int) -> None:
    cfg, run = parts.cfg, parts.run
    logger.info(
        "node %s: run %s, model %s (%d params, state %.1f MB) on %s in %s, corpus %s (%d tokens, "
        "sha256 %s…), %d shards",
        run.identity.node_id[:12],
        cfg.run_id,
        cfg.model,
        count_parameters(run.model),
        run.state_bytes() / 1e6,
        run.device,
        run.trainer.precision.precision,
        corpus,
        tokens,
        run.identity.corpus_digest[:12],
        cfg.num_shards,
    )


async def run_node(parts: NodeParts, progress: ProgressReporter | None = None) -> int:
    """Serve, recover, train rounds until done or stopped; returns the exit code."""
    rpc.configure_client(parts.security)
    identity = parts.run.identity
    board = StatusBoard(identity.run_id, identity.node_id, time.time(), run_settings=identity.settings)
    training, ledger_thread = TrainingThread(), OwnedThread(LEDGER_THREAD)
    failed = True
    try:
        async with contextlib.AsyncExitStack() as stack:
            services = await _start_services_or_undo(parts, stack, board)
            write_node_file(parts.cfg, services.ports, parts.run)
            code = await Node(parts, services, board, training, ledger_thread, progress).run()
            failed = False
            return code
    finally:
        training.close()
        ledger_thread.close()
        parts.end_ranks(failed)


async def _start_services_or_undo(
    parts: NodeParts, stack: contextlib.AsyncExitStack, board: StatusBoard
) -> Services:
    """The node's services; a port taken since the start-up checks leaves the data dir as it was."""
    try:
        return await start_services(
            stack,
            parts.cfg,
            parts.identity,
            parts.security,
            parts.checkpointer,
            parts.metrics,
            parts.run.identity.run_digest,
            parts.dht_run,
            lambda peers: board.status(parts.run.sample, peers),
        )
    except ConfigError:
        await stack.aclose()
        parts.fresh.undo()
        raise


def many_peer_fetch(parts: NodeParts, channels: rpc.ChannelCache) -> ManyPeerFetch | None:
    """Recovery from up to --recovery-peers peers at once (None for 1: one whole snapshot at a time)."""
    if parts.cfg.recovery_peers < 2:
        return None
    metrics = parts.metrics
    return ManyPeerFetch(
        parts.run.template(),
        parts.run.identity.run_digest,
        parts.cfg.recovery_peers,
        channels,
        on_range_failure=lambda reason: metrics.range_failures.labels(reason).inc(),
        on_bytes=metrics.fetch_bytes.inc,
    )


class Node:
    """One swarm member with its services running; `run()` returns the process exit code."""

    def __init__(
        self,
        parts: NodeParts,
        services: Services,
        board: StatusBoard,
        training: TrainingThread,
        ledger_thread: OwnedThread,
        progress: ProgressReporter | None,
    ) -> None:
        cfg = parts.cfg
        self.cfg, self.parts, self.run_state, self.metrics = cfg, parts, parts.run, parts.metrics
        self.dht, self.rounds, self.board, self.training, self.progress = (
            services.dht,
            services.rounds,
            board,
            training,
            progress,
        )
        self.node_id = parts.run.identity.node_id
        self._ports = services.ports
        self._loop = asyncio.get_running_loop()
        self.stop = threading.Event()
        self._pending_receipt: Receipt | None = None  # training thread only, like `_snapshot_due`
        self._open_round: int | None = None  # a round whose ledger range awaits its settle entry
        self._duplicate: DuplicateIdentity | None = None
        self.round_loop: BlockingRounds | OverlappedRounds = (
            OverlappedRounds(self) if cfg.overlap == "on" else BlockingRounds(self)
        )
        self._snapshot_due = (
            False  # training thread only: a hot snapshot fell due while a round was in flight
        )
        self.ledger_thread = ledger_thread
        """The one writer of the ledger: entries are appended there, in order."""
        self.membership = Membership(
            services.dht,
            parts.dht_run,
            parts.run.identity,
            services.address,
            self.stop,
            cfg.matchmaking_timeout_s + cfg.allreduce_timeout_s,
            uptime_s=lambda: time.time() - board.started_at,
            on_duplicate=self._on_duplicate,
            channels=services.channels,
            reachable=services.reachability.reachable,
        )
        self.reachability = services.reachability
        board.reachability = lambda: str(self.reachability.mode)
        board.snapshot_error = lambda: parts.checkpointer.save_health().describe()
        self.shard_claims = ShardClaims(
            services.dht,
            parts.dht_run,
            parts.run.identity,
            cfg.num_shards,
            cfg.data_dir,
            cfg.shard_claim_ttl_s,
            pinned=cfg.shard,
        )
        self.recovery = Recovery(
            parts.run,
            training,
            peer_fetcher(parts.run, parts.metrics, services.channels),
            lambda reason: parts.metrics.fetch_failures.labels(reason).inc(),
            many=many_peer_fetch(parts, services.channels),
        )
        parts.checkpointer.subscribe(self._on_snapshot_written)  # before any snapshot is written

    # ----- running -----

    async def run(self) -> int:
        self._install_signal_handlers()
        await self.reachability.probe()  # before anything is announced, offered or fetched
        prober = asyncio.create_task(self.reachability.run(), name="reachability")
        try:
            await self._wait_for_peers()  # (a client is in nobody's routing table: it must know first)
            await self._claim_shard()
            await self._recover()
            reporter = asyncio.create_task(
                report_progress(self.progress, self.cfg.progress_interval_s, self.progress_sample)
            )
            try:
                await self.round_loop.run()
            finally:
                await settle(reporter)
        finally:
            await settle(prober)
        await self.training.run(self._final_snapshot)
        unsaved = self._unsaved_at_stop()
        await self.training.run(self._write_pending_receipt)
        await self.membership.flush()
        self.board.phase = Phase.STOPPING
        sample = self.run_state.sample
        logger.info(
            "node %s stopped at outer step %d, inner step %d",
            self.node_id[:12],
            sample.outer_step,
            sample.inner_step,
        )
        if self._duplicate is not None:
            raise self._duplicate
        if unsaved:
            raise StateNotSaved(unsaved)
        return 0

    def _unsaved_at_stop(self) -> str:
        """After the final snapshot: "" when the state the node stops at is on disk, else one line
        naming the newest step on disk and what a restart loses."""
        health, sample = self.parts.checkpointer.save_health(), self.run_state.sample
        newest = health.newest_on_disk
        if health.failing is None or newest == (sample.outer_step, sample.inner_step):
            return ""
        stopped = f"o{sample.outer_step}/i{sample.inner_step}"
        if newest is None:
            return (
                f"the final snapshot failed ({health.failing}) and no snapshot is on disk: a restart "
                f"starts again instead of resuming at {stopped}"
            )
        return (
            f"the final snapshot failed ({health.failing}): the newest snapshot on disk is "
            f"o{newest[0]}/i{newest[1]}, so a restart loses the {sample.inner_step - newest[1]} inner "
            f"steps up to {stopped} (trained again from there)"
        )

    def _on_duplicate(self, duplicate: DuplicateIdentity) -> None:
        """This running node is the younger of two with one identity: it stops, and exits 2 (the CLI
        prints the reason)."""
        self._duplicate = duplicate
        self.request_stop()

    def request_stop(self) -> None:
        if not self.stop.is_set():
            logger.info("stop requested: finishing the current step")
        self.stop.set()

    def _install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self.request_stop)

    # ----- the round steps the round loop drives (`round_loop.RoundSteps`) -----

    def finished(self) -> bool:
        limit = self.cfg.max_outer_steps
        return self.stop.is_set() or (limit is not None and self.run_state.sample.outer_step >= limit)

    def set_phase(self, phase: Phase) -> None:
        self.board.phase = phase

    def outer_step(self) -> int:
        return self.run_state.sample.outer_step

    def steps_trained(self) -> int:
        return self.run_state.sample.round_step

    def round_steps(self, outer_step: int) -> int:
        """Inner steps of round `outer_step` (--fragments: they vary by round, see core/fragments.py)."""
        return self.cfg.round_steps(outer_step)

    def round_deadline(self) -> float | None:
        """The --inner-seconds time box of a round's inner phase starting now (taken once per round)."""
        return time.monotonic() + self.cfg.inner_seconds if self.cfg.inner_seconds else None

    async def round_failed(self) -> None:
        """Called in the handler of a round's exception: logged with its traceback, counted, and the
        round's open ledger range settled as held (the next round covers it again)."""
        logger.exception("round %d failed; its work stays local progress", self.run_state.sample.outer_step)
        self.metrics.round_failures.labels(RoundFailure.ERROR).inc()
        if self._open_round is not None:
            await self.ledger_thread.run(
                self.parts.ledger.settle, self._open_round, RoundStatus.HELD, 1, None
            )
            self._open_round = None

    async def train(
        self, stops: tuple[threading.Event, ...], deadline: float | None, max_steps: int, in_flight: bool
    ) -> None:
        """An inner phase on the training thread, until the round has `max_steps` inner steps (with
        --overlap the steps of the round in flight count in it) or any of `stops` is set."""
        await self.training.run(self._inner_phase, stops, deadline, max_steps, in_flight)

    def _inner_phase(
        self, stops: tuple[threading.Event, ...], deadline: float | None, max_steps: int, in_flight: bool
    ) -> None:
        self.run_state.inner_phase(
            max_steps, deadline, stops, functools.partial(self._after_inner_step, in_flight)
        )

    async def rejoin(self, max_steps: int) -> None:
        """A repaired node adopted a round the swarm is training: it trains that round only until the
        members offer for it (their inner phase is over), then joins its outer step with the tokens
        it did (none when they already offer), rather than trail a round behind forever. When they
        already offer for a later round, the adopted one is closed: the outer step finds that out at
        once and the node catches up again."""
        closing = threading.Event()
        round_step = self.run_state.sample.outer_step

        async def watch() -> None:
            while not closing.is_set():
                if await self.rounds.matchmaker.peer_offers(round_step):
                    closing.set()
                    return
                await asyncio.sleep(REJOIN_POLL_S)

        watcher = asyncio.create_task(watch(), name="rejoin-watch")
        try:
            await self.train((self.stop, closing), self.round_deadline(), max_steps, in_flight=False)
        finally:
            closing.set()
            await settle(watcher)

    def _after_inner_step(self, in_flight: bool) -> None:
        """On the training thread, after each inner step: the restart receipt, a hot snapshot when due
        (only where no round is in flight, see `overlap.py`: else it waits for the round to land)."""
        sample = self.run_state.sample
        if self._pending_receipt is not None:
            self._pending_receipt.first_loss_after = sample.last_loss
            self._write_receipt(self._pending_receipt)
            self._pending_receipt = None
        if in_flight:
            faults.hit("overlap_step")
        if sample.inner_step % self.cfg.hot_every == 0:
            if in_flight:
                self._snapshot_due = True
                return
            self._snapshot("hot")

    async def snapshot_if_due(self) -> None:
        await self.training.run(self._snapshot_if_due)

    def _snapshot_if_due(self) -> None:
        if self._snapshot_due:
            self._snapshot_due = False
            self._snapshot("hot")

    async def begin_round(self) -> RoundStart:
        """The round's Δ, range and weight (on the training thread), its range opened in the ledger."""
        run = self.run_state
        start = await self.training.run(run.prepare_round)
        stats = training_stats(run.sample)
        await self.ledger_thread.run(self.parts.ledger.round, start.outer_step, start.start, start.end, stats)
        self._open_round = start.outer_step
        return start

    async def average_round(self, start: RoundStart) -> RoundResult:
        """Matchmaking and the all-reduce of the round's Δ (on the event loop; Δ stays unchanged)."""
        expected = await self.membership.expected_peers(start.outer_step)
        result = await self.rounds.average(
            start.delta,
            start.weight,
            start.outer_step,
            start.global_digest,
            start.end,
            expected,
            in_swarm=start.in_swarm,
        )
        self.board.last_round = result
        return result

    async def finish_round(self, start: RoundStart, result: RoundResult, overlapped: bool) -> RoundResult:
        """Applies the round's outer step (or records why not) and settles its ledger range;
        `overlapped`: inner steps went on since `start` (`TrainingRun.apply_outer`)."""
        run = self.run_state
        if result.averaged is None:
            status = RoundStatus.HELD if result.held else RoundStatus.DROPPED
            await self.ledger_thread.run(
                self.parts.ledger.settle, start.outer_step, status, len(result.group), None
            )
            self._open_round = None
            return result
        digest = await self.training.run(
            run.apply_outer, result.averaged, result.cursors, result.info(), start if overlapped else None
        )
        if await faults.ahit("global_params", start.outer_step + 1) is not None:  # test-only: go astray
            digest = await self.training.run(run.nudge_global)
        await self.ledger_thread.run(self._settle, start.outer_step, result, digest)
        self._open_round = None
        if (start.outer_step + 1) % self.cfg.cold_every == 0:
            await self.training.run(self._snapshot, "cold")
        return result

    def _settle(self, outer_step: int, result: RoundResult, digest: str) -> None:
        averaged = result.averaged
        assert averaged is not None
        kept = averaged.covered and not averaged.carried  # this node's batches all in the step
        group = len(result.group) > 1
        status = RoundStatus.APPLIED if kept and group else RoundStatus.SOLO if kept else RoundStatus.CARRIED
        self.parts.ledger.settle(
            outer_step,
            status,
            len(result.group),
            digest,
            group=result.group if group else (),
            included=result.included,
            weights=result.weights,
            stats=training_stats(self.run_state.sample),
        )

    # ----- catching up with the swarm -----

    async def catch_up(self, last: RoundResult | None) -> bool:
        """Before an inner phase: if this node's global params went astray (a digest in the minority) or
        its outer step is behind the swarm's, adopt an up-to-date member's snapshot (a repair)."""
        outer = self.run_state.sample.outer_step
        agreeing = {o.node_id for o in last.repair_from} if last is not None else set()
        missed = last is not None and last.missed
        ahead, why = await self.membership.repair_sources(outer, agreeing, missed)
        if not ahead:
            return False
        self.board.phase = Phase.REPAIRING
        behind = not agreeing  # a straggler must move ahead; a node astray may stay at its step
        repaired = await self.recovery.repair(ahead, outer + 1 if behind else outer)
        if repaired is None:
            return False
        self.rounds.reset_hold()
        self.board.repairs += 1
        sample = self.run_state.sample
        shard, epoch, position = sample.cursor
        await self.ledger_thread.run(
            self.parts.ledger.adopt,
            {"shard": shard, "epoch": epoch, "position": position},
            CursorSource.TAKEOVER if repaired.cursor_source == CursorSource.TAKEOVER else "repair",
            sample.outer_step,
        )
        self.metrics.repairs.inc()
        logger.warning(
            "repaired: %s; now at outer step %d with the swarm's global params", why, sample.outer_step
        )
        await self.training.run(self._snapshot, "hot")
        return True

    def _snapshot(self, kind: str) -> bool:
        run = self.run_state
        tensors, metadata = run.snapshot_state()  # (with several ranks: their cursors and RNG gathered)
        return self.parts.checkpointer.snapshot(tensors, metadata, kind)

    def _final_snapshot(self) -> None:
        checkpointer, sample = self.parts.checkpointer, self.run_state.sample
        checkpointer.wait_idle()
        newest = checkpointer.find(None)
        if newest is not None and (newest.outer_step, newest.inner_step) == (
            sample.outer_step,
            sample.inner_step,
        ):
            return
        self._snapshot("hot")
        checkpointer.wait_idle()

    def _on_snapshot_written(self, info: SnapshotInfo) -> None:
        """Called on the writer thread after each snapshot: announce it from the event loop."""
        self._loop.call_soon_threadsafe(self.membership.announce, info)

    # ----- recovery -----

    async def _wait_for_peers(self) -> None:
        """Say this node is here (others' --wait-peers count it), then wait until --wait-peers other
        members of the run are known (their presence or announcements: clients too, which are in
        nobody's routing table) or --wait-peers-timeout passes (then train, and say so)."""
        await self.membership.present()
        wanted = self.cfg.wait_peers
        if not wanted:
            return
        deadline = time.monotonic() + self.cfg.wait_peers_timeout_s
        republish = time.monotonic() + PRESENCE_REPUBLISH_S
        seen = await self.membership.members_seen()
        if len(seen) < wanted:
            self.board.phase = Phase.WAITING_FOR_PEERS
            logger.info("waiting for %d peers (--wait-peers) before training", wanted)
        while len(seen) < wanted and not self.stop.is_set():
            if time.monotonic() >= deadline:
                logger.warning(
                    "only %d of the %d peers --wait-peers asks for after %.0f s (--wait-peers-timeout): "
                    "training without them; they join the swarm when they come",
                    len(seen),
                    wanted,
                    self.cfg.wait_peers_timeout_s,
                )
                return
            await asyncio.sleep(WAIT_PEERS_POLL_S)
            if time.monotonic() >= republish:  # (a first one may have reached nobody yet)
                republish = time.monotonic() + PRESENCE_REPUBLISH_S
                await self.membership.present()
            seen = await self.membership.members_seen()
        logger.info("%d peers of the run known: %s", len(seen), ", ".join(sorted(s[:12] for s in seen)))

    async def _claim_shard(self) -> None:
        """The shard this node trains: kept, pinned or claimed in the DHT (swarm/shards.py)."""
        shard = await self.shard_claims.claim(self.stop)
        if shard != self.run_state.loader.shard:
            await self.training.run(self.run_state.assign_shard, shard)
            write_node_file(self.cfg, self._ports, self.run_state)  # (it names the shard)

    async def _recover(self) -> None:
        self.board.phase = Phase.RECOVERING
        receipt = await restore_at_start(
            self.recovery, self.membership, self.dht, self.parts.checkpointer, bool(self.cfg.peers)
        )
        sample = self.run_state.sample
        shard, epoch, position = sample.committed_cursor
        committed = {"shard": shard, "epoch": epoch, "position": position}
        source = CursorSource.TAKEOVER if receipt.cursor_source == CursorSource.TAKEOVER else receipt.source
        await self.ledger_thread.run(self.parts.ledger.adopt, committed, source, sample.outer_step)
        self.metrics.recoveries.labels(receipt.source).inc()
        self.metrics.recovery_seconds.set(receipt.seconds)
        await self.training.run(self._hold_receipt, receipt)
        if receipt.source == RecoverySource.PEER:  # keep the adopted state on local disk at once
            await self.training.run(self._snapshot, "hot")

    def _hold_receipt(self, receipt: Receipt) -> None:
        """On the training thread, which owns it: the receipt waits for the first inner step's loss."""
        self._pending_receipt = receipt

    def _write_pending_receipt(self) -> None:
        """At the stop, on the training thread: the receipt of a node stopped before its first step."""
        if self._pending_receipt is not None:
            self._write_receipt(self._pending_receipt)
            self._pending_receipt = None

    def _write_receipt(self, receipt: Receipt) -> None:
        append_receipt(self.cfg.data_dir, receipt)
        logger.info("restart receipt: %s", receipt.to_json())

    # ----- what it reports -----

    def progress_sample(self) -> ProgressSample:
        created = self.parts.checkpointer.newest_created_at()
        sample = self.run_state.sample
        steps = self.round_steps(sample.outer_step + int(self.round_loop.in_flight))
        return self.board.progress(sample, steps, self.dht.peer_count(), created)
