"""One node's training run: the DiLoCo trainer, its shard loader and its progress, as one state.

Its owner is the training thread (`util/threads.py`): every method that changes the state runs there
and says so (`assert_training_thread`). `TrainingRun` knows how to take an inner phase, prepare and
apply an outer step, describe its whole state for a snapshot, and restore from one — its own (bitwise:
model, both optimizers, global params, RNG, steps and cursor) or a peer's (the swarm's global state,
with this node's own cursor). After each step and restore it publishes a `TrainingSample`, the
immutable view the event loop and the status handler read (the global digest is hashed here, where
θ_g changes, never on the loop).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmnode.core import sharding, sparse
from swarmnode.core.data import Corpus, ShardLoader
from swarmnode.core.diloco import AveragedDelta, DilocoConfig, DilocoTrainer, InnerTrainer, Range
from swarmnode.core.fragments import FragmentPlan
from swarmnode.core.model_spec import ModelSpec
from swarmnode.core.ranks import NodeRanks
from swarmnode.snapshot.format import SnapshotError
from swarmnode.snapshot.metadata import SnapshotMetadata, StateMetadata
from swarmnode.snapshot.tensors import LoadedSnapshot, TensorTemplate
from swarmnode.util import clock, faults
from swarmnode.util.metrics import Metrics
from swarmnode.util.threads import assert_training_thread

logger = logging.getLogger(__name__)

HELDOUT_BATCHES = 4


@dataclass
class Progress:
    """Counters that travel in every snapshot's metadata."""

    outer_step: int = 0
    inner_step: int = 0  # inner steps taken in total
    round_step: int = 0  # inner steps taken in the current round
    round_tokens: int = 0  # tokens trained in the current round (the averaging weight)
    tokens: int = 0
    last_loss: float | None = None
    heldout_loss: float | None = None
    committed_cursor: dict[str, int] | None = None
    """Where this node's batches in the global params end: the cursor after its last
    applied round; the current round's batches, and those of skipped rounds, are local progress."""
    swarm_cursors: dict[str, dict[str, int]] = field(default_factory=dict)
    """Every node's cursor as far as its batches are in θ_g: the lineage's record of what it holds."""
    last_round: dict[str, Any] | None = None
    """The last round's group, member weights, coverage, seconds and bytes sent."""


@dataclass(frozen=True)
class TrainingSample:
    """The training state as the event loop may see it: published by the training thread after every
    inner step, outer step and restore, and replaced whole (never changed)."""

    outer_step: int
    inner_step: int
    round_step: int
    round_tokens: int
    tokens: int
    last_loss: float | None
    heldout_loss: float | None
    cursor: tuple[int, int, int]
    """The loader's (shard, epoch, position)."""
    committed_cursor: tuple[int, int, int]
    global_digest: str
    tokens_per_s: float


@dataclass(frozen=True)
class RoundStart:
    """An inner phase's outcome, handed to the swarm for its outer step (see `TrainingRun.prepare_round`)."""

    outer_step: int
    start: dict[str, int]
    """The committed cursor: where the round's range of batches starts."""
    end: dict[str, int]
    """The loader's cursor: where it ends."""
    delta: torch.Tensor
    """Δ = θ_g − θ on `fragment`, as sent to the swarm (a view of the trainer's own buffer, or its
    poisoned copy under the test faults): unchanged until the round's outer step is applied, which
    uses the trainer's own Δ."""
    weight: float
    """Tokens trained in the round (and in rounds carried into it): the averaging weight."""
    global_digest: str
    in_swarm: bool
    """Whether the lineage holds other nodes' work (a round without a group is then held)."""
    steps: int
    """Inner steps in the round when it ended (an overlapped outer step leaves later ones to the next)."""
    fragment: Range
    """The flat range of the global params this round synchronises (`fragments.py`; all of them
    unless --fragments): `delta` is Δ on that range."""


def _point(cursor: dict[str, int]) -> tuple[int, int, int]:
    return cursor["shard"], cursor["epoch"], cursor["position"]


@dataclass(frozen=True)
class RunIdentity:
    """What a snapshot says about who wrote it and which run it belongs to."""

    run_id: str
    node_id: str
    run_digest: str
    corpus_digest: str
    model: str
    settings: str = ""
    """The settings the run digest hashes, as canonical JSON (`run_settings`): what a peer of another
    configuration is told differs."""


