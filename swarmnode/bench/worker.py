"""The child side of the benches' worker processes (`python -m swarmnode.bench.worker ROLE ARGS…`).

A worker prints one JSON line once it listens, then answers one JSON line per request read from stdin
(`{"error": …}` if a request failed), and exits when stdin closes. Roles:
- `serve [SNAPSHOT_FILE]`: a raw TCP sender on loopback (each connection sends an 8-byte little-endian
  length first: 0 asks for the file, n > 0 for n bytes from memory) and, given a file, a real gRPC
  snapshot server (`snapshot_server.start_server`) serving it. Says `{"tcp": port, "grpc": port}`.
- `quality`: says `{"quality": true}`; each request is a `quality_sim.SideJob` as JSON: it trains that side
  of the quality comparison (`quality_sim.train_side`) and answers its held-out curve (`Curve` as JSON).
- `bare-train PRESET THREADS WARMUP_STEPS DEVICE PRECISION BATCH`: the train bench's anchor
  (`train.bare_train`): trains
  WARMUP_STEPS untimed, says `{"bare": true}`; a request `{"steps": n}` trains n more and answers
  their seconds.
- `average NODE_ID [TRUST_MODE KEYS_DIR]`: an `AveragingServicer` on a gRPC server (see `average`).
  Says `{"grpc": port}`; a request
  `{"spec": GroupSpec dict, "numel": n, "seed": s}` makes the group known and prepares a random Δ
  (`{"ready": true}`); `{"go": true}` runs `butterfly_allreduce` of that group (on channels it
  keeps, as a node does) and answers its seconds, bytes sent, coverage, phases and CPU seconds (all threads).
- `gloo RANK WORLD PORT`: a member of a torch.distributed gloo group (TCP store on 127.0.0.1:PORT, rank
  0 hosts it), the all-reduce anchor. Says `{"rank": r}` once the group is up; a request
  `{"numel": n, "seed": s, "dtype": "fp32"|"bf16"}` prepares a random tensor (answers `{"ready": true}`);
  `{"go": true}` waits at a barrier, then times one `all_reduce` (a sum, divided by the world size
  afterwards, like an average) and answers its seconds and CPU seconds.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from swarmnode.bench.quality_sim import SideJob, train_side
from swarmnode.bench.train import bare_train
from swarmnode.bench.worker_lines import answer_requests, say
from swarmnode.net import rpc, snapshot_server
from swarmnode.net.bulk import BulkListener
from swarmnode.net.identity import Identity
from swarmnode.net.security import Security
from swarmnode.snapshot.checkpointer import read_local_snapshot
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.swarm.averaging.allreduce import AveragingServicer, GroupSpec, butterfly_allreduce
from swarmnode.swarm.averaging.trust import DEFAULT_MAX_NORM_RATIO, UNCHECKED, AveragingTrust

GLOO_TIMEOUT = timedelta(seconds=300)


# ---------------------------------------------------------------------------------------------------
# serve


class _OneSnapshot:
    """A snapshot catalog of one file."""

    def __init__(self, info: SnapshotInfo) -> None:
        self.info = info

    def list_snapshots(self) -> list[SnapshotInfo]:
        return [self.info]

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        return self.info if snapshot_id in (None, self.info.snapshot_id) else None


class _NoSnapshots:
    def list_snapshots(self) -> list[SnapshotInfo]:
        return []

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        return None


def _status(node_id: str) -> Callable[[], rpc.NodeStatus]:
    return lambda: rpc.NodeStatus(node_id=node_id, run_id="bench")


class RawSender:
    """A plain TCP sender on 127.0.0.1: `sendfile` of the file, or `sendall` of bytes from memory."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._memory = bytearray()
        threading.Thread(target=self._serve, name="raw-sender", daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            with conn:
                self._send(conn, int.from_bytes(_recv_exact(conn, 8), "little"))

    def _send(self, conn: socket.socket, wanted: int) -> None:
        if wanted == 0:
            assert self.path is not None, "no file to send"
            with self.path.open("rb") as f:
                size, offset = os.fstat(f.fileno()).st_size, 0
                while offset < size:
                    offset += os.sendfile(conn.fileno(), f.fileno(), offset, size - offset)
            return
        if len(self._memory) < wanted:
            self._memory = bytearray(os.urandom(1 << 20) * (wanted // (1 << 20) + 1))
        conn.sendall(memoryview(self._memory)[:wanted])


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("peer closed early")
        data += chunk
    return data


async def serve(path: Path | None) -> None:
    raw = RawSender(path)
    server = None
    if path is not None:
        info = read_local_snapshot(path, None).info
        server = await snapshot_server.start_server(
            "127.0.0.1", 0, _OneSnapshot(info), _status("00"), max_serving=4
        )
    say({"tcp": raw.port, "grpc": server.port if server else None})

    async def nothing(request: dict[str, Any]) -> dict[str, Any]:
        return {}

    try:
        await answer_requests(nothing)
    finally:
        if server is not None:
            await server.stop(0)


# ---------------------------------------------------------------------------------------------------
# average


class Member:
    """One all-reduce member: its servicer, the group it expects next and its random Δ."""

    def __init__(self, servicer: AveragingServicer, channels: rpc.ChannelCache) -> None:
        self.servicer, self.channels = servicer, channels
        self.spec: GroupSpec | None = None
        self.delta = torch.empty(0)
        self.out = torch.empty(0)

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        if "spec" in request:
            self.spec = GroupSpec.from_dict(request["spec"])
            if self.delta.numel() != request["numel"]:
                generator = torch.Generator().manual_seed(int(request["seed"]))
                self.delta = torch.randn(int(request["numel"]), generator=generator)
                self.delta.mul_(float(request.get("scale", 1.0)))
                self.out = torch.empty_like(self.delta)  # reused round after round, as gloo's in-place
            return {"ready": self.servicer.expect(self.spec)}
        assert self.spec is not None, "go before spec"
        spec, index = self.spec, self.spec.index_of(self.servicer.node_id)
        cpu = time.process_time()
        result = await butterfly_allreduce(
            self.servicer, spec, index, self.delta, 1.0, self.channels, self.out
        )
        return {
            "seconds": result.seconds,
            "bytes_sent": result.bytes_sent,
            "coverage": result.averaged.coverage,
            "phases": dict(result.phases),
            "cpu_s": time.process_time() - cpu,
        }


async def average(node_id: str, trust_mode: str = "plain", keys: Path | None = None) -> None:
    """`trust_mode` (`bench.allreduce.TRUST_MODES`): plain (headers trusted, the plain mean), robust or
    clipped (the robust outer step), signed (signed headers and chunks, robust) or tls (mutual TLS,
    robust); `keys` holds the identity key `NODE_ID.key` and, for tls, `NODE_ID.pem`/`.pem.key` and
    `ca.pem`."""
    torch.set_num_threads(1)  # the group's members share the machine's cores
    trust, security = UNCHECKED, Security()
    if trust_mode in ("signed", "tls") and keys is not None:
        identity = Identity.load_or_create(keys / f"{node_id}.key")
        if trust_mode == "tls":
            security = Security.from_files(
                None, keys / f"{node_id}.pem", keys / f"{node_id}.pem.key", keys / "ca.pem"
            )
        trust = AveragingTrust.for_node(identity, security.mutual_tls)
    rpc.configure_client(security)
    ratio = math.inf if trust_mode == "plain" else DEFAULT_MAX_NORM_RATIO
    lanes = None if security.tls else BulkListener()  # as a node: bulk lanes on plaintext swarms
    if lanes is not None:
        await lanes.start("127.0.0.1")
    servicer = AveragingServicer(node_id, trust=trust, max_norm_ratio=ratio, lanes=lanes)
    server = await snapshot_server.start_server(
        "127.0.0.1",
        0,
        _NoSnapshots(),
        _status(node_id),
        extra_servicers=[servicer.register],
        security=security,
    )
    say({"grpc": server.port})
    channels = rpc.ChannelCache()  # reused across rounds, as a node reuses them
    try:
        await answer_requests(Member(servicer, channels).handle)
    finally:
        await channels.close()
        await server.stop(0)
        if lanes is not None:
            await lanes.close()


# ---------------------------------------------------------------------------------------------------
# gloo


class GlooMember:
    """One rank of the gloo anchor: its tensor and the timed `all_reduce`."""

    def __init__(self) -> None:
        self.tensor = torch.empty(0)

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        if "numel" in request:
            generator = torch.Generator().manual_seed(int(request["seed"]))
            values = torch.randn(int(request["numel"]), generator=generator)
            self.tensor = values.to(torch.bfloat16) if request.get("dtype") == "bf16" else values
            return {"ready": True}
        dist.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        dist.all_reduce(self.tensor)
        self.tensor.div_(dist.get_world_size())
        return {"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


async def gloo(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the butterfly's members: they share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=GLOO_TIMEOUT
    )
    say({"rank": rank})
    try:
        await answer_requests(GlooMember().handle)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# quality


async def quality() -> None:
    say({"quality": True})

    async def train(request: dict[str, Any]) -> dict[str, Any]:
        return train_side(SideJob.from_dict(request)).to_dict()

    await answer_requests(train)


def main(argv: list[str]) -> None:
    role, args = argv[0], argv[1:]
    if role == "serve":
        asyncio.run(serve(Path(args[0]) if args else None))
    elif role == "average":
        mode = args[1] if len(args) > 1 else "plain"
        asyncio.run(average(args[0], mode, Path(args[2]) if len(args) > 2 else None))
    elif role == "gloo":
        asyncio.run(gloo(int(args[0]), int(args[1]), int(args[2])))
    elif role == "quality":
        asyncio.run(quality())
    elif role == "bare-train":
        asyncio.run(bare_train(args[0], int(args[1]), int(args[2]), args[3], args[4], int(args[5])))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
