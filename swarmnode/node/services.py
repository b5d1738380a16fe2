"""The node's services and what they report.

`start_services` starts the Prometheus endpoint, the gRPC server (snapshots, status, averaging, the
dial-back probe) and the DHT (as a client when the node starts as one, docs/design.md "Behind NAT"), and
builds the round machinery and the reachability monitor on them; each service's stop goes on the caller's exit
stack, so it runs on every way out. Once they listen, DATA_DIR/node.json tells scripts and tests the ports the
node picked. `StatusBoard` answers the gRPC status call and fills the progress line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zstandard
from prometheus_client import start_http_server

from swarmnode.core.training import TrainingRun, TrainingSample
from swarmnode.net import rpc, snapshot_server
from swarmnode.net.bulk import BulkListener
from swarmnode.net.dht import DHTConfig, SwarmDHT
from swarmnode.net.dial_back import DialBackServicer
from swarmnode.net.identity import Identity
from swarmnode.net.security import Security
from swarmnode.net.state_ranges import RangeFilter, StateRangeServicer
from swarmnode.node.config import NodeConfig
from swarmnode.node.progress import Phase, ProgressReporter, ProgressSample
from swarmnode.snapshot.checkpointer import SpeculativeCheckpointer
from swarmnode.snapshot.ranges import RAW, EncodedRange, decode_range
from swarmnode.swarm.averaging.allreduce import fetch_group, propose_group
from swarmnode.swarm.averaging.matchmaking import Matchmaker
from swarmnode.swarm.averaging.reducer import AveragingServicer
from swarmnode.swarm.averaging.rounds import RoundResult, SwarmRounds
from swarmnode.swarm.averaging.trust import AveragingTrust
from swarmnode.swarm.averaging.wire import GroupSpec
from swarmnode.swarm.reachability import ReachabilityMonitor, initial_mode
from swarmnode.swarm.recovery.range_source import SnapshotRanges
from swarmnode.util import clock, faults
from swarmnode.util.errors import ConfigError
from swarmnode.util.labels import Reachability
from swarmnode.util.metrics import Metrics

logger = logging.getLogger(__name__)

CONTACTS_FILE = "contacts.json"
"""DATA_DIR/contacts.json: the DHT contacts this node knew, so that a restart finds its swarm again."""


@dataclass
class Ports:
    grpc: int = 0
    dht: int = 0
    metrics: int = 0
    bulk: int = 0
    """0: no bulk lane (--bulk-port off, or a TLS swarm)."""


@dataclass(frozen=True)
class Services:
    """A started node's services: its ports, its DHT node and the rounds run through them."""

    ports: Ports
    address: str  # the advertised gRPC address, host:port
    dht: SwarmDHT
    rounds: SwarmRounds
    channels: rpc.ChannelCache
    """Client channels to peers, reused by the all-reduce, proposals, fetches and probes."""
    reachability: ReachabilityMonitor
    """This node's mode (reachable or client) and its dial-back probes."""


class _Proposals:
    """Hands group proposals to the matchmaker; one that arrives before the matchmaker exists is refused."""

    def __init__(self) -> None:
        self.matchmaker: Matchmaker | None = None

    async def __call__(self, spec: GroupSpec, proposer: str | None) -> GroupSpec | None:
        return None if self.matchmaker is None else await self.matchmaker.on_proposal(spec, proposer)

    async def led_group(self, run_id: str, outer_step: int, wait_s: float) -> GroupSpec | None:
        if self.matchmaker is None:
            return None
        return await self.matchmaker.led_group(run_id, outer_step, wait_s)


