"""The checks of swarmnode on a CUDA device, as plain functions: `tests/gpu/test_gpu.py` runs them under
pytest (marker `gpu`), and `python tests/gpu/gpu_checks.py` runs them without pytest (the GPU machine
may have none) for `scripts/gpu-check`. Each check raises AssertionError when it fails and returns the
figures it measured (printed by the script; never asserted: targets are read, not tested).

- the bf16 step against the fp32 step on the same batch (loss within BF16_LOSS_TOLERANCE), and the
  tokens/s of each on `base`;
- Δ computed on the device is θ_g − θ exactly, and the outer step lands θ where the host's maths says;
- staging from the GPU: the arena is pinned, and a step right after staging does not reach the bytes;
- the staging stall against a plain pinned device-to-host copy of the same bytes;
- fp16: the grad scaler's state through a snapshot;
- kill -9 on a GPU: the same cursor, weights and optimizer state equal to the snapshot's bytes (in
  process), and a killed `swarmnode run --device cuda` resuming from its newest snapshot;
- a 2-node swarm on one GPU with one global digest per round;
- `--nproc-per-node 2` (NCCL, two GPUs) beside a one-rank node: one digest per round, twice the weight;
  `--nproc-per-node` past the GPU count refused;
- `--device cuda:N` past the device count refused.

`GPU_CHECKS_DEVICE=cpu python tests/gpu/gpu_checks.py` runs the same checks on the CPU (smaller, and
without what only a GPU has: pinned memory, side streams, the stall), to try the checks themselves
on a machine without a GPU.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # swarmtest, as pytest's pythonpath has it

from swarmnode.core.data import ShardLoader, default_corpus  # noqa: E402
from swarmnode.core.diloco import AveragedDelta, DilocoConfig  # noqa: E402
from swarmnode.core.gpt_spec import GptSpec  # noqa: E402
from swarmnode.core.model import select_device  # noqa: E402
from swarmnode.core.precision import Precision  # noqa: E402
from swarmnode.core.training import RunIdentity, TrainingRun, run_digest  # noqa: E402
from swarmnode.node.startup import check_gpu_count  # noqa: E402
from swarmnode.snapshot.metadata import SnapshotMetadata  # noqa: E402
from swarmnode.snapshot.read import read_snapshot  # noqa: E402
from swarmnode.snapshot.staging import StagingBuffers  # noqa: E402
from swarmnode.snapshot.write import write_snapshot  # noqa: E402
from swarmnode.swarm.recovery.restore import read_receipts  # noqa: E402
from swarmnode.util.errors import ConfigError  # noqa: E402
from swarmnode.util.metrics import Metrics  # noqa: E402
from swarmnode.util.pinned import PinnedBuffer  # noqa: E402
from swarmtest import ProcessReaper, cold_metadata, start_swarm  # noqa: E402

DEVICE = torch.device(os.environ.get("GPU_CHECKS_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"
RATE_MODEL, RATE_BATCH, RATE_SEQ = ("base", 32, 256) if ON_GPU else ("tiny", 4, 64)
NODE_ID = "9a" * 20
BF16_LOSS_TOLERANCE = 0.02
"""|bf16 loss − fp32 loss| allowed on the same weights and batch (`small`'s start is ~5.6; cuBLAS's
bf16 accumulation orders differ more than the CPU's, so 4× the CPU test's 5e-3)."""
Figures = dict[str, float]


def gpu_run(
    model: str = "small",
    precision: Precision = Precision.FP32,
    batch: int = 8,
    seq_len: int = 128,
    outer_mix: float = 0.3,
) -> TrainingRun:
    corpus = default_corpus()
    spec = GptSpec.preset(model, corpus.vocab_size)
    diloco = DilocoConfig(precision=precision, outer_mix=outer_mix)
    loader = ShardLoader(corpus, 0, 16, batch, seq_len, seed=0)
    digest = run_digest(spec, seq_len, 16, 0, diloco, corpus.digest)
    identity = RunIdentity("gpu", NODE_ID, digest, corpus.digest, model)
    return TrainingRun(spec, diloco, loader, corpus, identity, 0, DEVICE, Metrics())


def train(run: TrainingRun, steps: int) -> None:
    run.inner_phase(run.progress.round_step + steps, None, threading.Event(), lambda: None)


def host_state(run: TrainingRun) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in run.state_tensors().items()}


def check_bf16_step_matches_fp32() -> Figures:
    fp32, bf16 = gpu_run(), gpu_run(precision=Precision.BF16)
    gaps = []
    for _ in range(3):
        losses = [run.trainer.inner_step(run.loader.next_batch()) for run in (fp32, bf16)]
        gaps.append(abs(losses[0] - losses[1]))
        assert gaps[-1] < BF16_LOSS_TOLERANCE, losses
    assert all(t.dtype == torch.float32 for t in bf16.trainer.params)  # fp32 master weights
    precisions, steps = (Precision.FP32, Precision.BF16), 30 if ON_GPU else 3
    rates = {p: _tokens_per_s(gpu_run(RATE_MODEL, p, RATE_BATCH, RATE_SEQ), steps) for p in precisions}
    return {
        "largest |bf16 - fp32| loss": max(gaps),
        f"{RATE_MODEL} fp32 tokens/s": rates[Precision.FP32],
        f"{RATE_MODEL} bf16 tokens/s": rates[Precision.BF16],
        "bf16 / fp32 tokens/s (target >= 2)": rates[Precision.BF16] / rates[Precision.FP32],
    }


def _tokens_per_s(run: TrainingRun, steps: int) -> float:
    train(run, 5)  # warm-up: kernel choice, the allocator's pools
    _sync()
    started = time.perf_counter()
    train(run, steps)
    _sync()
    return steps * run.loader.batch_size * run.loader.seq_len / (time.perf_counter() - started)


def check_delta_and_outer_step_on_the_device() -> Figures:
    run = gpu_run(outer_mix=0.0)
    train(run, 3)
    theta = torch.cat([p.detach().float().cpu().reshape(-1) for p in run.trainer.params])
    start = run.prepare_round()
    assert torch.equal(start.delta, run.trainer.global_flat - theta)  # computed there, exact
    averaged = AveragedDelta(start.delta * 0.5, ((0, start.delta.numel()),), 2)
    run.apply_outer(averaged, {}, None)
    theta = torch.cat([p.detach().float().cpu().reshape(-1) for p in run.trainer.params])
    assert torch.equal(theta, run.trainer.global_flat)  # α = 0: θ ← θ_g', bit for bit
    assert run.trainer.global_flat.is_pinned() == ON_GPU
    return {"parameters": float(theta.numel())}


def check_staging_reads_what_training_had() -> Figures:
    run = gpu_run()
    train(run, 2)
    staging = StagingBuffers()
    before = host_state(run)
    staged = staging.stage(run.state_tensors())
    train(run, 1)  # enqueued right behind the copies: it must not reach the staged bytes
    staged.wait()
    for name, tensor in before.items():
        assert torch.equal(staged.tensors[name], tensor), name
    device_names = [n for n, t in run.state_tensors().items() if t.is_cuda]
    assert bool(device_names) == ON_GPU and all(staged.tensors[n].is_pinned() for n in device_names)
    staging.close()
    return {"device tensors staged": float(len(device_names))}


def check_staging_stall_against_a_pinned_copy(model: str = "base", rounds: int = 5) -> Figures:
    """The time until training may go on after staging (host thread plus the GPU's wait for the
    copies) against one pinned device-to-host copy of the same bytes."""
    if not ON_GPU:
        return {}
    run = gpu_run(model)
    train(run, 2)
    tensors = run.state_tensors()
    device_bytes = sum(t.numel() * t.element_size() for t in tensors.values() if t.is_cuda)
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    staging = StagingBuffers()
    staging.stage(tensors).wait()  # warm: the arena is laid out and pinned once

    def stall() -> None:
        staged = staging.stage(tensors)
        torch.cuda.current_stream().synchronize()
        staged.wait()

    stall_s = _best(stall, rounds)
    copies = {}
    for label, size in (("device bytes", device_bytes), ("all bytes", total_bytes)):
        source, target = torch.empty(size, dtype=torch.uint8, device=DEVICE), PinnedBuffer(size)
        copies[label] = _best(lambda s=source, t=target.tensor: _copy_down(t, s), rounds)
        target.close()
    staging.close()
    return {
        "state MB": total_bytes / 1e6,
        "on the device MB": device_bytes / 1e6,
        "staging stall ms": stall_s * 1e3,
        "pinned D2H of the device bytes ms": copies["device bytes"] * 1e3,
        "pinned D2H of all bytes ms": copies["all bytes"] * 1e3,
        "stall / D2H of all bytes (target <= 1.2)": stall_s / copies["all bytes"],
    }


def _sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def _copy_down(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()


def _best(action: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        _sync()
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def check_fp16_grad_scaler_through_a_snapshot() -> Figures:
    with tempfile.TemporaryDirectory() as tmp:
        run = gpu_run(precision=Precision.FP16)
        train(run, 4)
        saved = run.trainer.state_metadata()["grad_scaler"]
        info, _ = write_snapshot(Path(tmp), run.state_tensors(), run.state_metadata(), kind="hot")
        resumed = gpu_run(precision=Precision.FP16)
        loaded = read_snapshot(info.path)
        resumed.restore_own(loaded, SnapshotMetadata.parse(loaded.metadata))
        assert resumed.trainer.state_metadata()["grad_scaler"] == saved
        return {"scale": saved["scale"], "growth tracker": float(saved["growth_tracker"])}


def check_restore_on_the_gpu_equals_the_snapshot_bytes() -> Figures:
    """The kill -9 guarantee on a GPU: same cursor, weights and optimizer state equal to the snapshot's
    bytes (the steps after it need not repeat bit for bit: CUDA kernels are not deterministic)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = gpu_run(precision=Precision.BF16)
        train(run, 5)
        info, _ = write_snapshot(Path(tmp), run.state_tensors(), run.state_metadata(), kind="hot")
        loaded = read_snapshot(info.path)
        resumed = gpu_run(precision=Precision.BF16)
        resumed.restore_own(loaded, SnapshotMetadata.parse(loaded.metadata))
        for name, tensor in host_state(resumed).items():
            if not name.startswith("rng/"):
                assert torch.equal(tensor, loaded.tensors[name]), name
        assert resumed.loader.state_dict() == loaded.metadata["cursor"]
        return {"tensors compared": float(len(loaded.tensors))}


