"""The daemon: wires identity, data, training, snapshots and services, then runs rounds until told to stop.

Training compute runs on a worker thread (`asyncio.to_thread`); the event loop owns all network I/O and
never waits on a training step. SIGTERM/SIGINT end the inner phase after the current step, write a final
snapshot and leave cleanly. Once its services listen, a node writes DATA_DIR/node.json (node id, ports,
pid) so scripts and tests learn the ports it picked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import start_http_server

from swarmnode.checkpointer import CheckpointerConfig, SpeculativeCheckpointer
from swarmnode.config import ConfigError, NodeConfig
from swarmnode.data import ShardLoader, load_corpus, shard_for_node
from swarmnode.diloco import Averager, DilocoConfig, SoloAverager
from swarmnode.identity import Identity
from swarmnode.metrics import Metrics
from swarmnode.model import configure_determinism, count_parameters, preset, select_device
from swarmnode.recovery import Receipt, append_receipt, restore_local
from swarmnode.snapshot import SnapshotInfo, sha256_file
from swarmnode.training import RunIdentity, TrainingRun, run_digest

logger = logging.getLogger(__name__)
progress_logger = logging.getLogger("swarmnode.progress")


@dataclass
class Ports:
    grpc: int = 0
    dht: int = 0
    metrics: int = 0


class Node:
    """One swarm member. `run()` returns the process exit code."""

    def __init__(self, cfg: NodeConfig, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.ports = Ports()
        self.started_at = time.time()
        self.phase = "starting"
        self._stop = threading.Event()
        self._pending_receipt: Receipt | None = None
        self.averager: Averager = SoloAverager()

    # ----- building -----

    def build(self) -> None:
        """Everything that can fail on bad input, before any socket opens (ValueError: exit 2)."""
        cfg = self.cfg
        self.identity = Identity.load_or_create(cfg.identity_path)
        self.node_id = self.identity.node_id_hex
        corpus = load_corpus(cfg.data)
        model_cfg = preset(cfg.model, corpus.vocab_size)
        if cfg.seq_len > model_cfg.context:
            raise ConfigError(f"--seq-len: at most the {cfg.model} preset's context {model_cfg.context}, "
                              f"got {cfg.seq_len}")
        device = select_device(cfg.device)
        configure_determinism(device, cfg.threads)
        shard = cfg.shard if cfg.shard is not None else shard_for_node(self.identity.node_id, cfg.num_shards)
        loader = ShardLoader(corpus, shard, cfg.num_shards, cfg.batch_size, cfg.seq_len, cfg.seed)
        diloco = DilocoConfig(inner_lr=cfg.inner_lr, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum)
        digest = run_digest(cfg.model, model_cfg, cfg.seq_len, cfg.num_shards, cfg.seed, diloco, corpus.digest)
        identity = RunIdentity(cfg.run_id, self.node_id, digest, corpus.digest, cfg.model)
        self.run_state = TrainingRun(model_cfg, diloco, loader, corpus, identity, cfg.seed, device,
                                     self.metrics)
        self.checkpointer = SpeculativeCheckpointer(
            CheckpointerConfig(cfg.snapshot_dir, cfg.keep_hot, cfg.keep_cold, cfg.layout, cfg.hot_level,
                               cfg.cold_level), self.metrics, on_written=self._on_snapshot_written)
        self.metrics.track_snapshot_age(self.checkpointer.newest_created_at, time.time)
        logger.info("node %s: run %s, model %s (%d params, state %.1f MB) on %s, corpus %s (%d tokens, "
                    "sha256 %s…), shard %d/%d", self.node_id[:12], cfg.run_id, cfg.model,
                    count_parameters(self.run_state.model), self.run_state.state_bytes() / 1e6, device,
                    corpus.description, len(corpus.tokens), corpus.digest[:12], shard, cfg.num_shards)

    # ----- running -----

    async def run(self) -> int:
        """Serve, recover, train rounds until done or stopped; `build()` must have run."""
        self._install_signal_handlers()
        metrics_server = self._start_metrics()
        try:
            self._write_node_file()
            await asyncio.to_thread(self._recover)
            reporter = asyncio.create_task(self._report_progress())
            try:
                await self._round_loop()
            finally:
                reporter.cancel()
            await asyncio.to_thread(self._final_snapshot)
        finally:
            self.phase = "stopping"
            await asyncio.to_thread(self.checkpointer.close)
            metrics_server.shutdown()
        logger.info("node %s stopped at outer step %d, inner step %d", self.node_id[:12],
                    self.run_state.progress.outer_step, self.run_state.progress.inner_step)
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
        delta = run.trainer.pseudo_gradient()
        averaged = await self.averager.average(delta, float(run.progress.round_tokens),
                                               run.progress.outer_step)
        await asyncio.to_thread(run.apply_outer, averaged)
        self.metrics.group_size.set(averaged.group_size)
        self.metrics.coverage.set(averaged.coverage)
        if run.progress.outer_step % self.cfg.cold_every == 0:
            await asyncio.to_thread(self._snapshot, "cold")

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
        """Called on the writer thread after each snapshot (announcing lands with the DHT)."""

    # ----- recovery -----

    def _recover(self) -> None:
        self.phase = "recovering"
        restored = restore_local(self.run_state, self.cfg.snapshot_dir)
        verified = restored[1] if restored else set()
        self.checkpointer.adopt_existing(
            verify=lambda path, sid: sid in verified or _sha_matches(path, sid))
        if restored is None:
            receipt = Receipt(source="fresh", cursor=self.run_state.loader.state_dict())
            logger.info("no snapshot to resume from: starting shard %d afresh",
                        self.run_state.loader.shard)
        else:
            receipt = restored[0]
            logger.info("resumed from own snapshot %s at outer step %d, inner step %d in %.2f s",
                        receipt.snapshot_id and receipt.snapshot_id[:12], receipt.outer_step,
                        receipt.inner_step, receipt.seconds)
        self.metrics.recoveries.labels(receipt.source).inc()
        self.metrics.recovery_seconds.set(receipt.seconds)
        self._pending_receipt = receipt

    def _write_receipt(self, receipt: Receipt) -> None:
        append_receipt(self.cfg.data_dir, receipt)
        logger.info("restart receipt: %s", receipt.to_json())

    # ----- services -----

    def _start_metrics(self) -> Any:
        server, _thread = start_http_server(self.cfg.metrics_port, addr=self.cfg.host,
                                            registry=self.metrics.registry)
        self.ports.metrics = server.server_port
        logger.info("metrics on http://%s:%d/metrics", self.cfg.host, self.ports.metrics)
        return server

    def _write_node_file(self) -> None:
        info = {"node_id": self.node_id, "pid": os.getpid(), "run_id": self.cfg.run_id,
                "host": self.cfg.advertised_host, "grpc_port": self.ports.grpc, "dht_port": self.ports.dht,
                "metrics_port": self.ports.metrics, "run_digest": self.run_state.identity.run_digest,
                "shard": self.run_state.loader.shard}
        path = self.cfg.data_dir / "node.json"
        tmp = path.with_name("node.json.tmp")
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, path)

    async def _report_progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.progress_interval_s)
            progress_logger.info("%s", self.progress_line())

    def progress_line(self) -> str:
        p = self.run_state.progress
        created = self.checkpointer.newest_created_at()
        age = f"{time.time() - created:.0f}s" if created else "none"
        loss = f"{p.last_loss:.4f}" if p.last_loss is not None else "-"
        return (f"round {p.outer_step} step {p.round_step}/{self.cfg.inner_steps} loss {loss} "
                f"tok/s {self.run_state.tokens_per_second:.0f} peers 0 snapshot {age}")

    def status(self) -> dict[str, Any]:
        run = self.run_state
        p = run.progress
        return {"node_id": self.node_id, "run_id": self.cfg.run_id, "phase": self.phase,
                "outer_step": p.outer_step, "inner_step": p.inner_step, "last_loss": p.last_loss,
                "tokens_per_s": run.tokens_per_second, "cursor": run.loader.state_dict(),
                "global_digest": run.trainer.global_digest(), "uptime_s": time.time() - self.started_at,
                "device": str(next(run.model.parameters()).device), "torch": torch.__version__}


def _sha_matches(path: Path, snapshot_id: str) -> bool:
    return sha256_file(path) == snapshot_id