async def start_services(
    stack: contextlib.AsyncExitStack,
    cfg: NodeConfig,
    identity: Identity,
    security: Security,
    checkpointer: SpeculativeCheckpointer,
    metrics: Metrics,
    run_digest: str,
    dht_run: str,
    status: Callable[[int], rpc.NodeStatus],
) -> Services:
    """Metrics, gRPC and the DHT; each is stopped by `stack` on every way out.

    `status` gives the node's status for its current DHT peer count (served from the first request on).
    """
    node_id = identity.node_id_hex
    ports = Ports(metrics=_start_metrics(stack, cfg, metrics))
    channels = rpc.ChannelCache()
    stack.push_async_callback(channels.close)  # after every user of the channels stopped
    stack.push_async_callback(asyncio.to_thread, checkpointer.close)  # after the server that serves it
    proposals = _Proposals()
    trust = AveragingTrust.for_node(identity, security.mutual_tls)
    lanes = await _start_bulk_lanes(stack, cfg, security)
    ports.bulk = lanes.port if lanes is not None else 0
    averaging = AveragingServicer(
        node_id,
        on_proposal=proposals,
        on_rejected=lambda reason: metrics.rpc_rejected.labels(reason).inc(),
        led_group=proposals.led_group,
        trust=trust,
        max_norm_ratio=cfg.max_norm_ratio,
        on_excluded=lambda reason: metrics.averaging_excluded.labels(reason).inc(),
        on_clipped=metrics.averaging_clipped.inc,
        lanes=lanes,
    )
    dial_back = DialBackServicer(on_dial=lambda result: metrics.dial_backs.labels(result).inc())
    mode = initial_mode(cfg.reachable, bool(cfg.peers))
    dht = SwarmDHT(  # wired now (the status reads its peer count), started after the gRPC server
        identity,
        DHTConfig(
            host=cfg.host,
            port=cfg.dht_port,
            datagram_key=security.dht_datagram_key(),
            client_mode=mode == Reachability.CLIENT,
            contacts_file=cfg.data_dir / CONTACTS_FILE,
        ),
        on_reject=lambda reason: metrics.dht_rejected.labels(reason).inc(),
        on_request=lambda name: metrics.dht_requests.labels(name).inc(),
    )

    def status_now() -> rpc.NodeStatus:
        return status(dht.peer_count())

    ranges = _range_servicer(checkpointer, metrics, identity)
    servicers = (averaging.register, dial_back.register, ranges.register)
    ports.grpc = await _start_rpc(stack, cfg, checkpointer, metrics, security, servicers, status_now)
    await _start_dht(stack, dht, cfg, metrics)
    ports.dht = dht.port
    address = f"{cfg.advertised_host}:{ports.grpc}"
    reachability = ReachabilityMonitor(
        *(cfg.reachable, mode, node_id, ports.grpc, address),
        *(dht, dht_run, run_digest),
        on_probe=lambda result: metrics.probes.labels(result).inc(),
        on_mode=metrics.set_reachability,
        channels=channels,
    )
    matchmaker = _matchmaker(
        cfg, dht, node_id, address, dht_run, run_digest, channels, reachability, trust, metrics
    )
    proposals.matchmaker = matchmaker
    rounds = SwarmRounds(matchmaker, averaging, node_id, cfg.min_coverage, metrics, channels)
    _log_listening(cfg, ports)
    return Services(ports, address, dht, rounds, channels, reachability)


def _range_servicer(
    checkpointer: SpeculativeCheckpointer, metrics: Metrics, identity: Identity
) -> StateRangeServicer:
    """The node's snapshots served as state ranges, the manifests signed by its identity (docs/design.md
    "Recovery from many peers")."""
    assert checkpointer.owner is not None
    source = SnapshotRanges(checkpointer.list_snapshots, checkpointer.owner.template)
    return StateRangeServicer(
        source, identity, on_served=lambda nbytes: metrics.ranges_served.inc(), range_filter=range_faults()
    )


def _matchmaker(
    cfg: NodeConfig,
    dht: SwarmDHT,
    node_id: str,
    address: str,
    dht_run: str,
    run_digest: str,
    channels: rpc.ChannelCache,
    reachability: ReachabilityMonitor,
    trust: AveragingTrust,
    metrics: Metrics,
) -> Matchmaker:
    return Matchmaker(
        dht,
        node_id,
        address,
        dht_run,
        run_digest,
        cfg.group_wire_dtype,
        cfg.matchmaking_timeout_s,
        cfg.allreduce_timeout_s,
        functools.partial(propose_group, channels=channels, trust=trust),
        reachable=reachability.reachable,
        fetch_group=functools.partial(fetch_group, channels=channels, trust=trust),
        group_size=cfg.group_size,
        on_refused=lambda reason: metrics.rpc_rejected.labels(reason).inc(),
        max_weight=cfg.round_tokens,
    )