GPU_NODE = ("--device", str(DEVICE), "--precision", "bf16")
SWARM = (
    *("--inner-steps", "10", "--hot-every", "1000", "--cold-every", "1", "--keep-cold", "100"),
    *("--matchmaking-timeout", "10", "--allreduce-timeout", "20", "--seed", "5", "--run-id", "gpu"),
)


def check_a_killed_gpu_node_resumes_from_its_snapshot() -> Figures:
    args = (*GPU_NODE, "--inner-steps", "12", "--hot-every", "5", "--max-outer-steps", "3", "--seed", "3")
    reaper = ProcessReaper()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data_dir = Path(tmp)
            # Killed half-way through its third write: the first two are complete on disk.
            first = reaper.node(data_dir, args, faults="kill@snapshot_halfway#3").start()
            assert first.wait(300) == -signal.SIGKILL, first.log_tail()
            second = reaper.node(data_dir, args).start()
            assert second.wait(300) == 0, second.log_tail()
            receipts = read_receipts(data_dir)
            assert [r["source"] for r in receipts] == ["fresh", "local"], receipts
            assert 0 < receipts[-1]["inner_step"] < 15  # from the second write (steps 5 and 10)
            return {"resumed at inner step": float(receipts[-1]["inner_step"])}
    finally:
        reaper.kill_all()


