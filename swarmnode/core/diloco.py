"""DiLoCo inner/outer optimisation (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", Algorithm 1).

Each worker keeps the global parameters θ_g (flat fp32, on the CPU, where the network wants them) and its
local model θ. The inner phase runs AdamW on θ. The pseudo-gradient is Δ = θ_g − θ; the swarm averages Δ
(`rounds.SwarmRounds`), and the outer step is SGD with Nesterov momentum on θ_g with the average as its
gradient; then θ ← θ_g. The inner optimizer's state stays with the worker across rounds.

With a top-k wire (`topk` > 0) the outer step is SparseLoCo's (Sarfi et al. 2025, arXiv 2508.15706):
each worker keeps an error-feedback buffer e, e ← β·e + Δ, sends ĉ = Q(TopK(e)) (`core/sparse.py`) and
keeps e ← e − ĉ; θ_g ← θ_g − α·mean(ĉ), with no outer momentum (e plays its part); then θ ← θ_g.

Averaging may cover only parts of Δ (a peer died): on an uncovered range nobody moves θ_g or its momentum,
and the worker keeps its local progress there, so its next Δ still carries that work. The whole training
state is exposed as a flat dict of named tensors plus JSON metadata, which is what snapshots store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from swarmnode.core import sparse
from swarmnode.core.data import Batch
from swarmnode.core.model import next_token_loss
from swarmnode.core.precision import MixedPrecision, Precision
from swarmnode.core.schedule import InnerSchedule
from swarmnode.util.pinned import PinnedBuffer

Range = tuple[int, int]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(module, inputs, targets) -> the batch's scalar loss (`model_spec.ModelSpec.loss`)."""


