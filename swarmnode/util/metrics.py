"""Every Prometheus metric of a node, in one place, registered on a registry passed in.

Names start with `swarmnode_` and follow Prometheus conventions (`_total` counters, `_seconds`,
`_bytes`). Labels take values from small fixed sets (kind, reason, source), never peer or snapshot ids.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from swarmnode.util.labels import (
    AveragingReject,
    DHTReject,
    Exclusion,
    FetchFailure,
    ProbeResult,
    Reachability,
    RecoverySource,
    RoundFailure,
    SnapshotFailure,
    SnapshotKind,
)

STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

SNAPSHOT_KINDS = tuple(SnapshotKind)
FETCH_FAILURE_REASONS = tuple(FetchFailure)
RECOVERY_SOURCES = tuple(RecoverySource)
DHT_REJECT_REASONS = tuple(DHTReject)
SNAPSHOT_FAILURE_REASONS = tuple(SnapshotFailure)
ROUND_FAILURE_REASONS = tuple(RoundFailure)
PROBE_RESULTS = (ProbeResult.REACHABLE, ProbeResult.UNREACHABLE, ProbeResult.UNANSWERED)
DIAL_BACK_RESULTS = (
    ProbeResult.REACHABLE,
    ProbeResult.UNREACHABLE,
    ProbeResult.THROTTLED,
    ProbeResult.INVALID,
)
AVERAGING_REJECT_REASONS = tuple(AveragingReject)
EXCLUSION_REASONS = tuple(Exclusion)
DHT_REQUEST_KINDS = ("ping", "store", "find_node", "find_value")


class Metrics:
    """The node's metrics; tests make their own registry, the daemon one per process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.inner_steps = Counter("swarmnode_inner_steps", "Inner (AdamW) steps taken", registry=r)
        self.outer_steps = Counter("swarmnode_outer_steps", "Outer steps applied", registry=r)
        self.outer_step = Gauge("swarmnode_outer_step", "Current outer step (round) of this node", registry=r)
        self.tokens = Counter("swarmnode_tokens", "Training tokens processed", registry=r)
        self.loss = Gauge("swarmnode_loss", "Training loss of the last inner step", registry=r)
        self.heldout_loss = Gauge(
            "swarmnode_heldout_loss", "Loss of the global params on the fixed held-out slice", registry=r
        )
        self.tokens_per_second = Gauge("swarmnode_tokens_per_second", "Training throughput", registry=r)
        self._snapshot_metrics(r)
        self._network_metrics(r)
        self._averaging_metrics(r)
        self._reachability_metrics(r)

    def _snapshot_metrics(self, r: CollectorRegistry) -> None:
        self.snapshot_stall = Histogram(
            "swarmnode_snapshot_stall_seconds",
            "Time the training thread waited for a snapshot",
            ["kind"],
            buckets=STALL_BUCKETS,
            registry=r,
        )
        self.snapshot_write = Histogram(
            "swarmnode_snapshot_write_seconds",
            "Background time to compress, hash and write a snapshot",
            ["kind"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.snapshots_written = Counter(
            "swarmnode_snapshots_written", "Snapshots written", ["kind"], registry=r
        )
        self.snapshot_raw_bytes = Counter(
            "swarmnode_snapshot_raw_bytes", "Uncompressed bytes of snapshots written", ["kind"], registry=r
        )
        self.snapshot_compressed_bytes = Counter(
            "swarmnode_snapshot_compressed_bytes",
            "Compressed bytes of snapshots written",
            ["kind"],
            registry=r,
        )
        self.snapshot_size = Gauge(
            "swarmnode_snapshot_size_bytes", "Size of the newest snapshot file", ["kind"], registry=r
        )
        self.snapshots_skipped = Counter(
            "swarmnode_snapshots_skipped",
            "Hot snapshots skipped because one was still being written",
            registry=r,
        )
        self.snapshot_failures = Counter(
            "swarmnode_snapshot_failures", "Snapshot writes that failed", ["reason"], registry=r
        )
        self.snapshot_age = Gauge("swarmnode_snapshot_age_seconds", "Age of the newest snapshot", registry=r)
        self.snapshot_save_failing = Gauge(
            "swarmnode_snapshot_save_failing",
            "1 while the last snapshot write failed (the newest state is not on disk), else 0",
            registry=r,
        )
        self.snapshot_evictions = Counter(
            "swarmnode_snapshot_evictions",
            "Snapshots removed before retention would have, to make room on a full disk",
            registry=r,
        )
        for kind in SNAPSHOT_KINDS:
            for metric in (
                self.snapshot_stall,
                self.snapshot_write,
                self.snapshots_written,
                self.snapshot_raw_bytes,
                self.snapshot_compressed_bytes,
                self.snapshot_size,
            ):
                metric.labels(kind)
        for reason in SNAPSHOT_FAILURE_REASONS:
            self.snapshot_failures.labels(reason)

    def _network_metrics(self, r: CollectorRegistry) -> None:
        self.snapshots_served = Counter(
            "swarmnode_snapshots_served", "Snapshot streams served to peers", registry=r
        )
        self.served_bytes = Counter("swarmnode_served_bytes", "Snapshot bytes sent to peers", registry=r)
        self.serve_stalls = Counter(
            "swarmnode_serve_stalls",
            "Snapshot streams ended because the peer stopped reading or read below the minimum rate",
            registry=r,
        )
        self.fetch_bytes = Counter("swarmnode_fetch_bytes", "Snapshot bytes fetched from peers", registry=r)
        self.fetch_failures = Counter(
            "swarmnode_fetch_failures", "Snapshot fetches refused or failed", ["reason"], registry=r
        )
        self.ranges_served = Counter(
            "swarmnode_ranges_served", "State ranges served to recovering peers", registry=r
        )
        self.range_failures = Counter(
            "swarmnode_range_failures",
            "State ranges refused or failed in recoveries from many peers",
            ["reason"],
            registry=r,
        )
        self.recoveries = Counter(
            "swarmnode_recoveries", "Restores at start, by where the state came from", ["source"], registry=r
        )
        self.recovery_seconds = Gauge(
            "swarmnode_recovery_seconds", "Duration of the last recovery", registry=r
        )
        self.dht_peers = Gauge("swarmnode_dht_peers", "Nodes in the DHT routing table", registry=r)
        self.dht_rejected = Counter(
            "swarmnode_dht_rejected_records", "DHT records and datagrams refused", ["reason"], registry=r
        )
        self.rpc_rejected = Counter(
            "swarmnode_rpc_rejected", "RPCs refused before reaching a handler", ["reason"], registry=r
        )
        for failure in FETCH_FAILURE_REASONS:
            self.fetch_failures.labels(failure)
            self.range_failures.labels(failure)
        for source in RECOVERY_SOURCES:
            self.recoveries.labels(source)
        for rejected in DHT_REJECT_REASONS:
            self.dht_rejected.labels(rejected)
        for reason in AVERAGING_REJECT_REASONS:  # "unauthenticated" is also the token guard's
            self.rpc_rejected.labels(reason)

    def _averaging_metrics(self, r: CollectorRegistry) -> None:
        self.allreduce_seconds = Histogram(
            "swarmnode_allreduce_seconds", "Duration of an all-reduce", buckets=SECONDS_BUCKETS, registry=r
        )
        self.group_size = Gauge("swarmnode_group_size", "Members of the last averaging group", registry=r)
        self.coverage = Gauge(
            "swarmnode_coverage_ratio",
            "Fraction of the pseudo-gradient averaged in the last round",
            registry=r,
        )
        self.round_failures = Counter(
            "swarmnode_round_failures", "Rounds that fell short", ["reason"], registry=r
        )
        self.repairs = Counter(
            "swarmnode_repairs", "Catch-ups by fetching an up-to-date snapshot", registry=r
        )
        self.allreduce_sent_bytes = Counter(
            "swarmnode_allreduce_sent_bytes", "Pseudo-gradient bytes sent to peers", registry=r
        )
        self.allreduce_round_sent_bytes = Gauge(
            "swarmnode_allreduce_round_sent_bytes", "Pseudo-gradient bytes sent in the last round", registry=r
        )
        for reason in ROUND_FAILURE_REASONS:
            self.round_failures.labels(reason)
        self.averaging_excluded = Counter(
            "swarmnode_averaging_excluded",
            "Contributions a reducer left out of its part's average (robust aggregation)",
            ["reason"],
            registry=r,
        )
        for exclusion in EXCLUSION_REASONS:
            self.averaging_excluded.labels(exclusion)
        self.averaging_clipped = Counter(
            "swarmnode_averaging_clipped",
            "Contributions a reducer pulled in to its clip radius (CenteredClip; still averaged)",
            registry=r,
        )
        self._scale_metrics(r)

    def _reachability_metrics(self, r: CollectorRegistry) -> None:
        self.reachable = Gauge(
            "swarmnode_reachable", "1 when peers can dial this node, 0 for a client (behind NAT)", registry=r
        )
        self.probes = Counter(
            "swarmnode_reachability_probes", "Dial-back probes this node asked for", ["reason"], registry=r
        )
        self.dial_backs = Counter(
            "swarmnode_dial_backs", "Dial-back probes this node served for peers", ["reason"], registry=r
        )
        for result in PROBE_RESULTS:
            self.probes.labels(result)
        for result in DIAL_BACK_RESULTS:
            self.dial_backs.labels(result)

    def set_reachability(self, mode: Reachability) -> None:
        self.reachable.set(1 if mode == Reachability.REACHABLE else 0)

    def _scale_metrics(self, r: CollectorRegistry) -> None:
        """What a round costs as the swarm grows (docs/design.md "The swarm at scale")."""
        self.matchmaking_seconds = Histogram(
            "swarmnode_matchmaking_seconds",
            "Duration of a round's matchmaking, from the offer to the group (or none)",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.dht_requests = Counter(
            "swarmnode_dht_requests", "DHT requests this node sent, by kind", ["kind"], registry=r
        )
        for kind in DHT_REQUEST_KINDS:
            self.dht_requests.labels(kind)

    def track_snapshot_age(
        self, newest_created_at: Callable[[], float | None], now: Callable[[], float]
    ) -> None:
        """Compute the snapshot age at scrape time (NaN before the first snapshot)."""

        def age() -> float:
            created = newest_created_at()
            return float("nan") if created is None else max(now() - created, 0.0)

        self.snapshot_age.set_function(age)
