"""What a node checks before anything listens, and its hold on its data dir.

`preflight` runs every start-up check with no side effect (a real start and `--dry-run` both run it):
the data dir (writable, not in use by another node), the identity, the listening host and ports, TLS,
the device, the corpus and the model; each failure is one line naming the flag and the value
(ConfigError: exit 2). `lock_data_dir` takes the data dir for the process's life: two processes never
share one. `FreshDataDir` undoes what a start created in a data dir when it fails before training
(a check that needs the node's key, a port taken between the check and the bind).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmnode.core.data import Corpus, ShardLoader, load_corpus
from swarmnode.core.model import select_device
from swarmnode.core.model_spec import ModelSpec, load_model_spec
from swarmnode.core.precision import Precision, resolve_precision
from swarmnode.net.identity import Identity
from swarmnode.net.security import Security
from swarmnode.node.config import NodeConfig
from swarmnode.util.errors import ConfigError

LOCK_FILE = "node.lock"
"""DATA_DIR/node.lock: the running node's pid, under an exclusive flock while it runs."""


@dataclass(frozen=True)
class StartChecks:
    """What the start-up checks loaded on the way; `Node.build` goes on from it."""

    corpus: Corpus
    model: ModelSpec
    device: torch.device
    precision: Precision
    """--precision resolved for `device` (auto: bf16 on a GPU that has it, else fp32)."""
    security: Security


def preflight(cfg: NodeConfig) -> StartChecks:
    """Every check a start makes before anything listens, with no side effect (`--dry-run` runs it
    too): the data dir, the identity file, the listening host, the TLS files, the device and its
    precision, the corpus, the model (and its context) and the shard loader. Raises ValueError
    (ConfigError or the loader's own, each one line naming the flag and the value) for the first that
    fails."""
    _check_writable_dir(cfg.data_dir, "--data-dir")
    _check_writable_dir(cfg.snapshot_dir, "--data-dir", cfg.data_dir)
    _check_not_locked(cfg.data_dir)
    _check_identity_file(cfg)
    _check_bindable(cfg.host)
    security = Security.from_files(cfg.swarm_token, cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    _check_ports(cfg, bulk_lanes=not security.tls)
    device = select_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    check_gpu_count(cfg.nproc_per_node, device)
    try:
        corpus = load_corpus(cfg.data)
    except OSError as exc:
        raise ConfigError(f"--data: cannot read it ({exc.strerror}), got {cfg.data!r}") from None
    model = load_model_spec(cfg.model, corpus.vocab_size)
    if model.context is not None and cfg.seq_len > model.context:
        raise ConfigError(
            f"--seq-len: at most the context {model.context} of --model {cfg.model}, got {cfg.seq_len}"
        )
    # Every shard has the same length, so the node's own (not known before its key exists) builds too.
    ShardLoader(corpus, cfg.shard or 0, cfg.num_shards, cfg.batch_size, cfg.seq_len, cfg.seed)
    return StartChecks(corpus, model, device, precision, security)


def check_gpu_count(nproc_per_node: int, device: torch.device) -> None:
    """On CUDA every rank needs a GPU of its own."""
    if device.type == "cuda" and nproc_per_node > (count := torch.cuda.device_count()):
        raise ConfigError(
            f"--nproc-per-node: one GPU per rank, and this machine has {count}, got {nproc_per_node}"
        )


def exposure_warning(cfg: NodeConfig) -> str | None:
    """One line when the node will serve beyond this machine (a `--host` that is not loopback) with
    neither a swarm token nor TLS: anyone who reaches its ports can then read its whole training state
    and join its averaging. None otherwise."""
    if cfg.swarm_token is not None or cfg.tls_cert is not None or _loopback_only(cfg.host):
        return None
    return (
        f"serving on {cfg.host} with neither --swarm-token nor --tls-cert: anyone who reaches this node's "
        "ports can read its training state and join its averaging"
    )


def _loopback_only(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


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


def _check_ports(cfg: NodeConfig, bulk_lanes: bool) -> None:
    """Every fixed port the node will listen on is free now (port 0 is picked at bind time): each is
    bound by a probe socket, closed at once. The servers' own binds still name the flag if a port is
    taken between this check and them."""
    wanted = [
        ("--grpc-port", cfg.grpc_port, socket.SOCK_STREAM),
        ("--metrics-port", cfg.metrics_port, socket.SOCK_STREAM),
        ("--dht-port", cfg.dht_port, socket.SOCK_DGRAM),
    ]
    if bulk_lanes and cfg.bulk_port is not None:  # (no lanes on a TLS swarm: `services.py`)
        wanted.append(("--bulk-port", cfg.bulk_port, socket.SOCK_STREAM))
    family, _, _, _, address = _resolve("--host", cfg.host, passive=True)
    for flag, port, kind in wanted:
        if port:
            _probe_port(flag, family, kind, (address[0], port, *address[2:]), cfg.host)


def _probe_port(flag: str, family: int, kind: int, address: tuple[Any, ...], host: str) -> None:
    with socket.socket(family, kind) as probe:
        if kind == socket.SOCK_STREAM:  # as the servers do: a port in TIME_WAIT is not in use
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            reason = {errno.EADDRINUSE: "is already in use", errno.EACCES: "may not be bound by this user"}
            refusal = reason.get(exc.errno or 0, f"cannot be bound ({exc.strerror})")
            raise ConfigError(f"{flag}: port {address[1]} on {host} {refusal}") from None


def _check_not_locked(data_dir: Path) -> None:
    """No running node holds the data dir's lock (checked without creating or taking it)."""
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return  # no lock file (or no dir yet): nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise ConfigError(
            f"--data-dir: in use by another swarmnode process (pid {holder}), got {str(data_dir)!r}"
        ) from None
    finally:
        os.close(fd)  # (closing drops a shared lock taken here)


@dataclass(frozen=True)
class FreshDataDir:
    """What a data dir held before a start: `undo` removes what the start created, when it fails
    before training (never a key or directory that was there before, never a non-empty directory)."""

    data_dir: Path
    created: tuple[Path, ...]
    """Paths absent before the start that it may create, deepest first."""

    @classmethod
    def note(cls, cfg: NodeConfig) -> FreshDataDir:
        candidates = [cfg.identity_path, cfg.data_dir / LOCK_FILE, cfg.data_dir / "node.json"]
        candidates += [cfg.snapshot_dir, cfg.data_dir]
        return cls(cfg.data_dir, tuple(p for p in candidates if not p.exists()))

    def undo(self) -> None:
        for path in self.created:
            with contextlib.suppress(OSError):  # a directory the start filled: kept
                path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)


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