def run_digest(
    model: ModelSpec,
    seq_len: int,
    num_shards: int,
    seed: int,
    diloco: DilocoConfig,
    corpus_digest: str,
) -> str:
    """Hash of everything that must agree across a run's nodes for their outer steps to be one."""
    return digest_of_settings(run_settings(model, seq_len, num_shards, seed, diloco, corpus_digest))


def digest_of_settings(settings: dict[str, Any]) -> str:
    return hashlib.sha256(settings_json(settings).encode()).hexdigest()


def settings_json(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


def run_settings(
    model: ModelSpec,
    seq_len: int,
    num_shards: int,
    seed: int,
    diloco: DilocoConfig,
    corpus_digest: str,
) -> dict[str, Any]:
    """Everything that must agree across a run's nodes for their outer steps to be one."""
    agreed = {
        **model.describe(),  # "model", "model_cfg" (a preset: its name and shape, as ever)
        "seq_len": seq_len,
        "num_shards": num_shards,
        "seed": seed,
        "outer_lr": diloco.outer_lr,
        "outer_momentum": diloco.outer_momentum,
        "inner_lr": diloco.inner_lr,
        "schedule": diloco.schedule.describe(),
        "corpus": corpus_digest,
        "format": 3,  # 2: averaged parts name the members they hold; 3: the inner schedule
    }
    if diloco.fragments != 1:  # (absent at 1, so runs without fragments keep their digest)
        agreed["fragments"] = diloco.fragments
    if diloco.round_tokens:  # (absent at 0, so in-process runs keep their digest)
        agreed["round_tokens"] = diloco.round_tokens
    if diloco.outer_mix:  # (absent at 0, DiLoCo's own θ ← θ_g, so such runs keep their digest)
        agreed["outer_mix"] = diloco.outer_mix
    if diloco.topk:  # (absent for a dense wire: its maths is DiLoCo's whatever the wire dtype)
        agreed["wire"] = sparse.wire_name(diloco.topk)
        agreed["ef_decay"] = diloco.ef_decay
    if diloco.precision != "fp32":  # (absent at fp32, so runs from before --precision keep their digest)
        agreed["precision"] = str(diloco.precision)
    return agreed


MAX_SETTINGS_BYTES = 16 * 1024
"""The most of a peer's settings JSON read (a peer's answer is untrusted; ours is a few hundred bytes)."""
MAX_DIFFERENCES = 8


def settings_differences(ours: str, theirs: str) -> list[str]:
    """What differs between two nodes' run settings (`RunIdentity.settings`), one "name: theirs X, ours
    Y" each, nested settings named with dots (`model_cfg.n_layer`); at most MAX_DIFFERENCES, then a
    count. ValueError when `theirs` is not a JSON object of bounded size."""
    if len(theirs) > MAX_SETTINGS_BYTES:
        raise ValueError(f"settings of {len(theirs)} bytes, over {MAX_SETTINGS_BYTES}")
    mine, other = _flat(json.loads(ours)), _flat(json.loads(theirs))
    names = sorted(set(mine) | set(other))
    lines = [
        f"{name}: theirs {_shown(other.get(name))}, ours {_shown(mine.get(name))}"
        for name in names
        if mine.get(name) != other.get(name)
    ]
    if len(lines) > MAX_DIFFERENCES:
        lines = [*lines[:MAX_DIFFERENCES], f"and {len(lines) - MAX_DIFFERENCES} more"]
    return lines


def _flat(settings: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(settings, dict):
        if prefix:
            return {prefix: settings}
        raise ValueError("settings are not a JSON object")
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _shown(value: Any) -> str:
    text = "(none)" if value is None else json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


class TrainingRun:
    """The trainer + loader + progress of one node; all methods run on the training thread."""

    def __init__(
        self,
        model: ModelSpec,
        diloco: DilocoConfig,
        loader: ShardLoader,
        corpus: Corpus,
        identity: RunIdentity,
        seed: int,
        device: torch.device,
        metrics: Metrics,
        ranks: NodeRanks | None = None,
        shard_model: bool = False,
    ) -> None:
        self.identity, self.loader, self.metrics = identity, loader, metrics
        self.ranks = ranks
        """The node's other training ranks (`core/ranks.py`; None: a node of one rank)."""
        self.world = ranks.world if ranks is not None else 1
        self.model_spec = model
        self.device = device
        """Where the inner steps run (with `shard_model`, `trainer` is rank 0's host mirror)."""
        self.sharded: InnerTrainer | None = None
        """`--shard-model`: rank 0's shards of θ and the moments, which the inner steps train; `trainer`
        is then the whole state's mirror on the host (`core/sharding.py`)."""
        if shard_model:
            assert ranks is not None, "--shard-model needs several ranks"
            module = sharding.shard_module(model.build(seed, torch.device("cpu")), ranks.world, device)
            self.sharded = InnerTrainer(module, diloco, device, model.loss, ranks.group.mean_loss)
            state = self.sharded.inner_state()
            held, total = sharding.local_values(state), sum(t.numel() for t in state.values())
            logger.info(
                "sharded model: rank 0 holds %d of the %d values of θ and its moments on %s (1/%.2f); the "
                "whole state's mirror is on the host",
                held,
                total,
                device,
                total / max(held, 1),
            )
            device = torch.device("cpu")
        self._stale = False
        """The shards have trained since the mirror last took them (`_fresh` pulls them first)."""
        self.model = model.build(seed, device)
        # torch seeds its generator randomly per process; a run's RNG stream must be a pure function
        # of (seed, node) so that a restarted node continues it exactly.
        torch.manual_seed(
            int.from_bytes(hashlib.sha256(f"{seed}/{identity.node_id}".encode()).digest()[:8], "little")
        )
        sync = ranks.group.sync_grads if ranks is not None and self.sharded is None else None
        self.trainer = DilocoTrainer(self.model, diloco, device, model.loss, sync)
        self.fragments = FragmentPlan(self.trainer.global_flat.numel(), diloco.fragments)
        self.progress = Progress(committed_cursor=loader.state_dict())
        self.heldout = loader.heldout_batches(HELDOUT_BATCHES)
        self.tokens_per_second = 0.0
        self._last_average: torch.Tensor | None = None  # (test faults only: `_poisoned`)
        self._rate_window: tuple[float, int] = (time.monotonic(), 0)
        self.sample = self._sample()
        self._sync_ranks()

    def _sync_ranks(self) -> None:
        """Every rank takes rank 0's θ, moments and cursor (after anything that changed them here)."""
        if self.ranks is not None:
            self.ranks.sync(self.trainer, self.loader, self.sharded)
            self._stale = False

    def _fresh(self) -> None:
        """With sharded ranks: the mirror takes their θ and moments, if they have trained since."""
        if self._stale and self.ranks is not None and self.sharded is not None:
            assert_training_thread("pulling the ranks' shards")  # (their commands come in one order)
            self.ranks.pull(self.sharded, self.trainer)
            self._stale = False

    def publish(self) -> None:
        """Replace the published sample with the state as it is now (on the training thread)."""
        self.sample = self._sample()

    def _sample(self) -> TrainingSample:
        p = self.progress
        assert p.committed_cursor is not None
        return TrainingSample(
            p.outer_step,
            p.inner_step,
            p.round_step,
            p.round_tokens,
            p.tokens,
            p.last_loss,
            p.heldout_loss,
            _point(self.loader.state_dict()),
            _point(p.committed_cursor),
            self.trainer.global_digest(),
            self.tokens_per_second,
        )

    # ----- training -----

    def inner_phase(
        self,
        max_steps: int,
        deadline: float | None,
        stop: threading.Event | Sequence[threading.Event],
        after_step: Callable[[], None],
    ) -> None:
        """Inner steps until the round has `max_steps`, the deadline passes, or a `stop` event is set."""
        assert_training_thread("an inner phase")
        stops = (stop,) if isinstance(stop, threading.Event) else tuple(stop)
        p = self.progress
        while p.round_step < max_steps and not any(s.is_set() for s in stops):
            if deadline is not None and time.monotonic() >= deadline and p.round_step > 0:
                break
            batch = self.loader.next_batch_of(0, self.world)
            lr = self.trainer.inner_lr_at(self.trainer.schedule_step)
            if self.ranks is not None:
                self.ranks.step(lr)
            self.trainer.schedule_step += 1
            loss = (self.sharded or self.trainer).inner_step_at(batch, lr)
            self._stale = self.sharded is not None
            tokens = batch.num_tokens * self.world  # the node's weight: its ranks' tokens
            p.inner_step += 1
            p.round_step += 1
            p.round_tokens += tokens
            p.tokens += tokens
            p.last_loss = loss
            self._count_step(tokens, loss)
            self.publish()
            faults.hit("inner_step", p.inner_step)
            after_step()

    def _count_step(self, tokens: int, loss: float) -> None:
        m = self.metrics
        m.inner_steps.inc()
        m.tokens.inc(tokens)
        m.loss.set(loss)
        started, counted = self._rate_window
        counted += tokens
        elapsed = time.monotonic() - started
        if elapsed >= 2.0:
            self.tokens_per_second = counted / elapsed
            m.tokens_per_second.set(self.tokens_per_second)
            started, counted = time.monotonic(), 0
        self._rate_window = (started, counted)

    def prepare_round(self) -> RoundStart:
        """The round's Δ, range and weight for the swarm's outer step (Δ stays valid until `apply_outer`)."""
        assert_training_thread("preparing an outer step")
        p = self.progress
        assert p.committed_cursor is not None
        in_swarm = len(p.swarm_cursors.keys() - {self.identity.node_id}) > 0
        fragment = self.fragments.for_round(p.outer_step)
        self._fresh()
        delta = self.fragments.delta_of(self.trainer.pseudo_gradient(), fragment)
        delta = _poisoned(delta, p.outer_step + 1, self._last_average)
        return RoundStart(
            p.outer_step,
            dict(p.committed_cursor),
            self.loader.state_dict(),
            delta,
            float(p.round_tokens),
            self.trainer.global_digest(),
            in_swarm,
            p.round_step,
            fragment,
        )

    def apply_outer(
        self,
        averaged: AveragedDelta,
        round_cursors: dict[str, dict[str, int]],
        round_info: dict[str, Any] | None = None,
        overlapped: RoundStart | None = None,
    ) -> str:
        """The outer step, then a new round; the held-out loss of the new global params is measured.
        A step that applied nothing (coverage below --min-coverage), or whose average left this node's
        own Δ out of a part (`averaged.carried`), leaves the round's work as local progress: its tokens
        weigh in the next Δ and the committed cursor stays where it was. `round_cursors` are the
        cursors of the members whose batches the step holds. Returns the new global digest (hashed
        here, off the event loop). `overlapped`: the round's start, when inner steps went on while its
        all-reduce ran (`DilocoTrainer.outer_step_overlapped`): those steps and their tokens stay in
        the new round, and the committed cursor moves only to where the averaged round ended.
        `averaged` covers the round's fragment (all of Δ unless --fragments), in its own coordinates."""
        assert_training_thread("an outer step")
        p = self.progress
        fragment = self.fragments.for_round(p.outer_step)
        assert overlapped is None or overlapped.fragment == fragment, (overlapped, fragment)
        averaged = self.fragments.lift(averaged, fragment)
        if averaged.covered and faults.find("follow", "delta") is not None:  # (test-only: its target)
            self._last_average = averaged.delta.clone()
        self._fresh()  # (an overlapped step lands on θ as the inner steps since have moved it)
        if overlapped is None:
            self.trainer.outer_step(averaged)
        else:
            self.trainer.outer_step_overlapped(averaged)
        p.outer_step += 1
        p.round_step = p.round_step - overlapped.steps if overlapped is not None else 0
        if averaged.covered:
            p.swarm_cursors = {**p.swarm_cursors, **round_cursors}
        if averaged.covered and not averaged.carried:
            p.round_tokens = p.round_tokens - int(overlapped.weight) if overlapped is not None else 0
            p.committed_cursor = dict(overlapped.end) if overlapped is not None else self.loader.state_dict()
        p.last_round = round_info
        self._sync_ranks()  # θ broadcast: every rank starts the next round from rank 0's θ
        p.heldout_loss = self._heldout_loss()
        self.metrics.outer_steps.inc()
        self.metrics.outer_step.set(p.outer_step)
        self.metrics.heldout_loss.set(p.heldout_loss)
        self.publish()
        return self.sample.global_digest

    def _heldout_loss(self) -> float:
        """θ_g's held-out loss; with sharded ranks measured on them (on their devices), not the mirror."""
        if self.ranks is None or self.sharded is None:
            return self.trainer.evaluate(self.heldout)
        return self.ranks.heldout_loss(self.sharded, self.trainer, self.heldout)

    def nudge_global(self) -> str:
        """Test-only (the `global_params` fault): move θ_g a little, so this node goes astray."""
        assert_training_thread("a test nudge of the global params")
        self.trainer.global_flat[:16] += 1e-3
        self.trainer.global_changed()
        self.publish()
        return self.sample.global_digest

    # ----- the state as a snapshot -----

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The live state (training thread: with sharded ranks it first pulls their shards)."""
        self._fresh()
        return self.trainer.state_tensors()

    def snapshot_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The whole node's state for a snapshot: rank 0's tensors and metadata, with every rank's cursor
        and the RNG states of ranks 1..N−1 gathered from them."""
        tensors, metadata = self.state_tensors(), self.state_metadata()
        if self.ranks is not None:
            records = self.ranks.gather(self.loader)
            tensors = {**tensors, **records.rng}
            metadata["ranks"] = list(records.cursors)
        return tensors, metadata

    def state_metadata(self) -> dict[str, Any]:
        """The state's metadata for a snapshot (the writer adds its kind and layout); with several ranks
        their cursors are known only to `snapshot_state`."""
        ident, p = self.identity, self.progress
        assert p.committed_cursor is not None
        return StateMetadata(
            run_id=ident.run_id,
            node_id=ident.node_id,
            run_digest=ident.run_digest,
            corpus_digest=ident.corpus_digest,
            model=ident.model,
            outer_step=p.outer_step,
            inner_step=p.inner_step,
            round_step=p.round_step,
            round_tokens=p.round_tokens,
            tokens=p.tokens,
            last_loss=p.last_loss,
            heldout_loss=p.heldout_loss,
            cursor=self.loader.state_dict(),
            committed_cursor=p.committed_cursor,
            swarm_cursors=p.swarm_cursors,
            last_round=p.last_round,
            global_digest=self.trainer.global_digest(),
            optimizer=self.trainer.state_metadata(),
            created_at=clock.now(),
            ranks=(self.loader.state_dict(),) if self.ranks is None else None,
        ).to_dict()

    def template(self) -> TensorTemplate:
        """name -> (dtype, shape) of every tensor a snapshot of this run must hold."""
        # (any thread: names, dtypes and shapes never change, so no pull from the ranks)
        return {name: (t.dtype, tuple(t.shape)) for name, t in self.trainer.state_tensors().items()}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.trainer.state_tensors().values())

    def restore_own(self, snapshot: LoadedSnapshot, meta: SnapshotMetadata) -> None:
        """Continue exactly where this node's own snapshot left off (bitwise on CPU). `meta` is the
        snapshot's validated metadata; SnapshotError (nothing changed) if its cursors are not this
        loader's."""
        assert_training_thread("a restore")
        self._check_cursor(meta.cursor)
        self._check_cursor(meta.committed_cursor)
        self._check_rank_cursors(meta)
        self.trainer.load_state(snapshot.tensors, dict(meta.optimizer))
        self.loader.load_state_dict(meta.cursor)
        self._restore_progress(meta, keep_round=True)
        self._sync_ranks()
        if self.ranks is not None and not self.ranks.restore_rng(snapshot.tensors):
            logger.info(
                "the snapshot has no RNG states of this node's %d ranks: they keep their own", self.world
            )
        self.publish()

    def restore_from_peer(
        self,
        snapshot: LoadedSnapshot,
        meta: SnapshotMetadata,
        cursor: dict[str, int] | None,
        own_steps: tuple[int, int],
    ) -> None:
        """Adopt the swarm's state from a peer's snapshot: global params, outer momentum and the inner
        optimizer's moments (a warm start); the local model restarts the round from the global params,
        the RNG stays this node's own, and the data position is this node's `cursor` (None: afresh)."""
        assert_training_thread("a restore from a peer")
        if cursor is not None:
            self._check_cursor(cursor)
        self.trainer.load_state(snapshot.tensors, dict(meta.optimizer), restore_rng=False)
        self.trainer.reset_local_to_global()
        # The round restarts from θ_g, so the schedule does too: where the peer's round began.
        self.trainer.schedule_step = max(0, meta.schedule_step - meta.round_step)
        if cursor is not None:
            self.loader.load_state_dict(cursor)
        self._restore_progress(meta, keep_round=False)
        self.progress.inner_step, self.progress.tokens = own_steps
        self._sync_ranks()
        self.publish()

    def assign_shard(self, shard: int) -> None:
        """Train shard `shard` from its start (before any training: the shard the node claimed)."""
        assert_training_thread("assigning a shard")
        self.loader.move_to(shard)
        self.progress.committed_cursor = self.loader.state_dict()
        self._sync_ranks()
        self.publish()

    def resume_cursor(self, cursor: dict[str, int], steps: tuple[int, int]) -> None:
        """A fresh start that keeps this node's place in its shard: its batches before `cursor` are in
        no state that survives, so that is where its first round begins (and what it has committed)."""
        assert_training_thread("resuming a cursor")
        self.loader.load_state_dict(cursor)
        self.progress.committed_cursor = self.loader.state_dict()
        self.progress.inner_step, self.progress.tokens = steps
        self._sync_ranks()
        self.publish()

    def _check_rank_cursors(self, meta: SnapshotMetadata) -> None:
        """A snapshot's ranks all sit at its cursor (a step moves every rank's cursor past the node's
        next N batches: `ShardLoader.next_batch_of`), so any rank count resumes its stream: with the
        same count every rank exactly, with another the stream re-partitioned (said once).
        SnapshotError (nothing changed) if a rank's cursor is elsewhere."""
        ranks = meta.ranks or (meta.cursor,)
        if any(dict(cursor) != dict(meta.cursor) for cursor in ranks):
            raise SnapshotError(f"snapshot's rank cursors {list(ranks)} are not all its cursor {meta.cursor}")
        if meta.ranks is not None and len(ranks) != self.world:
            logger.info(
                "the snapshot was taken with %d ranks, this node has %d: its ranks read the same stream of "
                "batches from the cursor, re-partitioned (rank k takes batches k, k+%d, …)",
                len(ranks),
                self.world,
                self.world,
            )

    def _check_cursor(self, cursor: dict[str, int]) -> None:
        try:
            self.loader.check_state_dict(cursor)
        except ValueError as exc:
            raise SnapshotError(f"snapshot cursor does not fit this node: {exc}") from None

    def _restore_progress(self, meta: SnapshotMetadata, keep_round: bool) -> None:
        p = self.progress
        p.outer_step, p.inner_step, p.tokens = meta.outer_step, meta.inner_step, meta.tokens
        p.last_loss, p.heldout_loss = meta.last_loss, meta.heldout_loss
        p.round_step = meta.round_step if keep_round else 0
        p.round_tokens = meta.round_tokens if keep_round else 0
        p.swarm_cursors = {node: dict(cursor) for node, cursor in meta.swarm_cursors.items()}
        p.committed_cursor = dict(meta.committed_cursor) if keep_round else self.loader.state_dict()
        self.metrics.outer_step.set(p.outer_step)


POISONS = ("scale", "nan", "direction", "noise", "follow")


def _poisoned(delta: torch.Tensor, round_index: int, last_average: torch.Tensor | None) -> torch.Tensor:
    """Test-only (`scale@delta`, `nan@delta`, `direction@delta`, `noise@delta`, `follow@delta`): a copy
    of Δ as a poisoner would hand it to the all-reduce; the trainer's own Δ is untouched. Inert unless
    set. `last_average`: the last round's averaged Δ (follow's target; None before the first)."""
    due = {action: faults.due(action, "delta", round_index) for action in POISONS}
    fired = [f for f in due.values() if f is not None]
    if not fired:
        return delta
    direction, follow = due["direction"], due["follow"]
    if (randomly := direction or due["noise"]) is not None:
        generator = torch.Generator().manual_seed(1234) if direction is not None else None  # fixed
        random = torch.randn(delta.numel(), generator=generator)
        size = randomly.arg or (7.0 if direction is not None else 1.0)
        poisoned = (random / random.norm() * size * float(delta.norm())).to(delta.dtype)
    elif follow is not None:
        target = last_average if last_average is not None and last_average.shape == delta.shape else delta
        poisoned = target.to(delta.dtype) * (follow.arg if follow.arg is not None else -4.0)
    else:
        poisoned = delta.clone()
    if (scale := due["scale"]) is not None:
        poisoned.mul_(scale.arg if scale.arg is not None else 1000.0)
    if due["nan"] is not None:
        poisoned[::997] = float("nan")  # every part of any group holds some
    logger.warning("fault: round %d's pseudo-gradient is poisoned (%s)", round_index, fired[0])
    return poisoned