def check_two_nodes_on_one_gpu_average() -> Figures:
    reaper = ProcessReaper()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = [*SWARM, *GPU_NODE, "--max-outer-steps", "2", "--wait-peers", "1"]
            nodes = start_swarm(reaper, Path(tmp), 2, args)
            for node in nodes:
                assert node.wait(300) == 0, node.log_tail()
            metas = [cold_metadata(n) for n in nodes]
            for outer in (1, 2):
                assert len({m[outer]["global_digest"] for m in metas}) == 1, f"round {outer} differs"
            return {"rounds agreed": 2.0}
    finally:
        reaper.kill_all()


def check_a_two_rank_node_and_a_one_rank_node_average() -> Figures:
    """`--nproc-per-node 2` (NCCL, GPUs 0 and 1) beside a one-rank node: one digest per round, the
    2-rank node weighing twice. Needs two GPUs (on one it says so and checks nothing); on the CPU
    (GPU_CHECKS_DEVICE=cpu) the ranks use gloo."""
    return _two_rank_node_beside_a_one_rank_node(())


def check_a_sharded_two_rank_node_and_a_one_rank_node_average() -> Figures:
    """The same with `--shard-model` (FSDP2 over NCCL: each GPU holds half of θ and the moments)."""
    return _two_rank_node_beside_a_one_rank_node(("--shard-model",))