_BIND_REFUSALS = {errno.EADDRINUSE: "is already in use", errno.EACCES: "may not be bound by this user"}


@contextlib.contextmanager
def _binding(flag: str, host: str, port: int) -> Iterator[None]:
    """A port that cannot be bound (in use, or privileged) is a usage error naming its flag (exit 2,
    one line); any other OSError stays a failure."""
    try:
        yield
    except OSError as exc:
        refusal = _BIND_REFUSALS.get(exc.errno or 0)
        if refusal is None:
            raise
        raise ConfigError(f"{flag}: port {port} on {host} {refusal}") from None


def _start_metrics(stack: contextlib.AsyncExitStack, cfg: NodeConfig, metrics: Metrics) -> int:
    with _binding("--metrics-port", cfg.host, cfg.metrics_port):
        server, _thread = start_http_server(cfg.metrics_port, addr=cfg.host, registry=metrics.registry)
    stack.callback(server.server_close)
    stack.callback(server.shutdown)  # runs first: stop serving, then close the socket
    return server.server_port


async def _start_rpc(
    stack: contextlib.AsyncExitStack,
    cfg: NodeConfig,
    checkpointer: SpeculativeCheckpointer,
    metrics: Metrics,
    security: Security,
    servicers: tuple[Callable[[Any], str | None], ...],
    status: Callable[[], rpc.NodeStatus],
) -> int:
    def on_served(snapshot_id: str) -> None:
        metrics.snapshots_served.inc()
        info = checkpointer.find(snapshot_id)
        if info is not None:
            metrics.served_bytes.inc(info.size_bytes)

    with _binding("--grpc-port", cfg.host, cfg.grpc_port):
        server = await snapshot_server.start_server(
            cfg.host,
            cfg.grpc_port,
            checkpointer,
            status,
            max_serving=cfg.max_serving,
            max_serving_per_peer=cfg.max_serving_per_peer,
            on_served=on_served,
            extra_servicers=servicers,
            faults=serve_faults(),
            security=security,
            on_rejected=lambda reason: metrics.rpc_rejected.labels(reason).inc(),
            on_stalled=lambda reason: metrics.serve_stalls.inc(),
        )
    stack.push_async_callback(server.stop, 1.0)
    return server.port


async def _start_bulk_lanes(
    stack: contextlib.AsyncExitStack, cfg: NodeConfig, security: Security
) -> BulkListener | None:
    """The listener of the all-reduce's bulk lanes: none with --bulk-port off, nor on a TLS swarm (a
    lane is plaintext; `net/bulk.py`)."""
    if cfg.bulk_port is None or security.tls:
        return None
    lanes = BulkListener()
    with _binding("--bulk-port", cfg.host, cfg.bulk_port):
        await lanes.start(cfg.host, cfg.bulk_port)
    stack.push_async_callback(lanes.close)
    return lanes


async def _start_dht(
    stack: contextlib.AsyncExitStack, dht: SwarmDHT, cfg: NodeConfig, metrics: Metrics
) -> None:
    stack.push_async_callback(dht.stop)  # before it starts: a start that fails half-way is closed too
    with _binding("--dht-port", cfg.host, cfg.dht_port):
        await dht.start(cfg.peers)
    metrics.dht_peers.set_function(dht.peer_count)


def _log_listening(cfg: NodeConfig, ports: Ports) -> None:
    logger.info(
        "listening on %s: gRPC %d, bulk lane %s, DHT (UDP) %d, metrics http://%s:%d/metrics; advertising %s",
        cfg.host,
        ports.grpc,
        ports.bulk or "off",
        ports.dht,
        cfg.host,
        ports.metrics,
        cfg.advertised_host,
    )


def serve_faults() -> rpc.ServeFaults | None:
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


