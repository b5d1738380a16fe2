"""The training ranks of one node: `torch.distributed` processes that train its inner phase together.

A node of N ranks is one swarm member. Rank 0 is the node's own process (its training thread is rank
0's trainer, and it alone holds the DHT, gRPC, the all-reduce with other nodes, θ_g, the outer step,
the checkpointer and the ledger); ranks 1..N−1 are child processes (`node/rank.py`) that own only their
θ replica, its gradients, AdamW's moments and their window of the node's data, and talk to nobody but
the process group. Rank 0 drives them: it writes a command on each child's stdin (`RankCommand`), then
takes part in the command's collective; a child reads its commands in order, so every rank runs the
same collectives in the same order.

- **An inner step**: every rank takes its own batch (rank k the k-th of the node's next N, see
  `ShardLoader.next_batch_of`), and the gradients are averaged across the ranks by one all-reduce of a
  flat buffer (the loss rides in its last element) before the clip and AdamW, so every rank's θ and
  moments take the same step: data parallel, as DDP, without wrapping the module (its parameter
  names, hence the snapshot's, and any model spec's loss stay as they are).
- **After rank 0's state changes** (an outer step, a restore, a repair, a shard assigned): `SYNC`
  broadcasts its θ, moments, Adam step, grad scaler and cursor to every rank.
- **A snapshot**: `GATHER` brings every rank's cursor and RNG states to rank 0; a restore of the
  node's own snapshot scatters the RNG states back (`RNG`).

Failure: every collective runs under the process group's timeout (`RANK_TIMEOUT_S`), and a rank that
died breaks the next collective at once (its sockets close). Any failure of a rank operation raises
`RankFailed`: the node stops with exit 1, and its restart resumes from its hot snapshot. A child whose
rank 0 is gone reads the end of its commands and exits (and the kernel kills it at once: `node/rank.py`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist

from swarmnode.core import sharding
from swarmnode.core.data import Batch, ShardLoader
from swarmnode.core.diloco import DilocoTrainer, InnerTrainer
from swarmnode.util import faults
from swarmnode.util.errors import RankFailed

logger = logging.getLogger(__name__)

RANK_TIMEOUT_S = 120.0
"""The most any collective of a node's ranks waits (a rank that hangs alive); a dead rank's sockets
close, which ends the collective at once."""


class RankCommand(StrEnum):
    STEP = "step"
    """One inner step at rank 0's learning rate (the argument)."""
    SYNC = "sync"
    """Rank 0's θ, moments, Adam step, grad scaler and cursor to every rank."""
    PULL = "pull"
    """Sharded ranks (`--shard-model`): every shard of θ and the moments gathered whole to rank 0."""
    EVAL = "eval"
    """Sharded ranks: the held-out loss of θ_g (the argument: how many held-out batches), on the shards."""
    GATHER = "gather"
    """Every rank's cursor and RNG states to rank 0 (a snapshot)."""
    RNG = "rng"
    """RNG states from rank 0's snapshot to each rank (a restore of the node's own snapshot)."""
    STOP = "stop"


def rank_rng_name(rank: int, kind: str) -> str:
    """The snapshot tensor of rank `rank`'s RNG state (`kind` torch or cuda; rank 0's are `rng/…`)."""
    return f"rng/rank/{rank}/{kind}"


@dataclass(frozen=True)
class RankRecords:
    """What a snapshot records of a node's ranks: their cursors (in rank order) and the RNG states of
    ranks 1..N−1 by snapshot name."""

    cursors: tuple[dict[str, int], ...]
    rng: dict[str, torch.Tensor]


@contextlib.contextmanager
def _rank_failure(what: str) -> Iterator[None]:
    try:
        yield
    except RankFailed:
        raise
    except Exception as exc:  # (gloo/NCCL errors, timeouts, a closed pipe: the node cannot go on)
        raise RankFailed(f"{what} failed (a rank died or hung): {_first_words(exc)}") from exc


