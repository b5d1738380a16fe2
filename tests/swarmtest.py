"""Helpers for tests that run real `swarmnode run` processes on 127.0.0.1.

`NodeProcess` (the package's one child-process harness, `swarmnode.bench.procs`, with the tests' tiny
settings) starts one node with free ports (port 0), waits for its DATA_DIR/node.json, and is always
killed by the `reaper` fixture, so no test leaves a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from swarmnode.bench import procs
from swarmnode.bench.procs import LOOPBACK_ARGS
from swarmnode.net.identity import Identity

wait_for = procs.wait_until
"""The one poll helper, as the tests call it."""
metric_value = procs.metric_value
"""A sample's value from a Prometheus exposition (0 when absent)."""

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


class NodeProcess(procs.NodeProcess):
    """A `swarmnode run` child of the shared harness with the tests' tiny, fast settings."""

    def __init__(
        self,
        data_dir: Path,
        args: Sequence[str],
        faults: str | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        super().__init__(data_dir, args, faults=faults, env=env, prefix=prefix, base_args=TINY_ARGS)

    def wait_nowait(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return self.exit_code()


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


def identity_file(tmp_path_factory: Any) -> Path:
    """A fresh node identity key in its own temporary directory, for runs that must share one node id."""
    key = Path(tmp_path_factory.mktemp("identity")) / "node.key"
    Identity.load_or_create(key)
    return key


def newest_snapshot(data_dir: Path) -> Path:
    from swarmnode.snapshot.format import iter_snapshot_files

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
    env: dict[str, str] | None = None,
) -> list[NodeProcess]:
    """`count` nodes on loopback: the first starts the swarm, the others bootstrap from its DHT port.
    `faults[i]` and `extra[i]` (more flags) apply to node i, `env` to all."""
    faults = faults or [None] * count
    extra = extra or [()] * count
    first = reaper.node(base / "n0", [*args, *extra[0]], faults[0], env).start()
    dht_port = first.wait_ready()["dht_port"]
    nodes = [first]
    for i in range(1, count):
        peer_args = [*args, *extra[i], "--peers", f"127.0.0.1:{dht_port}"]
        nodes.append(reaper.node(base / f"n{i}", peer_args, faults[i], env).start())
    for node in nodes[1:]:
        node.wait_ready()
    return nodes


def node_status(node: NodeProcess, prefix: Sequence[str] = ()) -> dict[str, Any]:
    """`swarmnode status --json` of a running node, the call run through `prefix` (e.g. `ip netns
    exec NAME`: from inside a namespace, where a call from outside would be a dial)."""
    out = subprocess.run(
        [*prefix, sys.executable, "-m", "swarmnode.cli", "status", node.grpc_address, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def scrape(node: NodeProcess) -> str:
    return node.metrics()


def cold_metadata(node: NodeProcess) -> dict[int, dict[str, Any]]:
    """outer step -> metadata of the node's cold snapshot written right after that outer step."""
    from swarmnode.snapshot.format import iter_snapshot_files, parse_snapshot_name
    from swarmnode.snapshot.read import read_header

    found = {}
    for path in iter_snapshot_files(node.data_dir / "snapshots"):
        kind, outer, _, _ = parse_snapshot_name(path.name)  # type: ignore[misc]
        if kind == "cold":
            found[outer] = read_header(path).metadata
    return found


def first_agreed_round(rounds: dict[int, dict[str, str]], count: int, after: int) -> int | None:
    """The first outer step past `after` at which `count` nodes recorded one and the same global
    digest; `rounds` is outer step -> {node: digest}."""
    for outer, digests in sorted(rounds.items()):
        if outer > after and len(digests) == count and len(set(digests.values())) == 1:
            return outer
    return None


def stop_all(nodes: Sequence[NodeProcess], timeout_s: float = 60) -> None:
    """SIGTERM every node at once, then each must exit 0 (a clean stop: final snapshot, DHT left)
    within `timeout_s` of the signal (else it is killed: -9)."""
    for node, code in zip(nodes, procs.stop_all(nodes, timeout_s), strict=True):
        assert code == 0, f"{node.data_dir.name} exited with {code}:\n{node.log()[-2000:]}"


def assert_ledgers_replay(nodes: Sequence[NodeProcess]) -> None:
    """Every node's ledger replays as one chain (no batch counted twice or skipped), no chain keeps a
    round whose average another member recorded without it (`ledger.cross_check`), and the swarm's
    newest model records each node at a point of its chain: it holds exactly a prefix of it."""
    from swarmnode.core.ledger import check, cross_check, read_ledger
    from swarmnode.snapshot.format import parse_snapshot_name
    from swarmnode.snapshot.read import read_header

    newest = max((newest_snapshot(n.data_dir) for n in nodes), key=lambda p: parse_snapshot_name(p.name)[1:3])
    lineage = read_header(newest).metadata["swarm_cursors"]
    ledgers = {node.info["node_id"]: read_ledger(node.data_dir) for node in nodes}
    assert not (violations := cross_check(ledgers)), violations
    for node in nodes:
        report = check(read_ledger(node.data_dir))
        assert not report.errors, f"{node.data_dir.name}: {report.errors}"
        record = lineage.get(node.info["node_id"])
        if record is None:  # it never got work into the model (a node stopped in its first round...)
            assert not report.chain, f"{node.data_dir.name}: the newest model has no record of its chain"
            continue
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

    from swarmnode.snapshot.format import snapshot_file_name

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

    from swarmnode.snapshot.format import parse_snapshot_name, snapshot_file_name

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


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[None]:
    """A tmpfs of `size` (e.g. "12m") mounted on `path` (a small disk that fills up); skips without root."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (the full disk) needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
