"""Node configuration: one frozen dataclass, filled from defaults < TOML file < SWARMNODE_* env < flags.

Every field of `NodeConfig` is one `swarmnode run` flag, listed once in `FLAGS` with its group, so the
parser, the environment twins, the TOML keys, `--help` and docs/configuration.md (generated from `FLAGS`
by `python -m swarmnode.node.flag_reference`) cannot drift apart.
Bad values raise `ConfigError` (a ValueError) whose message names the flag and the value; the CLI prints
it as one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from swarmnode.core import topk_layout
from swarmnode.core.device_choice import PRECISION_CHOICES, check_device_choice
from swarmnode.core.fragments import round_steps, steps_in_rounds
from swarmnode.core.model_choice import check_model_choice
from swarmnode.core.schedule import DEFAULT_FINAL_FRACTION, LR_SCHEDULES, InnerSchedule, LrSchedule
from swarmnode.net.dht_records import MAX_TTL_S
from swarmnode.node import flag_values
from swarmnode.snapshot.format import LAYOUTS
from swarmnode.snapshot.metadata import MAX_RANKS
from swarmnode.swarm.averaging.matchmaking import DEFAULT_GROUP_SIZE
from swarmnode.swarm.averaging.trust import DEFAULT_MAX_NORM_RATIO
from swarmnode.swarm.averaging.wire import MAX_TIMEOUT_S, WIRE_DTYPES
from swarmnode.util.errors import ConfigError

DILOCO_OUTER_LR = 0.7
"""DiLoCo's outer learning rate (Douillard et al. 2023)."""
TOPK_OUTER_LR = topk_layout.DEFAULT_OUTER_LR
"""α of SparseLoCo's outer step θ_g ← θ_g − α·mean(ĉ) (Sarfi et al. 2025; the paper's is 1)."""

LOG_FORMATS = ("text", "json")
REACHABLE_SETTINGS = ("auto", "yes", "no")


