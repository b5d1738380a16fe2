"""A node's training ranks 1..N−1 as child processes (`--nproc-per-node N`), and each child's main.

Rank 0 — the node's own process — starts the children (`RankProcesses.start`, from its main thread,
before anything listens), serves the process group's rendezvous store on loopback (a port the OS
picks) and joins the group with them. Each child owns its θ replica, gradients, AdamW moments and
data window (`core/ranks.py`) and reads rank 0's commands on its stdin; it ignores SIGINT and SIGTERM,
which a terminal or a service manager send to the whole process group (rank 0's stop, with its final
snapshot, needs it, and stops it after). A child never outlives rank 0:
it asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG, checked against the parent's
pid so a parent that died first is noticed too), and the end of its commands ends it as well. Rank
0 stops its children at its own stop, and kills them when it fails; a child that died breaks rank
0's next command or collective (`RankFailed`: the node exits 1).

`python -m swarmnode.node.rank SPEC_JSON` is a child's entry point (never a user's).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from swarmnode.core import sharding
from swarmnode.core.data import ShardLoader, load_corpus
from swarmnode.core.diloco import DilocoConfig, InnerTrainer
from swarmnode.core.model import configure_determinism
from swarmnode.core.model_spec import load_model_spec
from swarmnode.core.precision import Precision
from swarmnode.core.ranks import RANK_TIMEOUT_S, NodeRanks, RankCommand, RankGroup, serve_rank
from swarmnode.util import faults
from swarmnode.util.errors import RankFailed

logger = logging.getLogger(__name__)

STOP_WAIT_S = 30.0
"""How long rank 0 waits for a child to leave after its stop command before it kills it."""
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankSpec:
    """What a child rank needs to build its part of the node (passed as JSON on its command line)."""

    rank: int
    world: int
    store_port: int
    parent_pid: int
    node_id: str
    model: str
    data: str | None
    device: str
    precision: str
    threads: int | None
    batch_size: int
    seq_len: int
    num_shards: int
    seed: int
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    shard_model: bool = False
    """`--shard-model`: θ, gradients and moments in shards across the ranks (`core/sharding.py`)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        raw = json.loads(text)
        return cls(**{**raw, "betas": tuple(raw["betas"])})

    @property
    def rank_device(self) -> torch.device:
        """Where this rank trains: GPU k for rank k (rank 0's `device` is the node's, GPU 0)."""
        return rank_device(torch.device(self.device), self.rank)

    @property
    def diloco(self) -> DilocoConfig:
        """The inner step's settings (the learning rate comes with each step from rank 0)."""
        return DilocoConfig(
            weight_decay=self.weight_decay,
            betas=self.betas,
            grad_clip=self.grad_clip,
            precision=Precision(self.precision),
        )


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device on a node whose rank 0 trains on `device`: GPU k for rank k."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class RankProcesses:
    """Rank 0's children (ranks 1..N−1) and its hold on them (`ranks`)."""

    def __init__(self, procs: list[subprocess.Popen[str]], group: RankGroup) -> None:
        self.procs, self.group = procs, group
        self.ranks = NodeRanks(group, self._send)

    @classmethod
    def start(cls, spec: RankSpec, device: torch.device) -> RankProcesses:
        """Start ranks 1..`spec.world`−1 (`spec` is rank 0's) and join the process group with them."""
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            spec.world,
            is_master=True,
            timeout=timedelta(seconds=RANK_TIMEOUT_S),
            wait_for_workers=False,
        )
        procs: list[subprocess.Popen[str]] = []
        try:
            for rank in range(1, spec.world):
                child = RankSpec(**{**asdict(spec), "rank": rank, "store_port": store.port})
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "swarmnode.node.rank", child.to_json()],
                        stdin=subprocess.PIPE,
                        text=True,
                    )
                )
            group = RankGroup.join(store, 0, spec.world, device)
        except BaseException:
            _kill(procs)
            raise
        logger.info(
            "node of %d ranks: ranks 1..%d are pids %s", spec.world, spec.world - 1, [p.pid for p in procs]
        )
        return cls(procs, group)

    def _send(self, line: str) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            assert proc.stdin is not None
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except OSError:
                raise RankFailed(f"rank {rank} is gone (exit code {proc.poll()})") from None

    def stop(self) -> None:
        """The children leave (a stop command, their commands' end); one that has not left after
        STOP_WAIT_S is killed. Then rank 0 leaves the group."""
        with contextlib.suppress(RankFailed):
            self._send(RankCommand.STOP)
        for proc in self.procs:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.group.close()

    def kill(self) -> None:
        """The children die at once (the node failed)."""
        _kill(self.procs)
        self.group.close()


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent dies, and at once if it already has (then this process is an orphan)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def run_rank(spec: RankSpec) -> int:
    """A child rank's life: build, join, serve rank 0's commands; 1 when the node broke under it."""
    device = spec.rank_device  # (not the node's device: every rank would land on GPU 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_determinism(device, spec.threads)
    corpus = load_corpus(spec.data)
    model_spec = load_model_spec(spec.model, corpus.vocab_size)
    # (sharded: built on the host, and each block moved to the device as it is sharded)
    model = model_spec.build(spec.seed, torch.device("cpu") if spec.shard_model else device)
    torch.manual_seed(rank_seed(spec.seed, spec.node_id, spec.rank))
    loader = ShardLoader(corpus, 0, spec.num_shards, spec.batch_size, spec.seq_len, spec.seed)
    store = dist.TCPStore(
        "127.0.0.1", spec.store_port, spec.world, is_master=False, timeout=timedelta(seconds=RANK_TIMEOUT_S)
    )
    try:
        group = RankGroup.join(store, spec.rank, spec.world, device)
    except RankFailed as exc:
        logger.error("%s", exc)
        return 1
    if spec.shard_model:
        model = sharding.shard_module(model, spec.world, device)
    sync = group.mean_loss if spec.shard_model else group.sync_grads
    trainer = InnerTrainer(model, spec.diloco, device, model_spec.loss, sync)
    try:
        serve_rank(group, trainer, loader, sys.stdin)
    except RankFailed as exc:
        logger.error("%s", exc)
        return 1
    finally:
        group.close()
    return 0


def rank_seed(seed: int, node_id: str, rank: int) -> int:
    """Rank `rank`'s RNG seed: a pure function of (seed, node, rank), so a restart continues it."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{node_id}/rank{rank}".encode()).digest()[:8], "little")


def main() -> int:
    spec = RankSpec.from_json(sys.argv[1])
    _die_with_parent(spec.parent_pid)
    # A terminal's Ctrl-C and a service manager's SIGTERM reach the whole process group: rank 0 stops
    # the node (its final snapshot gathers from this rank), then stops this rank.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)-7s rank {spec.rank}: %(message)s",
    )
    faults.configure(os.environ.get("SWARMNODE_FAULTS"))
    return run_rank(spec)


if __name__ == "__main__":
    sys.exit(main())