def range_faults() -> RangeFilter | None:
    """Test-only: `corrupt@serve_range` flips a byte of each state range served (a lying peer)."""
    if not faults.armed("serve_range"):
        return None

    async def corrupt(index: int, sent: EncodedRange) -> EncodedRange:
        fault = await faults.ahit("serve_range")
        encoding, data = sent
        if fault is None or fault.action != "corrupt" or not data:
            return sent
        size = zstandard.frame_content_size(data) if encoding else len(data)
        raw = decode_range(encoding, data, size)
        logger.warning("fault: state range %d served corrupted", index)
        return RAW, bytes([raw[0] ^ 0xFF]) + raw[1:]

    return corrupt


# ----- what the node reports -----


def write_node_file(cfg: NodeConfig, ports: Ports, run: TrainingRun) -> None:
    """DATA_DIR/node.json: node id, pid, ports; replaced atomically."""
    info = {
        "node_id": run.identity.node_id,
        "pid": os.getpid(),
        "run_id": cfg.run_id,
        "host": cfg.advertised_host,
        "grpc_port": ports.grpc,
        "dht_port": ports.dht,
        "metrics_port": ports.metrics,
        "bulk_port": ports.bulk,
        "run_digest": run.identity.run_digest,
        "shard": run.loader.shard,
    }
    path = cfg.data_dir / "node.json"
    tmp = path.with_name("node.json.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path)


async def report_progress(
    reporter: ProgressReporter | None, interval_s: float, sample: Callable[[], ProgressSample]
) -> None:
    """Report a sample every interval (the reporter's own, else `interval_s`) until cancelled."""
    if reporter is None:
        return
    interval = reporter.interval_s or interval_s
    try:
        while True:
            await asyncio.sleep(interval)
            reporter.report(sample())
    finally:
        reporter.finish()


@dataclass
class StatusBoard:
    """What a node reports besides its training sample: its phase, its last round, its repairs. The round
    loop changes it and the status call reads it, both on the event loop."""

    run_id: str
    node_id: str
    started_at: float
    phase: Phase = Phase.STARTING
    last_round: RoundResult | None = None
    repairs: int = 0
    reachability: Callable[[], str] = lambda: ""
    """This node's mode now ("reachable" or "client")."""
    snapshot_error: Callable[[], str] = lambda: ""
    """Why the node's newest state is not on disk ("" while snapshots are written)."""
    run_settings: str = ""
    """What its run digest hashes (`RunIdentity.settings`), for peers of another configuration."""

    def status(self, sample: TrainingSample, peers: int) -> rpc.NodeStatus:
        """The gRPC status answer: the training thread's published sample and this board."""
        return rpc.NodeStatus(
            node_id=self.node_id,
            run_id=self.run_id,
            phase=self.phase,
            uptime_s=time.time() - self.started_at,
            outer_step=sample.outer_step,
            inner_step=sample.inner_step,
            last_loss=sample.last_loss,
            tokens_per_s=sample.tokens_per_s,
            cursor=rpc.CursorStatus(*sample.cursor),
            peers=peers,
            global_digest=sample.global_digest,
            reachability=self.reachability(),
            snapshot_error=self.snapshot_error(),
            run_settings=self.run_settings,
            **_round_status(self.last_round, self.repairs),
        )

    def progress(
        self, sample: TrainingSample, steps_per_round: int, peers: int, snapshot_created_at: float | None
    ) -> ProgressSample:
        """The progress line's sample."""
        return ProgressSample(
            round=sample.outer_step,
            step=sample.round_step,
            steps_per_round=steps_per_round,
            loss=sample.last_loss,
            heldout_loss=sample.heldout_loss,
            tokens_per_s=round(sample.tokens_per_s, 1),
            peers=peers,
            snapshot_age_s=None if snapshot_created_at is None else clock.now() - snapshot_created_at,
            phase=self.phase,
        )


def _round_status(last: RoundResult | None, repairs: int) -> dict[str, Any]:
    if last is None:
        return {"repairs": repairs}
    return {
        "last_group": last.group,
        "last_coverage": last.coverage,
        "last_allreduce_s": last.seconds,
        "repairs": repairs,
    }
