"""Node configuration: one frozen dataclass, filled from defaults < TOML file < SWARMNODE_* env < flags.

Every field of `NodeConfig` is one `swarmnode run` flag (the README's flag table), listed once in
`FLAGS`, so the parser, the environment twins, the TOML keys, `--help` and the README table cannot drift
apart.
Bad values raise `ConfigError` (a ValueError) whose message names the flag and the value; the CLI prints
it as one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmnode.core.fragments import round_steps, steps_in_rounds
from swarmnode.core.model_choice import check_model_choice
from swarmnode.core.schedule import DEFAULT_FINAL_FRACTION, LR_SCHEDULES, InnerSchedule, LrSchedule
from swarmnode.snapshot.format import LAYOUTS
from swarmnode.swarm.grouping import MIN_GROUP_SIZE
from swarmnode.swarm.matchmaking import DEFAULT_GROUP_SIZE
from swarmnode.swarm.trust import DEFAULT_MAX_NORM_RATIO
from swarmnode.swarm.wire import MAX_GROUP_SIZE, MAX_TIMEOUT_S, WIRE_DTYPES
from swarmnode.util.errors import ConfigError
from swarmnode.util.validate import parse_host_port

DEVICES = ("auto", "cpu", "cuda")
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
    threads: int | None = None
    inner_steps: int = 500
    inner_seconds: float | None = None
    inner_lr: float = 1e-3
    lr_schedule: str = "constant"
    inner_warmup_steps: int = 0
    total_steps: int | None = None
    final_lr_fraction: float = DEFAULT_FINAL_FRACTION
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_mix: float = 0.3
    batch_size: int = 8
    seq_len: int = 128
    num_shards: int = 16
    shard: int | None = None
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
    if not cfg.max_norm_ratio > 1:
        raise ConfigError(f"--max-norm-ratio: must be above 1, got {cfg.max_norm_ratio:g}")
    _check_port_clashes(cfg)
    if cfg.fragments > cfg.inner_steps:  # every round must have an inner step
        raise ConfigError(f"--fragments: at most --inner-steps ({cfg.inner_steps}), got {cfg.fragments}")
    _check_schedule(cfg)


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


# ----- value parsers: each returns the value or raises ValueError with the reason -----


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be a positive integer")
    return value


def _group_size(text: str) -> int:
    value = int(text)
    if not MIN_GROUP_SIZE <= value <= MAX_GROUP_SIZE:
        raise ValueError(f"must be in {MIN_GROUP_SIZE}..{MAX_GROUP_SIZE}")
    return value


MAX_RECOVERY_PEERS = 16


def _recovery_peers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_RECOVERY_PEERS:
        raise ValueError(f"must be in 1..{MAX_RECOVERY_PEERS}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be ≥ 0")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number 0-65535 (0 = pick a free port)")
    return value


def _bulk_port(text: str) -> int | None:
    if text == "off":
        return None
    try:
        return _port(text)
    except ValueError:
        raise ValueError("must be a port number 0-65535 (0 = pick a free port) or off") from None


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a positive number")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be between 0 and 1")
    return value


def _mix(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError("must be at least 0 and below 1")
    return value


def _peer_list(text: str) -> tuple[str, ...]:
    peers = tuple(p.strip() for p in text.split(",") if p.strip())
    for peer in peers:
        parse_host_port(peer)
    return peers


def _host(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("must be a host name or IP address")
    try:
        ipaddress.ip_address(text)
    except ValueError:
        if not all(part.replace("-", "").replace("_", "").isalnum() for part in text.split(".")):
            raise ValueError("must be a host name or IP address") from None
    return text


def _run_id(text: str) -> str:
    if not text or len(text) > 64 or not all(c.isalnum() or c in "-_." for c in text):
        raise ValueError("must be 1-64 characters of letters, digits, '-', '_' or '.'")
    return text


def _zstd_level(text: str) -> int:
    value = int(text)
    if not -7 <= value <= 19:
        raise ValueError("must be a zstd level between -7 and 19")
    return value


def _non_empty(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return text


@dataclass(frozen=True)
class Flag:
    """One `swarmnode run` option: its field, parser, help, and the issue it lands with."""

    field: str
    parse: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def option(self) -> str:
        name = self.field.removesuffix("_s")
        return "--" + name.replace("_", "-")

    @property
    def env(self) -> str:
        return "SWARMNODE_" + self.option[2:].replace("-", "_").upper()


OVERLAP_CHOICES = ("off", "on")


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError("must be one of " + "|".join(choices))
        return text

    return parse


FLAGS: tuple[Flag, ...] = (
    Flag(
        "peers",
        _peer_list,
        "comma-separated HOST:DHT_PORT of peers to bootstrap from; host names "
        "are resolved; none: this node starts a new swarm",
        metavar="HOST:PORT[,...]",
    ),
    Flag("run_id", _run_id, "the training run this node joins; nodes only swarm within one run id"),
    Flag("data_dir", Path, "directory for snapshots, identity key, receipts and logs"),
    Flag("host", _host, "address to listen on (gRPC, DHT, metrics)"),
    Flag(
        "advertise_host",
        _host,
        "address peers should use to reach this node (default: --host, or "
        "127.0.0.1 when listening on all interfaces)",
    ),
    Flag("grpc_port", _port, "gRPC port for snapshots, status and averaging (0 = pick a free port)"),
    Flag("dht_port", _port, "UDP port of the Kademlia DHT (0 = pick a free port)"),
    Flag("metrics_port", _port, "Prometheus /metrics port (0 = pick a free port)"),
    Flag(
        "bulk_port",
        _bulk_port,
        "TCP port of the all-reduce's bulk lane, beside gRPC on plaintext swarms (0 = pick a free "
        "port; off = every byte over gRPC); a peer that cannot reach it uses gRPC",
    ),
    Flag(
        "model",
        check_model_choice,
        "what to train: a GPT preset tiny (~0.5M params), small (~10M), base (~100M); "
        "hf:PATH, a local transformers causal LM (config or checkpoint dir); py:package.module:factory, "
        "your own nn.Module (docs/models.md)",
        metavar="tiny|small|base|hf:PATH|py:MOD:FN",
    ),
    Flag(
        "data",
        _non_empty,
        "training data: a nanoGPT-style .bin of uint16 tokens, or a text file or "
        "directory (bytes); default: the Python standard library's own sources",
        metavar="PATH",
    ),
    Flag("device", _choice(DEVICES), "where to train; auto picks cuda when available", choices=DEVICES),
    Flag("threads", _positive_int, "CPU threads for torch (default: torch's own choice)"),
    Flag(
        "inner_steps",
        _positive_int,
        "H: the most inner AdamW steps per round (with --fragments K: per fragment; a round is H/K)",
    ),
    Flag(
        "inner_seconds",
        _positive_float,
        "optional time box of a round's inner phase, for slow volunteers (makes runs non-deterministic)",
        metavar="SECONDS",
    ),
    Flag("inner_lr", _positive_float, "inner AdamW learning rate (the schedule's peak)"),
    Flag(
        "lr_schedule",
        _choice(LR_SCHEDULES),
        "inner learning-rate schedule after the warm-up: constant, or cosine down to --final-lr-fraction of "
        "the peak at --total-steps",
        choices=LR_SCHEDULES,
    ),
    Flag("inner_warmup_steps", _non_negative_int, "inner steps of linear learning-rate warm-up"),
    Flag(
        "total_steps",
        _positive_int,
        "inner steps the cosine schedule spans (default: --max-outer-steps × --inner-steps / --fragments; "
        "must agree across the run)",
    ),
    Flag(
        "final_lr_fraction",
        _fraction,
        "where a cosine schedule ends, as a fraction of the peak (0: straight to zero; held after "
        "--total-steps; must agree across the run)",
        metavar="F",
    ),
    Flag("outer_lr", _positive_float, "outer SGD (Nesterov) learning rate"),
    Flag("outer_momentum", _fraction, "outer Nesterov momentum"),
    Flag(
        "outer_mix",
        _mix,
        "α of the merge after each outer step, θ ← α·θ + (1−α)·θ_global (Streaming DiLoCo's mixing "
        "factor); 0: DiLoCo's θ ← θ_global",
    ),
    Flag("batch_size", _positive_int, "sequences per inner step"),
    Flag("seq_len", _positive_int, "tokens per sequence (at most the model's context)"),
    Flag("num_shards", _positive_int, "shards the training data is cut into (must agree across the run)"),
    Flag("shard", _non_negative_int, "this node's shard (default: chosen from the node id)"),
    Flag("hot_every", _positive_int, "inner steps between hot (speculative, background) snapshots"),
    Flag("cold_every", _positive_int, "outer steps between cold (fsynced, kept longer) snapshots"),
    Flag("keep_hot", _positive_int, "hot snapshots kept on disk"),
    Flag("keep_cold", _positive_int, "cold snapshots kept on disk"),
    Flag(
        "layout",
        _choice(LAYOUTS),
        "snapshot tensor layout: planes (byte planes, smaller) or plain "
        "(zstd -d gives an ordinary safetensors file)",
        choices=LAYOUTS,
    ),
    Flag("hot_level", _zstd_level, "zstd level of hot snapshots"),
    Flag("cold_level", _zstd_level, "zstd level of cold snapshots"),
    Flag("max_outer_steps", _positive_int, "stop after this many outer steps (default: run until stopped)"),
    Flag(
        "seed",
        _non_negative_int,
        "seed of the model's initialisation and data order (must agree across the run)",
    ),
    Flag(
        "identity",
        Path,
        "the node's Ed25519 key file (default: DATA_DIR/identity.key, so wiping "
        "snapshots keeps the identity)",
        metavar="FILE",
    ),
    Flag("log_format", _choice(LOG_FORMATS), "log and progress output: text or json", choices=LOG_FORMATS),
    Flag("progress_interval_s", _positive_float, "seconds between progress lines", metavar="SECONDS"),
    Flag(
        "wait_peers",
        _non_negative_int,
        "before training, wait until this many other members of the run are known, clients included "
        "(a swarm that starts together)",
    ),
    Flag(
        "wait_peers_timeout_s",
        _positive_float,
        "--wait-peers waits at most this long, then the node trains with the members it found and says so",
        metavar="SECONDS",
    ),
    Flag(
        "max_serving",
        _positive_int,
        "most concurrent snapshot streams served; the next gets RESOURCE_EXHAUSTED",
    ),
    Flag(
        "max_serving_per_peer",
        _positive_int,
        "most concurrent snapshot streams served to one host (all of loopback is one host)",
    ),
    Flag(
        "recovery_peers",
        _recovery_peers,
        "K: a recovering node fetches the swarm's shared state (global params, outer momentum) as "
        "verified ranges from up to K peers at once; 1: one whole snapshot from one peer",
    ),
    Flag(
        "matchmaking_timeout_s",
        _positive_float,
        "seconds to wait for partners before an outer step goes on alone",
        metavar="SECONDS",
    ),
    Flag(
        "allreduce_timeout_s",
        _positive_float,
        "seconds an all-reduce may take before late parts are left out",
        metavar="SECONDS",
    ),
    Flag("wire_dtype", _choice(WIRE_DTYPES), "dtype of pseudo-gradients on the wire", choices=WIRE_DTYPES),
    Flag(
        "max_norm_ratio",
        _positive_float,
        "a contribution whose norm is over this many times its part's median is left out of the average",
        metavar="RATIO",
    ),
    Flag(
        "min_coverage",
        _fraction,
        "below this averaged fraction of the pseudo-gradient the outer step is skipped (local progress kept)",
    ),
    Flag(
        "reachable",
        _choice(REACHABLE_SETTINGS),
        "whether peers can dial this node: auto asks peers to dial it back; no: a client behind NAT "
        "(trains and averages, never reduces or serves)",
        choices=REACHABLE_SETTINGS,
    ),
    Flag(
        "group_size",
        _group_size,
        "most members of one averaging group: a round this node leads with more members averages in "
        "groups of this size, then among their leaders (an exact two-level average)",
    ),
    Flag(
        "overlap",
        _choice(OVERLAP_CHOICES),
        "on: a round's all-reduce runs while the next inner phase trains, its outer step applied when "
        "it arrives (README: overlapped outer step)",
        choices=OVERLAP_CHOICES,
    ),
    Flag(
        "fragments",
        _positive_int,
        "K: Δ cut into K equal flat ranges synchronised in turn, one per round of H/K inner steps (rounded "
        "down or up in turn when K does not divide H), so each all-reduce sends 1/K of Δ (README: "
        "fragments); at most --inner-steps; must agree across the run",
    ),
    Flag("tls_cert", Path, "PEM certificate for gRPC TLS (with --tls-key)", metavar="FILE"),
    Flag("tls_key", Path, "PEM private key for gRPC TLS", metavar="FILE"),
    Flag("tls_ca", Path, "PEM CA bundle: peers must present a certificate it signed", metavar="FILE"),
    Flag("swarm_token", _non_empty, "shared secret every RPC must carry (never logged)", metavar="TOKEN"),
)
FLAG_BY_FIELD = {f.field: f for f in FLAGS}
assert set(FLAG_BY_FIELD) == {f.name for f in dataclasses.fields(NodeConfig)}


def build_run_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every NodeConfig flag (default None, so lower layers show through) plus --config/--dry-run."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML file of flag values (keys as flag names, e.g. inner-steps = 100)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every start-up check (creating nothing), print the configuration as JSON and exit",
    )
    for flag in FLAGS:
        # The values are checked by `parse_flag` (so that a flag, its variable and its TOML key fail
        # alike), not by argparse: the metavar shows the choices.
        metavar = "{" + ",".join(flag.choices) + "}" if flag.choices else flag.metavar
        parser.add_argument(
            flag.option, dest=flag.field, default=None, metavar=metavar, help=_help_text(flag)
        )
    return parser


def _help_text(flag: Flag) -> str:
    """The flag's help, its default (unless the help says it, or it is a secret) and its variable."""
    default = NodeConfig.__dataclass_fields__[flag.field].default
    shown = "" if "default:" in flag.help or flag.field == "swarm_token" else f" (default: {_show(default)})"
    return f"{flag.help}{shown}; env {flag.env}"


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