def logits_loss(module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a module whose forward gives [batch, time, vocab] logits."""
    return next_token_loss(module(inputs), targets)


@dataclass(frozen=True)
class DilocoConfig:
    inner_lr: float = 1e-3
    """Peak AdamW learning rate of the inner phase (see `schedule`)."""
    schedule: InnerSchedule = field(default_factory=InnerSchedule)
    """How the inner learning rate moves over the schedule steps (default: constant, no warm-up)."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (paper default)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (paper default)."""
    outer_mix: float = 0.3
    """α of the merge that ends an outer step, θ ← α·θ + (1 − α)·θ_g' (Streaming DiLoCo's mixing
    factor, §2.2): the share of its own local params a worker keeps. 0 is DiLoCo's θ ← θ_g'; the default
    0.3 ended lowest in held-out loss in `swarmnode bench quality` (docs/benchmarks.md "The merge").
    With --overlap the same merge lands the overlap's own steps on top (`outer_step_overlapped`)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only."""
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    """Global gradient-norm clip of each inner step."""
    fragments: int = 1
    """K: Δ is cut into K fragments that the rounds synchronise in turn, a round being H/K inner steps
    (Streaming DiLoCo; `fragments.py`, applied by `TrainingRun`); 1: every round takes all of Δ."""
    round_tokens: int = 0
    """The most tokens a member's contribution may weigh in a round (the run's batch × sequence ×
    inner steps; 0: no cap, for in-process uses). Part of the run's agreed configuration, so every
    member refuses the same heavier offers and contributions; a node that carried rounds into one
    still contributes at most this."""

    precision: Precision = Precision.FP32
    """The inner step's autocast dtype (`precision.py`); fp32 keeps every run's digest as it was."""
    topk: int = 0
    """k of the top-k wire (entries kept per chunk of `sparse.CHUNK`; `pseudo_gradient` then returns
    the compressed error feedback, and `outer_step` is SparseLoCo's); 0: dense DiLoCo."""
    ef_decay: float = 0.95
    """β of the error feedback, e ← β·e + Δ (top-k only)."""

    def __post_init__(self) -> None:
        if not 0 <= self.outer_mix < 1:
            raise ValueError(f"outer mix must be in [0, 1), got {self.outer_mix}")
        if not 0 <= self.topk <= sparse.CHUNK or not 0 <= self.ef_decay <= 1:
            raise ValueError(f"top-k in [0, {sparse.CHUNK}] and β in [0, 1]: {self.topk}, {self.ef_decay}")
        if self.topk and self.fragments != 1:
            raise ValueError("the top-k wire takes all of Δ each round: it does not combine with fragments")


@dataclass(frozen=True)
class AveragedDelta:
    """The swarm's average of Δ. Only the `covered` ranges hold an average; elsewhere nothing is known."""

    delta: torch.Tensor
    covered: tuple[Range, ...]
    group_size: int = 1
    carried: tuple[Range, ...] = ()
    """Covered ranges whose average left this node's own Δ out (it arrived late or broke): there the
    node keeps its Δ as local progress, so its next Δ delivers that work (error feedback)."""

    @property
    def coverage(self) -> float:
        return sum(b - a for a, b in self.covered) / max(self.delta.numel(), 1)

    def placed_at(self, offset: int, numel: int) -> AveragedDelta:
        """This average of Δ[offset : offset + len] as one of a flat Δ of `numel` values: zeros and
        uncovered elsewhere, so an outer step moves nothing there (a fragment round: `fragments.py`)."""
        flat = torch.zeros(numel, dtype=self.delta.dtype)
        flat[offset : offset + self.delta.numel()].copy_(self.delta)
        return AveragedDelta(
            flat,
            tuple((offset + a, offset + b) for a, b in self.covered),
            self.group_size,
            carried=tuple((offset + a, offset + b) for a, b in self.carried),
        )


@dataclass(frozen=True)
class ParamSlot:
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


GradSync = Callable[[Sequence[torch.Tensor], torch.Tensor], float]
"""(params, loss) -> the node's mean loss, with every parameter's gradient replaced by the mean over
the node's ranks (`ranks.RankGroup.sync_grads`); absent on a one-rank node."""


class InnerTrainer:
    """θ (the model), its AdamW and the inner step: what every training rank of a node owns. With
    `grad_sync` (a node of several ranks) each step's gradients are averaged across the ranks before
    the clip, so every rank's θ and moments take the same step."""

    def __init__(
        self,
        model: nn.Module,
        cfg: DilocoConfig,
        device: torch.device,
        loss: LossFn = logits_loss,
        grad_sync: GradSync | None = None,
    ) -> None:
        self.model, self.cfg, self.device, self.loss = model, cfg, device, loss
        self.grad_sync = grad_sync
        self.precision = MixedPrecision(cfg.precision, device)
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        self.slots = _slots(named)
        self.inner_opt = self._build_inner_optimizer(named)
        self.schedule_step = 0
        """The inner schedule's position: the next inner step takes `inner_lr_at(schedule_step)`."""

    def _build_inner_optimizer(self, named: list[tuple[str, nn.Parameter]]) -> torch.optim.AdamW:
        decay = [p for _, p in named if p.dim() >= 2]
        no_decay = [p for _, p in named if p.dim() < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.cfg.inner_lr,
            betas=self.cfg.betas,
            foreach=False,
        )
        # Eager state, so snapshots have the same tensors before and after the first step.
        for p in self.params:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
        return opt

    # ----- the inner phase -----

    def inner_lr_at(self, step: int) -> float:
        return self.cfg.inner_lr * self.cfg.schedule.factor(step)

    def inner_step(self, batch: Batch) -> float:
        """One AdamW step on θ at the schedule's learning rate, which then moves on one step; returns
        the batch's loss before the step (a node's mean over its ranks' batches)."""
        lr = self.inner_lr_at(self.schedule_step)
        self.schedule_step += 1
        return self.inner_step_at(batch, lr)

    def inner_step_at(self, batch: Batch, lr: float) -> float:
        """One AdamW step on θ at learning rate `lr` (a rank > 0 takes its rank 0's)."""
        for group in self.inner_opt.param_groups:
            group["lr"] = lr
        self.model.train()
        inputs = batch.inputs.to(self.device, non_blocking=True)
        targets = batch.targets.to(self.device, non_blocking=True)
        with self.precision.autocast():
            loss = self.loss(self.model, inputs, targets)
        self.inner_opt.zero_grad(set_to_none=True)
        self.precision.backward(loss)
        mean_loss = float(loss.item()) if self.grad_sync is None else self.grad_sync(self.params, loss)
        self.precision.step(self.inner_opt, self.params, self.cfg.grad_clip)
        return mean_loss

    def inner_state(self) -> dict[str, torch.Tensor]:
        """θ and the inner optimizer's moments by stable name (live tensors): what a node's ranks hold
        alike."""
        tensors: dict[str, torch.Tensor] = {}
        for slot, p in zip(self.slots, self.params, strict=True):
            tensors[f"model/{slot.name}"] = p.detach()
            for key, value in self.inner_opt.state[p].items():  # whatever the optimizer keeps per param
                if key != "step" and isinstance(value, torch.Tensor):
                    tensors[f"inner/{slot.name}/{key}"] = value
        return tensors

    @torch.no_grad()
    def heldout_loss(self, batches: Sequence[Batch]) -> float:
        """Mean loss of θ as it is over fixed batches (NaN for none)."""
        if not batches:
            return float("nan")
        self.model.eval()
        with self.precision.autocast():
            losses = [
                float(self.loss(self.model, b.inputs.to(self.device), b.targets.to(self.device)))
                for b in batches
            ]
        return sum(losses) / len(losses)

    @property
    def adam_step(self) -> int:
        return int(self.inner_opt.state[self.params[0]]["step"].item())

    def set_adam_step(self, step: int) -> None:
        for p in self.params:
            self.inner_opt.state[p]["step"] = torch.tensor(float(step))


class DilocoTrainer(InnerTrainer):
    """Owns θ (the model), AdamW, θ_g and the outer momentum; all state is `state_tensors()`.
    θ may be of any floating dtype; θ_g, its momentum and Δ are fp32 (the master copy). Parameters
    shared by several modules (tied weights) are one parameter here, as `named_parameters` gives them."""

    def __init__(
        self,
        model: nn.Module,
        cfg: DilocoConfig,
        device: torch.device,
        loss: LossFn = logits_loss,
        grad_sync: GradSync | None = None,
    ) -> None:
        super().__init__(model, cfg, device, loss, grad_sync)
        total = sum(s.numel for s in self.slots)
        on_gpu = device.type == "cuda"
        self._pinned = [PinnedBuffer(total, torch.float32) for _ in range(2 if on_gpu else 0)]
        """On a GPU: θ_g and Δ in page-locked memory, so each crosses to and from the device in one DMA."""
        self.global_flat = self._pinned[0].tensor if on_gpu else torch.empty(total, dtype=torch.float32)
        self.outer_momentum = torch.zeros(total, dtype=torch.float32)
        self._delta = self._pinned[1].tensor if on_gpu else torch.empty(total, dtype=torch.float32)
        self._exchange = torch.empty(total, dtype=torch.float32, device=device) if on_gpu else None
        """On a GPU: the one flat fp32 buffer through which θ, θ_g and Δ cross between device and host
        (docs/design.md "Where the outer step runs")."""
        self._copy_local_to(self.global_flat)
        self._global_digest: str | None = None
        self.error_feedback = torch.zeros(total if cfg.topk else 0, dtype=torch.float32)
        """e of the top-k wire: what this node has not sent yet (node-specific, like the RNG)."""
        self._ef_round = torch.empty_like(self.error_feedback)
        """β·e + Δ of the round being averaged; e takes it (less what was delivered) at its outer step."""
        self._sent = torch.empty_like(self.error_feedback)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch], use_global: bool = True) -> float:
        """Mean loss over fixed batches, of θ_g (default) or of the local θ."""
        if not batches:
            return float("nan")
        saved = torch.empty_like(self.global_flat) if use_global else None
        if saved is not None:
            self._copy_local_to(saved)
            self._set_local(self.global_flat, 0)
        loss = self.heldout_loss(batches)
        if saved is not None:
            self._set_local(saved, 0)
        return loss

    def global_views(self) -> dict[str, torch.Tensor]:
        """θ_g by the names of θ's tensors in `inner_state()` (`model/…`: views, not copies)."""
        return {
            f"model/{s.name}": self.global_flat[s.offset : s.offset + s.numel].view(s.shape)
            for s in self.slots
        }

    # ----- the outer step -----

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ_g − θ as a flat fp32 CPU tensor (a reused buffer: valid until the next call). On a GPU
        Δ is computed there, in the exchange buffer (θ_g copied up once), and copied down once. With
        a top-k wire: ĉ = Q(TopK(β·e + Δ)), what this node sends (e itself changes at the outer step,
        so a round that is held and prepared again counts Δ once)."""
        delta = self._dense_delta()
        if not self.cfg.topk:
            return delta
        torch.add(delta, self.error_feedback, alpha=self.cfg.ef_decay, out=self._ef_round)
        return sparse.compress(self._ef_round, self.cfg.topk, out=self._sent)

    def _dense_delta(self) -> torch.Tensor:
        exchange = self._exchange
        if exchange is None:
            self._copy_local_to(self._delta)
            torch.sub(self.global_flat, self._delta, out=self._delta)
            return self._delta
        exchange.copy_(self.global_flat, non_blocking=True)
        for slot, p in zip(self.slots, self.params, strict=True):
            part = exchange[slot.offset : slot.offset + slot.numel]
            torch.sub(part, p.detach().reshape(-1), out=part)
        self._delta.copy_(exchange)  # (blocking: Δ is whole on the host when this returns)
        return self._delta

    @torch.no_grad()
    def outer_step(self, averaged: AveragedDelta) -> None:
        """Nesterov SGD on θ_g over the covered ranges (the exact update of torch.optim.SGD with
        nesterov=True, dampening 0), then the merge θ ← α·θ + (1 − α)·θ_g' there (α = `outer_mix`;
        0: θ ← θ_g', bit for bit) — except on `carried` ranges, where θ ← θ_g' − Δ (Δ: this round's
        `pseudo_gradient()`), so the work the average left out stays in the next Δ; uncovered ranges
        keep θ and θ_g as they are. With a top-k wire: `_sparse_outer_step`."""
        if self.cfg.topk:
            self._sparse_outer_step(averaged)
            return
        self.outer_step_on_global(averaged)
        for a, b in averaged.covered:
            target = self._merged(a, b, self._local_range(a, b) if self.cfg.outer_mix else None)
            for lo, hi in _overlaps(a, b, averaged.carried):
                target[lo - a : hi - a] = self.global_flat[lo:hi] - self._delta[lo:hi]
            self._set_local(target, a)

    @torch.no_grad()
    def outer_step_overlapped(self, averaged: AveragedDelta) -> None:
        """The outer step of a round whose inner phase has gone on while its all-reduce ran
        (docs/design.md "Overlapped outer step"). Δ_r = θ_g − θ_r is this round's `pseudo_gradient()`
        (θ_r: the local params when the round ended; nothing takes Δ again before its step is applied),
        never what was sent for it (a poisoned copy, under the test faults); θ has since moved on to
        θ_r + δ. θ_g takes the same Nesterov step as in `outer_step`, and θ lands where the blocking step
        would have put θ_r, plus δ (α = `outer_mix`):
            θ ← θ + (1 − α)·(θ_g' − θ_r)   on covered ranges whose average holds our Δ
                                            (θ = α·θ_r + (1 − α)·θ_g' + δ),
            θ ← θ + (θ_g' − θ_g)            on carried ranges (θ_g' − Δ_r + δ: our work stays local),
            θ unchanged                     elsewhere (θ_g' = θ_g there).
        With δ = 0 this is `outer_step` (to rounding). δ's batches are the next round's: its Δ carries
        them whole. With a top-k wire: `_sparse_outer_step`, θ landing at θ_g' + δ."""
        if self.cfg.topk:
            self._sparse_outer_step(averaged, overlapped=True)
            return
        olds = [self.global_flat[a:b].clone() for a, b in averaged.covered]  # θ_g, where it moves
        self.outer_step_on_global(averaged)
        for (a, b), old in zip(averaged.covered, olds, strict=True):
            shift = self.global_flat[a:b] - old  # θ_g' − θ_g
            shift.add_(self._delta[a:b]).mul_(1 - self.cfg.outer_mix)  # (1 − α)·(θ_g' − θ_r)
            for lo, hi in _overlaps(a, b, averaged.carried):
                shift[lo - a : hi - a] = self.global_flat[lo:hi] - old[lo - a : hi - a]
            self._set_local(self._local_range(a, b).add_(shift), a)

    def _sparse_outer_step(self, averaged: AveragedDelta, overlapped: bool = False) -> None:
        """SparseLoCo's step: θ_g ← θ_g − α·mean(ĉ) on the covered ranges; e ← β·e + Δ − ĉ where the
        average holds this node's ĉ, e ← β·e + Δ elsewhere (uncovered or carried: nothing of this
        round's Δ was delivered there, so all of it waits in e); then θ ← θ_g' everywhere (the local
        progress lives in e, not in θ). `overlapped`: θ has moved on by δ since Δ_r = θ_g − θ_r was
        taken, and lands at θ_g' + δ = θ + Δ_r + (θ_g' − θ_g), the blocking step's θ plus the
        overlap's own steps, which the next round's Δ carries (e and θ_g move as in the blocking step)."""
        target = None
        if overlapped:
            target = self._local_range(0, self.global_flat.numel()).add_(self._delta)  # θ + Δ_r
            for a, b in averaged.covered:
                target[a:b].sub_(averaged.delta[a:b], alpha=self.cfg.outer_lr)  # + (θ_g' − θ_g)
        for a, b in averaged.covered:
            self.global_flat[a:b].add_(averaged.delta[a:b], alpha=-self.cfg.outer_lr)
        self._global_digest = None
        self.error_feedback.copy_(self._ef_round)
        for a, b in averaged.covered:
            delivered = [(a, b)] if not averaged.carried else _outside(a, b, averaged.carried)
            for lo, hi in delivered:
                self.error_feedback[lo:hi].sub_(self._sent[lo:hi])
        self._set_local(self.global_flat if target is None else target, 0)

    def _merged(self, a: int, b: int, local: torch.Tensor | None) -> torch.Tensor:
        """α·θ + (1 − α)·θ_g' on [a, b) as a new tensor (`local`: θ there; None: α = 0, θ_g' itself)."""
        if local is None:
            return self.global_flat[a:b].clone()
        return (self.global_flat[a:b] - local).mul_(1 - self.cfg.outer_mix).add_(local)

    @torch.no_grad()
    def outer_step_on_global(self, averaged: AveragedDelta) -> None:
        """Nesterov SGD on θ_g (and its momentum) over the covered ranges; θ is left alone."""
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        for a, b in averaged.covered:
            grad, buf = averaged.delta[a:b], self.outer_momentum[a:b]
            buf.mul_(mu).add_(grad)
            self.global_flat[a:b].add_(grad.add(buf, alpha=mu), alpha=-lr)
        self._global_digest = None

    def _local_range(self, start: int, end: int) -> torch.Tensor:
        """A copy of θ[start:end] (flat positions), on the host."""
        if self._exchange is not None:
            self._pack_local()
            return self._exchange[start:end].cpu()
        piece = torch.empty(end - start, dtype=torch.float32)
        for slot, p in zip(self.slots, self.params, strict=True):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                local = p.detach().reshape(-1)[lo - slot.offset : hi - slot.offset]
                piece[lo - start : hi - start].copy_(local)
        return piece

    def _set_local(self, piece: torch.Tensor, start: int) -> None:
        """θ[start : start + len(piece)] ← piece (flat positions; a GPU takes `piece` in one copy)."""
        end = start + piece.numel()
        if self._exchange is not None:
            piece = self._exchange[start:end].copy_(piece)
        for slot, p in zip(self.slots, self.params, strict=True):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                p.data.view(-1)[lo - slot.offset : hi - slot.offset].copy_(piece[lo - start : hi - start])

    def global_changed(self) -> None:
        """θ_g was modified in place from outside (tests): drop the cached digest."""
        self._global_digest = None

    def global_digest(self) -> str:
        """sha256 of θ_g's bytes: nodes that averaged the same rounds show the same digest."""
        if self._global_digest is None:  # θ_g changes only at outer steps and restores
            self._global_digest = hashlib.sha256(self.global_flat.numpy().data).hexdigest()
        return self._global_digest

    # ----- flat <-> parameters -----

    def _copy_local_to(self, flat: torch.Tensor) -> None:
        """flat ← θ (on a GPU: packed there, then copied down once)."""
        if self._exchange is not None:
            self._pack_local()
            flat.copy_(self._exchange)
            return
        for slot, p in zip(self.slots, self.params, strict=True):
            flat[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))

    def _pack_local(self) -> None:
        """The exchange buffer ← θ, on the device."""
        assert self._exchange is not None
        for slot, p in zip(self.slots, self.params, strict=True):
            self._exchange[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))

    # ----- the training state as named tensors -----

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the training state, by stable name (live tensors: copy before keeping)."""
        tensors = self.inner_state()
        for prefix, flat in (("global", self.global_flat), ("outer_momentum", self.outer_momentum)):
            for slot in self.slots:
                tensors[f"{prefix}/{slot.name}"] = flat[slot.offset : slot.offset + slot.numel].view(
                    slot.shape
                )
        if self.cfg.topk:
            for slot in self.slots:
                ef = self.error_feedback[slot.offset : slot.offset + slot.numel]
                tensors[f"{EF_PREFIX}{slot.name}"] = ef.view(slot.shape)
        tensors.update(rng_state_tensors())
        return tensors

    def state_metadata(self) -> dict[str, Any]:
        return {
            "adam_step": self.adam_step,
            "schedule_step": self.schedule_step,
            "inner_lr": self.cfg.inner_lr,
            "schedule": self.cfg.schedule.describe(),
            "lr": self.inner_lr_at(self.schedule_step),
            "outer_lr": self.cfg.outer_lr,
            "outer_momentum": self.cfg.outer_momentum,
            "outer_mix": self.cfg.outer_mix,
            "weight_decay": self.cfg.weight_decay,
            "betas": list(self.cfg.betas),
            "grad_clip": self.cfg.grad_clip,
            **self.precision.state_metadata(),
        }

    @torch.no_grad()
    def reset_local_to_global(self) -> None:
        """θ ← θ_g everywhere (a node adopting the swarm's state starts its round from it)."""
        self._set_local(self.global_flat, 0)

    @torch.no_grad()
    def load_state(
        self, tensors: dict[str, torch.Tensor], metadata: dict[str, Any], restore_rng: bool = True
    ) -> None:
        """Restore from tensors named as by `state_tensors()` (shapes already checked by the reader).
        `restore_rng` False (a peer's snapshot): this node's own state — its RNG and its error feedback —
        stays as it is here (docs/design.md "Top-k wire": a peer's unsent residual is not ours)."""
        live = self.state_tensors()
        missing = sorted(set(live) - set(tensors))
        if missing:
            raise ValueError(f"snapshot lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        for name, target in live.items():
            own = name.startswith("rng/") or name.startswith(EF_PREFIX)
            if not own or (restore_rng and not name.startswith("rng/")):
                target.copy_(tensors[name])
        self._global_digest = None
        self.set_adam_step(int(metadata["adam_step"]))
        self.schedule_step = int(metadata["schedule_step"])
        self.precision.load_state(metadata)
        if restore_rng:
            restore_rng_state(tensors)


EF_PREFIX = "error_feedback/"
"""Snapshot names of the top-k wire's error feedback, one tensor per parameter."""


def _outside(a: int, b: int, ranges: Sequence[Range]) -> list[Range]:
    """The parts of [a, b) outside sorted, disjoint `ranges`."""
    gaps, lo = [], a
    for c, d in _overlaps(a, b, ranges):
        if lo < c:
            gaps.append((lo, c))
        lo = d
    if lo < b:
        gaps.append((lo, b))
    return gaps


def _overlaps(a: int, b: int, ranges: Sequence[Range]) -> list[Range]:
    """The parts of `ranges` inside [a, b)."""
    return [(max(a, c), min(b, d)) for c, d in ranges if max(a, c) < min(b, d)]


def _slots(named: list[tuple[str, nn.Parameter]]) -> list[ParamSlot]:
    slots, offset = [], 0
    for name, p in named:
        slots.append(ParamSlot(name, offset, p.numel(), tuple(p.shape)))
        offset += p.numel()
    return slots


def rng_state_tensors() -> dict[str, torch.Tensor]:
    tensors = {"rng/torch": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
    return tensors


def restore_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    torch.random.set_rng_state(tensors["rng/torch"].to(torch.uint8))
    if torch.cuda.is_available():
        states = [
            tensors[f"rng/cuda/{i}"] for i in range(torch.cuda.device_count()) if f"rng/cuda/{i}" in tensors
        ]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
