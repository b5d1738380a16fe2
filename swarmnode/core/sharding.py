"""`--shard-model`: a node's ranks hold θ, its gradients and AdamW's moments in shards (FSDP2's
`fully_shard`, Zhao et al. 2023 / torch's per-parameter FSDP), for a model that does not fit one GPU.

Each rank keeps 1/N of every parameter (dim-0 shards, as `torch.chunk` cuts) and of its moments; the
forward and backward passes gather one block's parameters at a time and reduce-scatter its gradients
(their mean over the ranks), so a step is the data-parallel step of `ranks.RankGroup.sync_grads` to
rounding. What lives outside the inner phase — θ_g, Δ, the outer step, snapshots — needs θ whole,
and has it on rank 0's host: a full copy of θ and its moments there (the *mirror*, a
plain one-rank `DilocoTrainer` on the CPU, whose tensors are a snapshot's, named as any node's). Two
collectives move state between them, one parameter at a time, so no device ever holds more than one
whole parameter beyond its shards:

- **pull** (`RankCommand.PULL`): every shard of θ and of the moments gathered whole to rank 0's mirror,
  before anything reads it after inner steps (Δ, a snapshot, an overlapped outer step);
- **push** (the `SYNC` broadcast): rank 0 scatters the mirror's θ and moments, each rank keeping its
  shard, after anything changed them there (an outer step, a restore, a repair).

The held-out loss (`RankCommand.EVAL`) runs on the shards, on the ranks' devices: θ_g pushed in, the
held-out batches forward on every rank, the mirror's θ pushed back (`ranks.RankGroup.heldout_loss`).

The mirror and the shards hold the same values after either, so a node's snapshots, digests and ledgers
are those of a node that does not shard (a sharded node and a replicated one take the same state).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# (FSDP2 and DTensor are imported where used: they cost every node start about a second otherwise)


def shard_module(model: nn.Module, world: int, device: torch.device) -> nn.Module:
    """Shard `model` in place over the node's `world` ranks (the default process group): each module
    held in an `nn.ModuleList` (a transformer's blocks) is one unit of FSDP2 — its parameters gathered
    for its forward and backward only — and the root holds the rest (embeddings, tied heads, norms).
    A model built on the host moves to `device` one unit at a time as it is sharded (FSDP2 moves a
    unit's tensors, then keeps its shard), so no device ever holds the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for unit in _units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _units(model: nn.Module) -> list[nn.Module]:
    """The modules held in `nn.ModuleList`s that have parameters, outermost only (FSDP2 shards a module
    after the units inside it, and a list within a block stays part of its block)."""
    held = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    inside = {id(sub) for m in held for sub in m.modules() if sub is not m}
    return [m for m in held if id(m) not in inside and any(True for _ in m.parameters())]


def is_sharded(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(_is_dtensor(t) for t in tensors.values())


def local_values(tensors: Mapping[str, torch.Tensor]) -> int:
    """How many values of `tensors` this rank holds (its shards' sizes for sharded ones)."""
    return sum((_as_dtensor(t).to_local() if _is_dtensor(t) else t).numel() for t in tensors.values())


def _is_dtensor(tensor: torch.Tensor) -> bool:
    dtensors = sys.modules.get("torch.distributed.tensor")  # (not imported: no DTensor exists yet)
    return dtensors is not None and isinstance(tensor, dtensors.DTensor)


@torch.no_grad()
def pull(sharded: Mapping[str, torch.Tensor], mirror: Mapping[str, torch.Tensor] | None) -> None:
    """Every rank: each sharded tensor gathered whole, in name order; rank 0 (`mirror` given) copies it
    into the mirror's tensor of that name (on its host). A collective: every rank calls it."""
    for name in sorted(sharded):
        whole = _as_dtensor(sharded[name]).full_tensor()
        if mirror is not None:
            mirror[name].copy_(whole)


@torch.no_grad()
def push(sharded: Mapping[str, torch.Tensor], mirror: Mapping[str, torch.Tensor] | None) -> None:
    """Every rank: each sharded tensor takes its shard of rank 0's mirror tensor of the same name (rank
    0 gives `mirror`; the others None), scattered one parameter at a time. A collective."""
    from torch.distributed.tensor import distribute_tensor

    for name in sorted(sharded):
        target = _as_dtensor(sharded[name])
        mesh = target.device_mesh
        device = target.to_local().device
        if mirror is not None:
            source = mirror[name].to(device=device, dtype=target.dtype)
        else:
            source = torch.empty(target.shape, dtype=target.dtype, device=device)
        shard = distribute_tensor(source, mesh, target.placements, src_data_rank=0)
        target.to_local().copy_(shard.to_local())


def _as_dtensor(tensor: torch.Tensor) -> DTensor:
    assert _is_dtensor(tensor), "a sharded node's θ and moments are DTensors"
    return tensor  # type: ignore[return-value]