def _first_words(exc: Exception) -> str:
    """The gist of a backend's error: its first sentence, without a source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip()) or type(exc).__name__
    return text.splitlines()[0].split(". ")[0]


class RankGroup:
    """One rank's side of its node's process group (gloo on the CPU, NCCL on CUDA)."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._comm = device if device.type == "cuda" else torch.device("cpu")
        """Where the collectives' tensors live: NCCL's on the GPU, gloo's on the host."""
        self._grads: torch.Tensor | None = None

    @classmethod
    def join(cls, store: dist.Store, rank: int, world: int, device: torch.device) -> RankGroup:
        """Join the node's process group through `store` (blocks until every rank has joined)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        with _rank_failure(f"rank {rank} joining the node's {world} ranks"):
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=RANK_TIMEOUT_S)
            )
        return cls(rank, world, device)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # (a broken group is torn down as far as it goes)
            dist.destroy_process_group()

    def sync_grads(self, params: Sequence[torch.Tensor], loss: torch.Tensor) -> float:
        """Every parameter's gradient ← its mean over the ranks (one all-reduce of a flat fp32 buffer,
        reused); returns the mean of the ranks' losses."""
        total = sum(p.numel() for p in params)
        if self._grads is None:
            self._grads = torch.empty(total + 1, dtype=torch.float32, device=self.device)
        flat, offset = self._grads, 0
        for p in params:
            part = flat[offset : offset + p.numel()]
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.reshape(-1))
            offset += p.numel()
        flat[total] = loss.detach().float()
        with _rank_failure(f"rank {self.rank}'s gradient all-reduce"):
            dist.all_reduce(flat)
        flat.div_(self.world)
        offset = 0
        for p in params:
            if p.grad is not None:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        return float(flat[total].item())

    def mean_loss(self, params: Sequence[torch.Tensor], loss: torch.Tensor) -> float:
        """The mean of the ranks' losses (sharded ranks: FSDP has already averaged the gradients)."""
        flat = loss.detach().float().reshape(1).to(self._comm)
        with _rank_failure(f"rank {self.rank}'s loss all-reduce"):
            dist.all_reduce(flat)
        return float(flat.item()) / self.world

    def broadcast_state(
        self, trainer: InnerTrainer, loader: ShardLoader, mirror: InnerTrainer | None = None
    ) -> None:
        """Rank 0's θ, AdamW moments and step, grad scaler and cursor, onto every rank. `trainer` is this
        rank's; with sharded ranks rank 0 gives its `mirror` too (the source: `core/sharding.py`)."""
        source = mirror if mirror is not None else trainer
        header = torch.zeros(6, dtype=torch.float64)
        if self.rank == 0:
            scaler = source.precision.state_metadata().get("grad_scaler", {})
            cursor = loader.state_dict()
            header.copy_(
                torch.tensor(
                    [source.adam_step, cursor["shard"], cursor["epoch"], cursor["position"]]
                    + [scaler.get("scale", 0.0), scaler.get("growth_tracker", 0)],
                    dtype=torch.float64,
                )
            )
        with _rank_failure(f"rank {self.rank}'s state broadcast"):
            header = self._broadcast(header)
            state = trainer.inner_state()
            if sharding.is_sharded(state):
                sharding.push(state, mirror.inner_state() if mirror is not None else None)
            else:
                self._broadcast_all(state)
        if self.rank != 0:
            self._take_header(trainer, loader, [int(v) if i < 4 else float(v) for i, v in enumerate(header)])
        elif mirror is not None:
            trainer.set_adam_step(mirror.adam_step)

    @torch.no_grad()
    def _broadcast_all(self, state: Mapping[str, torch.Tensor]) -> None:
        for tensor in state.values():
            if self._comm == tensor.device:
                dist.broadcast(tensor, 0)
            else:
                tensor.copy_(self._broadcast(tensor))

    def heldout_loss(
        self, trainer: InnerTrainer, batches: Sequence[Batch], mirror: DilocoTrainer | None
    ) -> float:
        """Sharded ranks: the loss of rank 0's θ_g over `batches` (every rank takes the same), the
        shards taking θ_g for the forward passes and the mirror's θ after. Rank 0 gives its `mirror`."""
        params = {name: t for name, t in trainer.inner_state().items() if name.startswith("model/")}
        with _rank_failure(f"rank {self.rank}'s held-out loss"):
            sharding.push(params, mirror.global_views() if mirror is not None else None)
            loss = trainer.heldout_loss(batches)
            sharding.push(params, mirror.inner_state() if mirror is not None else None)
        return loss

    def pull_state(self, trainer: InnerTrainer, mirror: InnerTrainer | None) -> None:
        """Sharded ranks: θ and the moments gathered whole into rank 0's `mirror` (None elsewhere)."""
        with _rank_failure(f"rank {self.rank}'s gather of its shards"):
            sharding.pull(trainer.inner_state(), mirror.inner_state() if mirror is not None else None)
        if mirror is not None:
            mirror.set_adam_step(trainer.adam_step)

    def _take_header(self, trainer: InnerTrainer, loader: ShardLoader, header: list[float]) -> None:
        adam_step, shard, epoch, position, scale, tracker = header
        trainer.set_adam_step(int(adam_step))
        if shard != loader.shard:
            loader.move_to(int(shard))
        loader.load_state_dict({"shard": int(shard), "epoch": int(epoch), "position": int(position)})
        if scale > 0:
            trainer.precision.load_state({"grad_scaler": {"scale": scale, "growth_tracker": int(tracker)}})

    def gather_records(self, loader: ShardLoader) -> RankRecords | None:
        """Every rank's cursor and RNG states, at rank 0 (None elsewhere)."""
        cursor = loader.state_dict()
        mine = torch.tensor([cursor["shard"], cursor["epoch"], cursor["position"]], dtype=torch.int64)
        with _rank_failure(f"rank {self.rank}'s gather of cursors and RNG states"):
            cursors = self._gather(mine)
            states = {kind: self._gather(state) for kind, state in self._rng_states().items()}
        if cursors is None:
            return None
        rng = {
            rank_rng_name(rank, kind): gathered[rank]
            for kind, gathered in states.items()
            for rank in range(1, self.world)
            if gathered is not None
        }
        keys = ("shard", "epoch", "position")
        return RankRecords(tuple(dict(zip(keys, map(int, c.tolist()), strict=True)) for c in cursors), rng)

    def scatter_rng(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Each rank's RNG states from rank 0's `tensors` (names: `rank_rng_name`)."""
        with _rank_failure(f"rank {self.rank}'s RNG scatter"):
            for kind, state in self._rng_states().items():
                parts = None
                if self.rank == 0:
                    assert tensors is not None
                    parts = [state] + [tensors[rank_rng_name(k, kind)] for k in range(1, self.world)]
                received = self._scatter(state, parts)
                if self.rank != 0:
                    _set_rng_state(kind, received, self.device)

    @property
    def rng_kinds(self) -> tuple[str, ...]:
        return ("torch", "cuda") if self.device.type == "cuda" else ("torch",)

    def _rng_states(self) -> dict[str, torch.Tensor]:
        states = {"torch": torch.random.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return states

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self._comm)
        dist.broadcast(moved, 0)
        return moved.to(tensor.device)

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        moved = tensor.to(self._comm)
        out = [torch.empty_like(moved) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(moved, out, dst=0)
        return None if out is None else [t.cpu() for t in out]

    def _scatter(self, like: torch.Tensor, parts: list[torch.Tensor] | None) -> torch.Tensor:
        out = torch.empty_like(like, device=self._comm)
        moved = None if parts is None else [p.to(device=self._comm, dtype=like.dtype) for p in parts]
        dist.scatter(out, moved, src=0)
        return out.cpu()


def _set_rng_state(kind: str, state: torch.Tensor, device: torch.device) -> None:
    if kind == "torch":
        torch.random.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


class NodeRanks:
    """Rank 0's hold on its node's ranks: each operation sends its command to every child, then takes
    part in the command's collective. `send` writes one command line to every child (RankFailed when
    one is gone)."""

    def __init__(self, group: RankGroup, send: Callable[[str], None]) -> None:
        assert group.rank == 0
        self.group, self._send = group, send

    @property
    def world(self) -> int:
        return self.group.world

    def step(self, lr: float) -> None:
        """The other ranks take their inner step at `lr`; rank 0's own step joins their all-reduce."""
        self._send(f"{RankCommand.STEP} {lr!r}")

    def sync(self, trainer: InnerTrainer, loader: ShardLoader, sharded: InnerTrainer | None = None) -> None:
        """Every rank takes rank 0's state: `trainer`'s (with `sharded`: rank 0's own shards, and
        every rank's, take the mirror `trainer`'s)."""
        self._send(RankCommand.SYNC)
        if sharded is None:
            self.group.broadcast_state(trainer, loader)
        else:
            self.group.broadcast_state(sharded, loader, mirror=trainer)

    def heldout_loss(self, sharded: InnerTrainer, mirror: DilocoTrainer, batches: Sequence[Batch]) -> float:
        """The held-out loss of the mirror's θ_g, measured on the ranks' shards (`batches`: the node's
        held-out batches, which every rank's loader gives alike)."""
        self._send(f"{RankCommand.EVAL} {len(batches)}")
        return self.group.heldout_loss(sharded, batches, mirror)

    def pull(self, sharded: InnerTrainer, mirror: InnerTrainer) -> None:
        """The ranks' shards of θ and the moments, whole, into rank 0's `mirror`."""
        self._send(RankCommand.PULL)
        self.group.pull_state(sharded, mirror)

    def gather(self, loader: ShardLoader) -> RankRecords:
        self._send(RankCommand.GATHER)
        records = self.group.gather_records(loader)
        assert records is not None
        return records

    def restore_rng(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Each rank's RNG states from a snapshot of this node, if it holds all of them (one taken with
        this many ranks); False (the ranks keep theirs) otherwise."""
        names = [rank_rng_name(k, kind) for k in range(1, self.world) for kind in self.group.rng_kinds]
        if not all(name in tensors for name in names):
            return False
        self._send(RankCommand.RNG)
        self.group.scatter_rng(tensors)
        return True


def serve_rank(group: RankGroup, trainer: InnerTrainer, loader: ShardLoader, commands: Iterable[str]) -> None:
    """A rank > 0: carry out rank 0's commands, in order, until STOP; RankFailed when they end without
    one (rank 0 is gone)."""
    steps = 0
    for line in commands:
        command, _, argument = line.strip().partition(" ")
        match RankCommand(command):
            case RankCommand.STEP:
                trainer.inner_step_at(loader.next_batch_of(group.rank, group.world), float(argument))
                steps += 1
                faults.hit("rank_step", steps)
            case RankCommand.SYNC:
                group.broadcast_state(trainer, loader)
            case RankCommand.PULL:
                group.pull_state(trainer, None)
            case RankCommand.EVAL:
                group.heldout_loss(trainer, loader.heldout_batches(int(argument)), None)
            case RankCommand.GATHER:
                group.gather_records(loader)
            case RankCommand.RNG:
                group.scatter_rng(None)
            case RankCommand.STOP:
                return
    raise RankFailed(f"rank {group.rank}: rank 0 is gone (its commands ended without a stop)")