@dataclass(frozen=True)
class NodeConfig:
    """Everything one `swarmnode run` needs. Field docs are the `--help` texts (see FLAGS)."""

    peers: tuple[str, ...] = ()
    run_id: str = "swarmnode"
    data_dir: Path = Path("swarmnode-data")
    host: str = "0.0.0.0"
    advertise_host: str | None = None
    grpc_port: int = 50051
    dht_port: int = 8468
    metrics_port: int = 9464
    bulk_port: int | None = 0
    model: str = "small"
    data: str | None = None
    device: str = "auto"
    precision: str = "auto"
    nproc_per_node: int = 1
    max_ranks: int = 1
    shard_model: str = "off"
    threads: int | None = None
    inner_steps: int = 500
    inner_seconds: float | None = None
    inner_lr: float = 1e-3
    lr_schedule: str = "constant"
    inner_warmup_steps: int = 0
    total_steps: int | None = None
    final_lr_fraction: float = DEFAULT_FINAL_FRACTION
    outer_lr: float | None = None
    outer_momentum: float = 0.9
    outer_mix: float = 0.3
    batch_size: int = 8
    seq_len: int = 128
    num_shards: int = 16
    shard: int | None = None
    shard_claim_ttl_s: float = 600.0
    hot_every: int = 50
    cold_every: int = 5
    keep_hot: int = 3
    keep_cold: int = 2
    layout: str = "planes"
    hot_level: int = 1
    cold_level: int = 3
    max_outer_steps: int | None = None
    seed: int = 0
    identity: Path | None = None
    log_format: str = "text"
    progress_interval_s: float = 10.0
    wait_peers: int = 0
    wait_peers_timeout_s: float = 120.0
    max_serving: int = 2
    max_serving_per_peer: int = 1
    recovery_peers: int = 3
    matchmaking_timeout_s: float = 5.0
    allreduce_timeout_s: float = 30.0
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO
    wire_dtype: str = "bf16"
    topk_density: float = topk_layout.DEFAULT_DENSITY
    ef_decay: float = 0.95
    min_coverage: float = 0.5
    reachable: str = "auto"
    group_size: int = DEFAULT_GROUP_SIZE
    overlap: str = "off"
    fragments: int = 1
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    swarm_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Values built in code (tests, demo) get the same checks as values typed by people.
        for flag in FLAGS:
            value = getattr(self, flag.field)
            if value is not None:
                parse_flag(flag, value, source=flag.option)
        _check_combinations(self)

    @property
    def identity_path(self) -> Path:
        return self.identity if self.identity is not None else self.data_dir / "identity.key"

    @property
    def snapshot_dir(self) -> Path:
        return self.data_dir / "snapshots"

    @property
    def inner_schedule(self) -> InnerSchedule:
        """The inner learning-rate schedule: a cosine ends at --total-steps, or else after
        --max-outer-steps rounds (`steps_in_rounds`); a constant one has no end. ConfigError when a
        cosine's end is not past its warm-up."""
        if self.lr_schedule == LrSchedule.CONSTANT:
            return InnerSchedule(LrSchedule.CONSTANT, self.inner_warmup_steps)
        total = self.total_steps
        if total is None and self.max_outer_steps is not None:
            total = steps_in_rounds(self.inner_steps, self.fragments, self.max_outer_steps)
        try:
            return InnerSchedule(LrSchedule.COSINE, self.inner_warmup_steps, total, self.final_lr_fraction)
        except ValueError:
            raise ConfigError(
                f"--total-steps: must exceed --inner-warmup-steps ({self.inner_warmup_steps}), got {total}"
            ) from None

    @property
    def topk(self) -> int:
        """k of the top-k wire (`core/sparse.py`); 0 for a dense wire dtype."""
        return topk_layout.kept_per_chunk(self.topk_density) if self.wire_dtype == "topk" else 0

    @property
    def group_wire_dtype(self) -> str:
        """The wire dtype as groups name it: `topk<k>` for the top-k wire."""
        return topk_layout.wire_name(self.topk) if self.topk else self.wire_dtype

    @property
    def outer_step_lr(self) -> float:
        """--outer-lr, else the outer step's own default: DiLoCo's 0.7, the top-k wire's α = 2."""
        if self.outer_lr is not None:
            return self.outer_lr
        return TOPK_OUTER_LR if self.topk else DILOCO_OUTER_LR

    @property
    def round_tokens(self) -> int:
        """The most tokens a member's contribution may weigh in a round: --batch-size × --seq-len ×
        --inner-steps (a whole inner phase, fragments or not) × --max-ranks (a node of N ranks trains
        N batches a step). It enters the run digest, so every member of a run applies the same cap."""
        return self.batch_size * self.seq_len * self.inner_steps * self.max_ranks

    def round_steps(self, outer_step: int) -> int:
        """Inner steps of round `outer_step`: H, or about H/K with --fragments K (core/fragments.py)."""
        return round_steps(self.inner_steps, self.fragments, outer_step)

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def redacted(self) -> dict[str, Any]:
        """The config as JSON-able values, with the swarm token hidden."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "swarm_token" and value is not None:
                value = "***"
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def _check_combinations(cfg: NodeConfig) -> None:
    if not 3 <= cfg.shard_claim_ttl_s <= MAX_TTL_S:
        raise ConfigError(
            f"--shard-claim-ttl: must be in 3..{MAX_TTL_S:g} seconds, got {cfg.shard_claim_ttl_s:g}"
        )
    if cfg.shard is not None and cfg.shard >= cfg.num_shards:
        raise ConfigError(f"--shard: must be below --num-shards ({cfg.num_shards}), got {cfg.shard}")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("--tls-cert/--tls-key: give both or neither")
    for flag, value in (
        ("--matchmaking-timeout", cfg.matchmaking_timeout_s),
        ("--allreduce-timeout", cfg.allreduce_timeout_s),
    ):
        if value > MAX_TIMEOUT_S:
            raise ConfigError(f"{flag}: at most {MAX_TIMEOUT_S:g} seconds, got {value:g}")
    if cfg.precision == "fp16" and cfg.device == "cpu":
        raise ConfigError("--precision: fp16 needs a CUDA device (use bf16 or fp32 on cpu), got 'fp16'")
    if not cfg.max_norm_ratio > 1:
        raise ConfigError(f"--max-norm-ratio: must be above 1, got {cfg.max_norm_ratio:g}")
    _check_port_clashes(cfg)
    if cfg.topk and cfg.fragments > 1:
        raise ConfigError("--wire-dtype topk: its outer step takes all of Δ at once (no --fragments)")
    if cfg.fragments > cfg.inner_steps:  # every round must have an inner step
        raise ConfigError(f"--fragments: at most --inner-steps ({cfg.inner_steps}), got {cfg.fragments}")
    _check_schedule(cfg)
    _check_ranks(cfg)


def _check_ranks(cfg: NodeConfig) -> None:
    """What --nproc-per-node works with (the GPU count is checked at start-up, where it is known)."""
    if cfg.max_ranks > MAX_RANKS:
        raise ConfigError(f"--max-ranks: at most {MAX_RANKS}, got {cfg.max_ranks}")
    if cfg.nproc_per_node > cfg.max_ranks:
        raise ConfigError(
            f"--nproc-per-node: at most --max-ranks ({cfg.max_ranks}), the ranks a member of the run may "
            f"weigh as; got {cfg.nproc_per_node}"
        )
    if cfg.nproc_per_node > 1 and cfg.device.startswith("cuda:"):
        raise ConfigError(
            f"--nproc-per-node: rank k trains on GPU k; give --device cuda (or auto), not {cfg.device!r}"
        )
    if cfg.shard_model == "on" and cfg.nproc_per_node < 2:
        raise ConfigError(
            f"--shard-model: shards θ across the node's ranks; give --nproc-per-node 2 or more, got "
            f"{cfg.nproc_per_node}"
        )
    if cfg.shard_model == "on" and cfg.precision == "fp16":
        raise ConfigError(
            "--shard-model: fp16's grad scaler does not take sharded gradients; use bf16 or fp32"
        )


def _check_port_clashes(cfg: NodeConfig) -> None:
    """The TCP listeners (gRPC, metrics, bulk lanes) need ports of their own (the DHT's is UDP)."""
    tcp = (
        ("--grpc-port", cfg.grpc_port),
        ("--metrics-port", cfg.metrics_port),
        ("--bulk-port", cfg.bulk_port),
    )
    for i, (flag, port) in enumerate(tcp):
        for other, other_port in tcp[:i]:
            if port and port == other_port:
                raise ConfigError(f"{flag}: port {port} is also {other}'s; each listener needs its own port")


def _check_schedule(cfg: NodeConfig) -> None:
    if cfg.lr_schedule != LrSchedule.COSINE:
        return
    if cfg.total_steps is None and cfg.max_outer_steps is None:
        raise ConfigError("--lr-schedule: cosine needs --total-steps (or --max-outer-steps), got 'cosine'")
    _ = cfg.inner_schedule  # its end past its warm-up, or ConfigError


class FlagGroup(StrEnum):
    """What a user is doing when they reach for a flag: the sections of `run --help` and of
    docs/configuration.md, in this order (the common flags first)."""

    COMMON = "common"
    NETWORK = "network"
    TRAINING = "training"
    SNAPSHOTS = "snapshots"
    SWARM = "swarm"
    TRUST = "trust"
    OBSERVABILITY = "observability"

    @property
    def summary(self) -> str:
        return FLAG_GROUP_SUMMARIES[self]


FLAG_GROUP_SUMMARIES = {
    FlagGroup.COMMON: "the flags most runs set",
    FlagGroup.NETWORK: "where the node listens and how peers reach it",
    FlagGroup.TRAINING: "the model's inner and outer optimisation, the data's shards",
    FlagGroup.SNAPSHOTS: "hot and cold snapshots, retention, serving them to peers",
    FlagGroup.SWARM: "starting together, matchmaking, the all-reduce",
    FlagGroup.TRUST: "identity, TLS, the swarm token, robust aggregation",
    FlagGroup.OBSERVABILITY: "metrics, logs and progress lines",
}


@dataclass(frozen=True)
class Flag:
    """One `swarmnode run` option: its field, parser, one-line help, its group in `--help` and the docs,
    and `details` (docs/configuration.md only) for what the one line leaves out."""

    field: str
    parse: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    group: FlagGroup | None = None
    details: str = ""
    bare: str | None = None
    """The value the option means when given without one (`--shard-model` alone: on)."""

    @property
    def option(self) -> str:
        name = self.field.removesuffix("_s")
        return "--" + name.replace("_", "-")

    @property
    def env(self) -> str:
        return "SWARMNODE_" + self.option[2:].replace("-", "_").upper()


SWITCH_CHOICES = ("off", "on")
OVERLAP_CHOICES = SWITCH_CHOICES


FLAGS: tuple[Flag, ...] = (
    Flag(
        "peers",
        flag_values.peer_list,
        "comma-separated HOST:DHT_PORT of peers to bootstrap from; host names "
        "are resolved; none: this node starts a new swarm",
        metavar="HOST:PORT[,...]",
        group=FlagGroup.COMMON,
    ),
    Flag(
        "run_id",
        flag_values.run_id,
        "the training run this node joins; nodes only swarm within one run id",
        group=FlagGroup.COMMON,
    ),
    Flag(
        "data_dir", Path, "directory for snapshots, identity key, receipts and logs", group=FlagGroup.COMMON
    ),
    Flag("host", flag_values.host, "address to listen on (gRPC, DHT, metrics)", group=FlagGroup.NETWORK),
    Flag(
        "advertise_host",
        flag_values.host,
        "address peers should use to reach this node (default: --host, or "
        "127.0.0.1 when listening on all interfaces)",
        group=FlagGroup.NETWORK,
    ),
    Flag(
        "grpc_port",
        flag_values.port,
        "gRPC port for snapshots, status and averaging (0 = pick a free port)",
        group=FlagGroup.NETWORK,
    ),
    Flag(
        "dht_port",
        flag_values.port,
        "UDP port of the Kademlia DHT (0 = pick a free port)",
        group=FlagGroup.NETWORK,
    ),
    Flag(
        "metrics_port",
        flag_values.port,
        "Prometheus /metrics port (0 = pick a free port)",
        group=FlagGroup.OBSERVABILITY,
    ),
    Flag(
        "bulk_port",
        flag_values.bulk_port,
        "TCP port of the all-reduce's bulk lane, beside gRPC on plaintext swarms (0 = pick a free "
        "port; off = every byte over gRPC); a peer that cannot reach it uses gRPC",
        group=FlagGroup.NETWORK,
    ),
    Flag(
        "model",
        check_model_choice,
        "what to train: a GPT preset tiny (~0.5M params), small (~10M), base (~100M); "
        "hf:PATH, a local transformers causal LM (config or checkpoint dir); py:package.module:factory, "
        "your own nn.Module (docs/models.md)",
        metavar="tiny|small|base|hf:PATH|py:MOD:FN",
        group=FlagGroup.COMMON,
    ),
    Flag(
        "data",
        flag_values.non_empty,
        "training data: a directory made by `swarmnode data prepare`, a nanoGPT-style .bin of uint16 "
        "tokens, or a text file or directory (bytes); default: the shipped Shakespeare corpus",
        metavar="PATH",
        group=FlagGroup.COMMON,
    ),
    Flag(
        "device",
        check_device_choice,
        "where to train: auto picks cuda when available; cuda:N picks GPU N",
        metavar="auto|cpu|cuda|cuda:N",
        details="A GPU that is not there is refused at start-up (exit 2), `--dry-run` included.",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "precision",
        flag_values.choice(PRECISION_CHOICES),
        "autocast dtype of the inner step's forward pass; auto: bf16 on a GPU that has it, else fp32 "
        "(weights, optimizer state, Δ and θ_global stay fp32); must agree across the run",
        choices=PRECISION_CHOICES,
        details=(
            "fp16 scales the loss (`torch.amp.GradScaler`, its state in every snapshot) and needs a CUDA "
            "device; bf16 runs on the CPU too. A precision other than fp32 enters the run digest, so give "
            "it explicitly in a swarm that mixes GPUs and CPUs (auto resolves per machine). "
            'docs/design.md "Precision and the GPU path".'
        ),
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "nproc_per_node",
        flag_values.positive_int,
        "training processes (ranks) of this node, one per GPU: its inner steps run data parallel "
        "across them (NCCL on CUDA, gloo on the CPU), and it stays one swarm member",
        metavar="N",
        details=(
            "Rank 0 is the node's own process (the DHT, gRPC, the all-reduce, the outer step, snapshots); "
            "ranks 1..N−1 are its children, each with its own batch every step, gradients averaged "
            "across the ranks. The node's weight in a round is its ranks' tokens; every rank's cursor is "
            'in its snapshots. docs/design.md "Many GPUs in one node".'
        ),
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "shard_model",
        flag_values.choice(SWITCH_CHOICES),
        "on (or the flag alone): the node's ranks hold θ, its gradients and AdamW's moments in shards "
        "(FSDP2), for a model that does not fit one GPU; needs --nproc-per-node 2 or more",
        choices=SWITCH_CHOICES,
        bare="on",
        details=(
            "Each rank keeps 1/N of the training state on its device; rank 0 keeps a whole fp32 copy of θ "
            "and the moments on its host for Δ, the outer step, the held-out loss and snapshots, gathered "
            "from the shards after the inner phase and scattered back after the outer step. Node-local: "
            "not in the run digest, and its snapshots are any node's. fp16 is refused with it. "
            'docs/design.md "Sharded ranks".'
        ),
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "max_ranks",
        flag_values.positive_int,
        "the most ranks (--nproc-per-node) a member of the run may have: a member's weight in a round "
        "is capped at that many ranks' tokens (must agree across the run)",
        metavar="N",
        details=(
            "It scales the cap on a member's round weight (--batch-size × --seq-len × --inner-steps × N), "
            "so it enters the run digest; a run whose nodes all have one rank keeps the default 1."
        ),
        group=FlagGroup.TRUST,
    ),
    Flag(
        "threads",
        flag_values.positive_int,
        "CPU threads for torch (default: torch's own choice)",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "inner_steps",
        flag_values.positive_int,
        "H: the most inner AdamW steps per round (with --fragments K: per fragment; a round is H/K)",
        details=(
            "With `--fragments K`, H counts the steps between two outer steps of one fragment; a round is "
            "then about H/K steps."
        ),
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "inner_seconds",
        flag_values.positive_float,
        "optional time box of a round's inner phase, for slow volunteers (makes runs non-deterministic)",
        metavar="SECONDS",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "inner_lr",
        flag_values.positive_float,
        "inner AdamW learning rate (the schedule's peak)",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "lr_schedule",
        flag_values.choice(LR_SCHEDULES),
        "inner learning-rate schedule after the warm-up: constant, or cosine down to --final-lr-fraction of "
        "the peak at --total-steps",
        choices=LR_SCHEDULES,
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "inner_warmup_steps",
        flag_values.non_negative_int,
        "inner steps of linear learning-rate warm-up",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "total_steps",
        flag_values.positive_int,
        "inner steps the cosine schedule spans (default: --max-outer-steps × --inner-steps / --fragments; "
        "must agree across the run)",
        details="Give it explicitly in a swarm: every member must use the same value.",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "final_lr_fraction",
        flag_values.fraction,
        "where a cosine schedule ends, as a fraction of the peak (0: straight to zero; held after "
        "--total-steps; must agree across the run)",
        metavar="F",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "outer_lr",
        flag_values.positive_float,
        "outer learning rate: DiLoCo's Nesterov SGD, or α of the top-k wire's θ_g ← θ_g − α·mean(ĉ)",
        details=(
            f"Default {DILOCO_OUTER_LR} (DiLoCo), {TOPK_OUTER_LR:g} with `--wire-dtype topk` (SparseLoCo's "
            'outer step; its paper uses 1, 2 measured better here: docs/benchmarks.md "Top-k wire").'
        ),
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "outer_momentum",
        flag_values.fraction,
        "outer Nesterov momentum (not used by the top-k wire: its error feedback takes that part)",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "outer_mix",
        flag_values.mix,
        "α of the merge after each outer step, θ ← α·θ + (1−α)·θ_global (Streaming DiLoCo's mixing "
        "factor); 0: DiLoCo's θ ← θ_global",
        details='The default 0.3 ended lowest in `swarmnode bench quality` (docs/benchmarks.md "The merge").',
        group=FlagGroup.TRAINING,
    ),
    Flag("batch_size", flag_values.positive_int, "sequences per inner step", group=FlagGroup.TRAINING),
    Flag(
        "seq_len",
        flag_values.positive_int,
        "tokens per sequence (at most the model's context)",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "num_shards",
        flag_values.positive_int,
        "shards the training data is cut into (must agree across the run)",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "shard",
        flag_values.non_negative_int,
        "pin this node's shard (default: claim the least-claimed one in the DHT)",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "shard_claim_ttl_s",
        flag_values.positive_float,
        "seconds a stopped node's shard claim outlives it; then another node may take the shard over",
        metavar="SECONDS",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "hot_every",
        flag_values.positive_int,
        "inner steps between hot (speculative, background) snapshots",
        group=FlagGroup.SNAPSHOTS,
    ),
    Flag(
        "cold_every",
        flag_values.positive_int,
        "outer steps between cold (fsynced, kept longer) snapshots",
        group=FlagGroup.SNAPSHOTS,
    ),
    Flag("keep_hot", flag_values.positive_int, "hot snapshots kept on disk", group=FlagGroup.SNAPSHOTS),
    Flag("keep_cold", flag_values.positive_int, "cold snapshots kept on disk", group=FlagGroup.SNAPSHOTS),
    Flag(
        "layout",
        flag_values.choice(LAYOUTS),
        "snapshot tensor layout: planes (byte planes, smaller) or plain "
        "(zstd -d gives an ordinary safetensors file)",
        choices=LAYOUTS,
        group=FlagGroup.SNAPSHOTS,
    ),
    Flag("hot_level", flag_values.zstd_level, "zstd level of hot snapshots", group=FlagGroup.SNAPSHOTS),
    Flag("cold_level", flag_values.zstd_level, "zstd level of cold snapshots", group=FlagGroup.SNAPSHOTS),
    Flag(
        "max_outer_steps",
        flag_values.positive_int,
        "stop after this many outer steps (default: run until stopped)",
        group=FlagGroup.COMMON,
    ),
    Flag(
        "seed",
        flag_values.non_negative_int,
        "seed of the model's initialisation and data order (must agree across the run)",
        group=FlagGroup.TRAINING,
    ),
    Flag(
        "identity",
        Path,
        "the node's Ed25519 key file (default: DATA_DIR/identity.key, so wiping "
        "snapshots keeps the identity)",
        metavar="FILE",
        group=FlagGroup.TRUST,
    ),
    Flag(
        "log_format",
        flag_values.choice(LOG_FORMATS),
        "log and progress output: text or json",
        choices=LOG_FORMATS,
        group=FlagGroup.OBSERVABILITY,
    ),
    Flag(
        "progress_interval_s",
        flag_values.positive_float,
        "seconds between progress lines",
        metavar="SECONDS",
        group=FlagGroup.OBSERVABILITY,
    ),
    Flag(
        "wait_peers",
        flag_values.non_negative_int,
        "before training, wait until this many other members of the run are known, clients included "
        "(a swarm that starts together)",
        details=(
            "Counts the members that published their presence in the DHT, reachable nodes and clients alike."
        ),
        group=FlagGroup.SWARM,
    ),
    Flag(
        "wait_peers_timeout_s",
        flag_values.positive_float,
        "--wait-peers waits at most this long, then the node trains with the members it found and says so",
        metavar="SECONDS",
        group=FlagGroup.SWARM,
    ),
    Flag(
        "max_serving",
        flag_values.positive_int,
        "most concurrent snapshot streams served; the next gets RESOURCE_EXHAUSTED",
        group=FlagGroup.SNAPSHOTS,
    ),
    Flag(
        "max_serving_per_peer",
        flag_values.positive_int,
        "most concurrent snapshot streams served to one host (all of loopback is one host)",
        details="With mutual TLS a peer is the node id of its client certificate, else its host.",
        group=FlagGroup.SNAPSHOTS,
    ),
    Flag(
        "recovery_peers",
        flag_values.recovery_peers,
        "K: a recovering node fetches the swarm's shared state (global params, outer momentum) as "
        "verified ranges from up to K peers at once; 1: one whole snapshot from one peer",
        details=(
            "1-16. The inner moments come from one of the agreeing peers "
            '(docs/design.md "Recovery from many peers").'
        ),
        group=FlagGroup.SNAPSHOTS,
    ),
    Flag(
        "matchmaking_timeout_s",
        flag_values.positive_float,
        "seconds to wait for partners before an outer step goes on alone",
        metavar="SECONDS",
        details="At most 600 s.",
        group=FlagGroup.SWARM,
    ),
    Flag(
        "allreduce_timeout_s",
        flag_values.positive_float,
        "seconds an all-reduce may take before late parts are left out",
        metavar="SECONDS",
        details="At most 600 s; a proposed group with a longer budget is refused.",
        group=FlagGroup.SWARM,
    ),
    Flag(
        "wire_dtype",
        flag_values.choice(WIRE_DTYPES),
        "dtype of pseudo-gradients on the wire",
        choices=WIRE_DTYPES,
        group=FlagGroup.SWARM,
    ),
    Flag(
        "topk_density",
        flag_values.density,
        "with --wire-dtype topk: the share of the pseudo-gradient's entries sent each round",
        metavar="SHARE",
        details=(
            "In (0, 1]; every member of a run must use the same (it enters the run digest). "
            "The default 1% is about the most that sends 100× fewer bytes than fp32 in a group of 4 "
            '(docs/benchmarks.md "Top-k wire").'
        ),
        group=FlagGroup.SWARM,
    ),
    Flag(
        "ef_decay",
        flag_values.fraction,
        "with --wire-dtype topk: β of the error feedback e ← β·e + Δ (what was not sent, decayed each round)",
        metavar="BETA",
        group=FlagGroup.SWARM,
    ),
    Flag(
        "max_norm_ratio",
        flag_values.positive_float,
        "a contribution whose norm is over this many times its part's median is left out of the average",
        metavar="RATIO",
        details=(
            'The ratio is to the lower median of the part\'s contribution norms (docs/design.md "Trust").'
        ),
        group=FlagGroup.TRUST,
    ),
    Flag(
        "min_coverage",
        flag_values.fraction,
        "below this averaged fraction of the pseudo-gradient the outer step is skipped (local progress kept)",
        group=FlagGroup.SWARM,
    ),
    Flag(
        "reachable",
        flag_values.choice(REACHABLE_SETTINGS),
        "whether peers can dial this node: auto asks peers to dial it back; no: a client behind NAT "
        "(trains and averages, never reduces or serves)",
        choices=REACHABLE_SETTINGS,
        group=FlagGroup.NETWORK,
    ),
    Flag(
        "group_size",
        flag_values.group_size,
        "most members of one averaging group: a round this node leads with more members averages in "
        "groups of this size, then among their leaders (an exact two-level average)",
        details='2-256. docs/benchmarks.md "A swarm of N nodes" has the measurement behind the default.',
        group=FlagGroup.SWARM,
    ),
    Flag(
        "overlap",
        flag_values.choice(OVERLAP_CHOICES),
        "on: a round's all-reduce runs while the next inner phase trains, its outer step applied when "
        "it arrives",
        choices=OVERLAP_CHOICES,
        details=(
            'docs/design.md "Overlapped outer step" has the maths and why snapshots wait for the landing.'
        ),
        group=FlagGroup.SWARM,
    ),
    Flag(
        "fragments",
        flag_values.positive_int,
        "K: Δ cut into K equal flat ranges synchronised in turn, one per round of H/K inner steps (rounded "
        "down or up in turn when K does not divide H), so each all-reduce sends 1/K of Δ; at most "
        "--inner-steps; must agree across the run",
        details=(
            "Round r ends at inner step ⌊(r+1)·H/K⌋, so the peak bandwidth drops K×. K is part of the run "
            "digest; `--max-outer-steps`, `--cold-every` and `--inner-seconds` then count or time these "
            'fragment rounds (docs/design.md "Fragments").'
        ),
        group=FlagGroup.SWARM,
    ),
    Flag(
        "tls_cert",
        Path,
        "PEM certificate for gRPC TLS (with --tls-key)",
        metavar="FILE",
        group=FlagGroup.TRUST,
    ),
    Flag("tls_key", Path, "PEM private key for gRPC TLS", metavar="FILE", group=FlagGroup.TRUST),
    Flag(
        "tls_ca",
        Path,
        "PEM CA bundle: peers must present a certificate it signed",
        metavar="FILE",
        details=(
            "Mutual TLS: the CA is checked in the TLS handshake, and a node's own certificate must then name "
            "its node id as its common name (`swarmnode identity` prints it and writes a CSR)."
        ),
        group=FlagGroup.TRUST,
    ),
    Flag(
        "swarm_token",
        flag_values.non_empty,
        "shared secret every RPC must carry (never logged)",
        metavar="TOKEN",
        group=FlagGroup.TRUST,
    ),
)
FLAG_BY_FIELD = {f.field: f for f in FLAGS}
_METAVARS: dict[Callable[[str], Any], str] = {
    flag_values.positive_int: "N",
    flag_values.non_negative_int: "N",
    flag_values.group_size: "N",
    flag_values.recovery_peers: "K",
    flag_values.port: "PORT",
    flag_values.bulk_port: "PORT|off",
    flag_values.positive_float: "X",
    flag_values.fraction: "F",
    flag_values.mix: "F",
    flag_values.host: "HOST",
    flag_values.run_id: "NAME",
    flag_values.zstd_level: "LEVEL",
    Path: "DIR",
}
assert set(FLAG_BY_FIELD) == {f.name for f in dataclasses.fields(NodeConfig)}


RUN_USAGE = "swarmnode run [--peers HOST:PORT[,...]] [--model NAME] [--data PATH] [options]"


def build_run_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every NodeConfig flag (default None, so lower layers show through) plus --config/--dry-run,
    in argument groups (FlagGroup) with the common flags first."""
    sections = {group: parser.add_argument_group(group.value, group.summary) for group in FlagGroup}
    common = sections[FlagGroup.COMMON]
    common.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML file of flag values (keys as flag names, e.g. inner-steps = 100)",
    )
    common.add_argument(
        "--dry-run",
        action="store_true",
        help="run every start-up check (creating nothing), print the configuration as JSON and exit",
    )
    ungrouped = parser.add_argument_group("other")
    for flag in FLAGS:
        # The values are checked by `parse_flag` (so that a flag, its variable and its TOML key fail
        # alike), not by argparse: the metavar shows the choices.
        section = sections[flag.group] if flag.group is not None else ungrouped
        switch: dict[str, Any] = {"nargs": "?", "const": flag.bare} if flag.bare is not None else {}
        section.add_argument(
            flag.option, dest=flag.field, default=None, metavar=metavar(flag), help=help_text(flag), **switch
        )
    return parser


def help_text(flag: Flag) -> str:
    """The flag's help and its default (unless the help says it, or it is a secret). Its variable is
    not repeated: the parser's description says every flag has one (SWARMNODE_<NAME>)."""
    shown = (
        "" if "default:" in flag.help or flag.field == "swarm_token" else f" (default: {default_text(flag)})"
    )
    return f"{flag.help}{shown}"


def default_text(flag: Flag) -> str:
    """The flag's default as a person reads it ("none" where there is none)."""
    return _show(NodeConfig.__dataclass_fields__[flag.field].default)


def metavar(flag: Flag) -> str:
    """What `--help` shows for the flag's value: its choices, its own metavar, or its kind."""
    if flag.choices:
        return "{" + ",".join(flag.choices) + "}"
    return flag.metavar or _METAVARS.get(flag.parse, "VALUE")


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return "none" if value is None else str(value)


def load_config(
    cli_values: Mapping[str, Any], environ: Mapping[str, str], toml_path: Path | None
) -> NodeConfig:
    """Merge defaults < TOML < environment < command line into a validated NodeConfig."""
    values: dict[str, Any] = {}
    if toml_path is not None:
        values.update(_from_toml(toml_path))
    for flag in FLAGS:
        if flag.env in environ:
            values[flag.field] = parse_flag(flag, environ[flag.env], source=flag.env)
    for name, raw in cli_values.items():
        if raw is not None and name in FLAG_BY_FIELD:
            values[name] = parse_flag(FLAG_BY_FIELD[name], raw, source=FLAG_BY_FIELD[name].option)
    return NodeConfig(**values)


def parse_flag(flag: Flag, raw: Any, source: str) -> Any:
    """One flag's value from `source` (a flag, an environment variable, a TOML key); ConfigError."""
    text = ",".join(map(str, raw)) if isinstance(raw, list | tuple) else str(raw)
    if isinstance(raw, bool):
        raise ConfigError(f"{source}: expected a value, got {raw!r}")
    try:
        return flag.parse(text.strip())
    except ValueError as exc:
        reason = (
            str(exc)
            if not str(exc).startswith(("invalid literal", "could not convert"))
            else ("not a number")
        )
        raise ConfigError(f"{source}: {reason}, got {text!r}") from None


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config: {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config: {str(path)!r} is not valid TOML: {exc}") from None
    table = document.get("swarmnode", document)
    if not isinstance(table, dict):
        raise ConfigError(
            f"--config: 'swarmnode' in {str(path)!r} must be a table ([swarmnode]), got {table!r}"
        )
    values: dict[str, Any] = {}
    for key, raw in table.items():
        name = key.replace("-", "_")
        flag = FLAG_BY_FIELD.get(name) or FLAG_BY_FIELD.get(name + "_s")
        if flag is None:
            raise ConfigError(f"--config: unknown key {key!r} in {str(path)!r}")
        values[flag.field] = parse_flag(flag, raw, source=f"{path.name}:{key}")
    return values