def _two_rank_node_beside_a_one_rank_node(own: tuple[str, ...]) -> Figures:
    if ON_GPU and torch.cuda.device_count() < 2:
        return {"skipped: GPUs": float(torch.cuda.device_count())}
    reaper = ProcessReaper()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = [*SWARM, *GPU_NODE, "--max-outer-steps", "2", "--wait-peers", "1", "--max-ranks", "2"]
            nodes = start_swarm(reaper, Path(tmp), 2, args, extra=[("--nproc-per-node", "2", *own), ()])
            for node in nodes:
                assert node.wait(300) == 0, node.log_tail()
            metas = [cold_metadata(n) for n in nodes]
            two, one = (n.info["node_id"] for n in nodes)
            for outer in (1, 2):
                assert len({m[outer]["global_digest"] for m in metas}) == 1, f"round {outer} differs"
                weights = metas[1][outer]["last_round"]["weights"]
                assert weights[two] == 2 * weights[one], weights
            return {"rounds agreed": 2.0}
    finally:
        reaper.kill_all()


def check_ranks_past_the_gpu_count_are_refused() -> Figures:
    """`--nproc-per-node` above the GPU count: exit 2 before anything starts (a CPU has no such limit)."""
    if not ON_GPU:
        return {}
    count = torch.cuda.device_count()
    ranks = str(count + 1)
    try:
        check_gpu_count(count + 1, torch.device("cuda"))
    except ConfigError as exc:
        assert str(exc).startswith("--nproc-per-node: one GPU per rank"), exc
        return {"devices": float(count), "ranks refused": float(ranks)}
    raise AssertionError(f"{ranks} ranks on {count} GPUs were accepted")


def check_a_gpu_past_the_count_is_refused() -> Figures:
    count = torch.cuda.device_count() if ON_GPU else 0
    try:
        select_device(f"cuda:{count}")
    except ConfigError as exc:
        assert str(exc).startswith("--device:"), exc
        return {"devices": float(count)}
    raise AssertionError(f"cuda:{count} was accepted")


CHECKS: tuple[Callable[[], Figures], ...] = (
    check_a_gpu_past_the_count_is_refused,
    check_bf16_step_matches_fp32,
    check_delta_and_outer_step_on_the_device,
    check_staging_reads_what_training_had,
    check_staging_stall_against_a_pinned_copy,
    check_fp16_grad_scaler_through_a_snapshot,
    check_restore_on_the_gpu_equals_the_snapshot_bytes,
    check_a_killed_gpu_node_resumes_from_its_snapshot,
    check_two_nodes_on_one_gpu_average,
    check_ranks_past_the_gpu_count_are_refused,
    check_a_two_rank_node_and_a_one_rank_node_average,
    check_a_sharded_two_rank_node_and_a_one_rank_node_average,
)


def main() -> int:
    """Run every check, one line each with its figures; 1 if any failed."""
    if ON_GPU and not torch.cuda.is_available():
        print("gpu checks: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    if not ON_GPU:
        torch.set_num_threads(1)  # (a loaded CPU runs one thread per process steadier than two)
    failed = 0
    name = torch.cuda.get_device_name(DEVICE) if ON_GPU else "the CPU (GPU_CHECKS_DEVICE=cpu)"
    print(f"gpu checks on {name} (torch {torch.__version__})", flush=True)
    for check in CHECKS:
        started = time.perf_counter()
        try:
            figures = check()
        except Exception as exc:  # noqa: BLE001 - every check runs; each failure is reported
            failed += 1
            print(f"FAIL {check.__name__}: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
            continue
        shown = ", ".join(f"{k} {v:.4g}" for k, v in figures.items())
        print(f"ok   {check.__name__} ({time.perf_counter() - started:.1f} s): {shown}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
