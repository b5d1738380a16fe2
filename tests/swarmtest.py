"""Helpers for tests that run real `swarmnode run` processes on 127.0.0.1.

`NodeProcess` starts one node with free ports (port 0), waits for its DATA_DIR/node.json, and is always
killed by the `reaper` fixture, so no test leaves a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmnode.bench_procs import child_env
from swarmnode.bench_procs import wait_until as wait_for
from swarmnode.config import LOOPBACK_ARGS

TINY_ARGS = (
    "--model",
    "tiny",
    "--threads",
    "1",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    *LOOPBACK_ARGS,
    "--progress-interval",
    "3600",
)


class NodeProcess:
    """A `swarmnode run` child with its own data dir and log file."""

    def __init__(
        self,
        data_dir: Path,
        args: Sequence[str],
        faults: str | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", NAME]: run the node in a namespace
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.args = [*TINY_ARGS, "--data-dir", str(self.data_dir), *args]
        self.env = {**child_env(), **(env or {})}  # no SWARMNODE_* setting of the developer's leaks in
        if faults:
            self.env["SWARMNODE_FAULTS"] = faults
        self.log_path = self.data_dir / f"node-{int(time.time() * 1000)}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def restart(self, faults: str | None = None) -> NodeProcess:
        """Start again with the same arguments (and these faults, by default none)."""
        self.env.pop("SWARMNODE_FAULTS", None)
        if faults:
            self.env["SWARMNODE_FAULTS"] = faults
        return self.start()

    def start(self) -> NodeProcess:
        (self.data_dir / "node.json").unlink(missing_ok=True)
        log = self.log_path.open("ab")  # restarts append to the same log
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "swarmnode.cli", "run", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def info(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "node.json").read_text())

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        def ready() -> bool:
            self._check_alive()
            return (self.data_dir / "node.json").exists()

        wait_for(ready, timeout_s, f"node in {self.data_dir} to start")
        return self.info

    def wait_nowait(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP), from /proc."""
        assert self.proc is not None
        try:
            return (Path("/proc") / str(self.proc.pid) / "stat").read_text().split()[2] == "T"
        except OSError:
            return False

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"node exited with {self.proc.returncode}:\n{self.log()[-4000:]}")

    def wait(self, timeout_s: float = 120.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node did not exit within {timeout_s} s:\n{self.log()[-4000:]}") from None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def grpc_address(self) -> str:
        return f"{self.info['host']}:{self.info['grpc_port']}"


class ProcessReaper:
    """Collects processes and kills whatever is still alive at the end of a test."""

    def __init__(self) -> None:
        self.nodes: list[NodeProcess] = []

    def node(
        self,
        data_dir: Path,
        args: Sequence[str],
        faults: str | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> NodeProcess:
        node = NodeProcess(data_dir, args, faults, env, prefix)
        self.nodes.append(node)
        return node

    def kill_all(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):  # best effort: every node gets its kill
                node.kill()


def newest_snapshot(data_dir: Path) -> Path:
    from swarmnode.snapshot import iter_snapshot_files

    files = list(iter_snapshot_files(Path(data_dir) / "snapshots"))
    assert files, f"no snapshot in {data_dir}"
    return files[0]


def start_swarm(
    reaper: ProcessReaper,
    base: Path,
    count: int,
    args: Sequence[str],
    faults: Sequence[str | None] | None = None,
    extra: Sequence[Sequence[str]] | None = None,
) -> list[NodeProcess]:
    """`count` nodes on loopback: the first starts the swarm, the others bootstrap from its DHT port.
    `faults[i]` and `extra[i]` (more flags) apply to node i."""
    faults = faults or [None] * count
    extra = extra or [()] * count
    first = reaper.node(base / "n0", [*args, *extra[0]], faults[0]).start()
    dht_port = first.wait_ready()["dht_port"]
    nodes = [first]
    for i in range(1, count):
        peer_args = [*args, *extra[i], "--peers", f"127.0.0.1:{dht_port}"]
        nodes.append(reaper.node(base / f"n{i}", peer_args, faults[i]).start())
    for node in nodes[1:]:
        node.wait_ready()
    return nodes


def node_status(node: NodeProcess) -> dict[str, Any]:
    """`swarmnode status --json` of a running node."""
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "status", node.grpc_address, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def scrape(node: NodeProcess) -> str:
    import urllib.request

    url = f"http://{node.info['host']}:{node.info['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """A sample's value from a Prometheus exposition (0 when absent)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def first_agreed_round(rounds: dict[int, dict[str, str]], count: int, after: int) -> int | None:
    """The first outer step past `after` at which `count` nodes recorded one and the same global
    digest; `rounds` is outer step -> {node: digest}."""
    for outer, digests in sorted(rounds.items()):
        if outer > after and len(digests) == count and len(set(digests.values())) == 1:
            return outer
    return None


def stop_all(nodes: Sequence[NodeProcess], timeout_s: float = 60) -> None:
    """SIGTERM every node at once, then each must exit 0 (a clean stop: final snapshot, DHT left)."""
    for node in nodes:
        node.signal(signal.SIGTERM)
    for node in nodes:
        assert node.wait(timeout_s) == 0, node.log()[-2000:]


def assert_ledgers_replay(nodes: Sequence[NodeProcess]) -> None:
    """Every node's ledger replays as one chain (no batch counted twice or skipped), no chain keeps a
    round whose average another member recorded without it (`ledger.cross_check`), and the swarm's
    newest model records each node at a point of its chain: it holds exactly a prefix of it."""
    from swarmnode.ledger import check, cross_check, read_ledger
    from swarmnode.snapshot import parse_snapshot_name
    from swarmnode.snapshot_read import read_header

    newest = max((newest_snapshot(n.data_dir) for n in nodes), key=lambda p: parse_snapshot_name(p.name)[1:3])
    lineage = read_header(newest).metadata["swarm_cursors"]
    ledgers = {node.info["node_id"]: read_ledger(node.data_dir) for node in nodes}
    assert not (violations := cross_check(ledgers)), violations
    for node in nodes:
        report = check(read_ledger(node.data_dir))
        assert not report.errors, f"{node.data_dir.name}: {report.errors}"
        record = lineage.get(node.info["node_id"])
        assert record is not None, f"{node.data_dir.name}: the swarm's newest model has no record of it"
        point = (record["shard"], record["epoch"], record["position"])
        points = {end for _, end in report.chain} | {report.anchor}
        assert point in points, f"{node.data_dir.name}: the model holds it up to {point}, not a chain point"


def sound_file(
    directory: Path, document: dict[str, Any], kind: str, outer_step: int, data: bytes = b""
) -> Path:
    """A 'sound' snapshot file: a valid zstd stream of a safetensors container with whatever header
    `document` says, named after its own sha256 (so every hash check passes) — what a crafter makes."""
    import hashlib
    import struct

    import zstandard

    from swarmnode.snapshot import snapshot_file_name

    header = json.dumps(document).encode()
    blob = zstandard.ZstdCompressor().compress(struct.pack("<Q", len(header)) + header + data)
    path = Path(directory) / snapshot_file_name(kind, outer_step, 0, hashlib.sha256(blob).hexdigest())
    path.write_bytes(blob)
    return path


def with_metadata(
    path: Path, changes: dict[str, Any], outer_step: int | None = None, keep_original: bool = False
) -> Path:
    """A snapshot file like `path` (which is removed unless `keep_original`) whose JSON metadata has
    `changes` (and, with `outer_step`, whose name claims that step), named after its new sha256: it
    passes every hash check."""
    import hashlib
    import struct

    import zstandard

    from swarmnode.snapshot import parse_snapshot_name, snapshot_file_name

    with path.open("rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    metadata = {**json.loads(header["__metadata__"]["swarmnode"]), **changes}
    header["__metadata__"]["swarmnode"] = json.dumps(metadata)
    encoded = json.dumps(header).encode()
    blob = zstandard.ZstdCompressor().compress(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])
    kind, outer, inner, _ = parse_snapshot_name(path.name)  # type: ignore[misc]
    outer = outer if outer_step is None else outer_step
    crafted = path.with_name(snapshot_file_name(kind, outer, inner, hashlib.sha256(blob).hexdigest()))
    crafted.write_bytes(blob)
    if not keep_original:
        path.unlink()
    return crafted
