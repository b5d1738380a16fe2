"""`--precision` (core/precision.py): autocast in the inner step against fp32 on the same batch, fp16's
grad scaler carried through a snapshot, the precision in the run digest only when not fp32, and the
combinations a node refuses (fp16 on the CPU, a GPU that is not there) as one line, exit 2."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from swarmnode.cli import main as cli
from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.model import select_device
from swarmnode.core.precision import Precision, resolve_precision
from swarmnode.core.training import RunIdentity, TrainingRun, run_digest, run_settings
from swarmnode.snapshot.format import SnapshotError
from swarmnode.snapshot.metadata import SnapshotMetadata
from swarmnode.snapshot.read import read_snapshot
from swarmnode.snapshot.write import write_snapshot
from swarmnode.util.errors import ConfigError
from swarmnode.util.metrics import Metrics

NODE_ID = "cd" * 20
BF16_LOSS_TOLERANCE = 5e-3
"""How far a bf16-autocast loss may be from the fp32 loss of the same weights and batch: 0.1% of the
tiny preset's starting loss (~5.6). bf16 keeps 8 bits of mantissa (0.4% per rounding), but the
roundings mostly cancel in the mean over a batch: here they land within 3e-4."""


def precision_run(precision: Precision, tmp_seed: int = 0) -> TrainingRun:
    corpus = default_corpus()
    model = GptSpec.preset("tiny", corpus.vocab_size)
    diloco = DilocoConfig(precision=precision)
    loader = ShardLoader(corpus, 0, 16, 4, 64, seed=tmp_seed)
    digest = run_digest(model, 64, 16, 0, diloco, corpus.digest)
    identity = RunIdentity("test", NODE_ID, digest, corpus.digest, "tiny")
    return TrainingRun(model, diloco, loader, corpus, identity, 0, torch.device("cpu"), Metrics())


def train(run: TrainingRun, steps: int) -> None:
    run.inner_phase(run.progress.round_step + steps, None, threading.Event(), lambda: None)


def test_a_bf16_step_is_the_fp32_step_within_tolerance() -> None:
    fp32, bf16 = precision_run(Precision.FP32), precision_run(Precision.BF16)
    for _ in range(3):  # the same batches from the same weights; the weights drift apart a little
        batch_loss = [run.trainer.inner_step(run.loader.next_batch()) for run in (fp32, bf16)]
        assert abs(batch_loss[0] - batch_loss[1]) < BF16_LOSS_TOLERANCE, batch_loss
    assert batch_loss[0] != batch_loss[1]  # bf16 did run: autocast changed the arithmetic
    for run in (fp32, bf16):  # master weights, moments and θ_g stay fp32
        assert {t.dtype for n, t in run.state_tensors().items() if not n.startswith("rng/")} == {
            torch.float32
        }


def test_fp32_is_the_plain_step_bit_for_bit() -> None:
    a, b = precision_run(Precision.FP32), precision_run(Precision.FP32)
    train(a, 2)
    train(b, 2)
    assert a.progress.last_loss == b.progress.last_loss
    assert "grad_scaler" not in a.trainer.state_metadata()


def fp16_run_with_history() -> TrainingRun:
    """An fp16 run (the CPU runs fp16 autocast; only the CLI refuses it there) whose scaler has left
    its defaults: a backed-off scale and a growth tracker mid-interval."""
    run = precision_run(Precision.FP16)
    scaler = run.trainer.precision.scaler
    assert scaler is not None
    scaler.load_state_dict({**scaler.state_dict(), "scale": 1024.0, "growth_interval": 1000})
    train(run, 3)
    return run


def test_the_grad_scalers_state_round_trips_through_a_snapshot(tmp_path: Path) -> None:
    straight = fp16_run_with_history()
    saved = straight.trainer.state_metadata()["grad_scaler"]
    assert saved == {"scale": 1024.0, "growth_tracker": 3}
    info, _ = write_snapshot(tmp_path, straight.state_tensors(), straight.state_metadata(), kind="hot")
    train(straight, 2)
    loaded = read_snapshot(info.path)
    resumed = precision_run(Precision.FP16)
    resumed.restore_own(loaded, SnapshotMetadata.parse(loaded.metadata))
    assert resumed.trainer.state_metadata()["grad_scaler"] == saved
    train(resumed, 2)  # kill -9 continues: the same scale, the same steps, bit for bit on the CPU
    assert resumed.trainer.state_metadata()["grad_scaler"] == straight.trainer.state_metadata()["grad_scaler"]
    assert resumed.progress.last_loss == straight.progress.last_loss
    assert torch.equal(resumed.trainer.global_flat, straight.trainer.global_flat)
    for (name, a), b in zip(resumed.state_tensors().items(), straight.state_tensors().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_snapshot_without_a_scaler_leaves_a_fresh_one(tmp_path: Path) -> None:
    run = fp16_run_with_history()
    metadata = run.state_metadata()
    del metadata["optimizer"]["grad_scaler"]  # as written before fp16 existed
    info, _ = write_snapshot(tmp_path, run.state_tensors(), metadata, kind="hot")
    loaded = read_snapshot(info.path)
    resumed = precision_run(Precision.FP16)
    resumed.restore_own(loaded, SnapshotMetadata.parse(loaded.metadata))
    assert resumed.trainer.state_metadata()["grad_scaler"] == {"scale": 65536.0, "growth_tracker": 0}


@pytest.mark.parametrize(
    "bad", [{"scale": 0.0, "growth_tracker": 1}, {"scale": 8.0, "growth_tracker": -1}, 7]
)
def test_a_crafted_grad_scaler_is_refused_when_the_snapshot_is_read(bad: object) -> None:
    metadata = precision_run(Precision.FP16).state_metadata()
    metadata["optimizer"]["grad_scaler"] = bad
    with pytest.raises(SnapshotError, match="grad_scaler"):
        SnapshotMetadata.parse({**metadata, "kind": "hot", "layout": "planes"})


def test_the_precision_enters_the_run_digest_only_when_not_fp32() -> None:
    corpus = default_corpus()
    model = GptSpec.preset("tiny", corpus.vocab_size)
    settings = {
        p: run_settings(model, 64, 16, 0, DilocoConfig(precision=p), corpus.digest) for p in Precision
    }
    assert "precision" not in settings[Precision.FP32]
    assert settings[Precision.FP32] == run_settings(model, 64, 16, 0, DilocoConfig(), corpus.digest)
    assert settings[Precision.BF16]["precision"] == "bf16"
    assert settings[Precision.FP16]["precision"] == "fp16"
    digests = {p: run_digest(model, 64, 16, 0, DilocoConfig(precision=p), corpus.digest) for p in Precision}
    assert len(set(digests.values())) == 3


def test_auto_is_fp32_on_the_cpu_and_fp16_there_is_refused() -> None:
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) is Precision.FP32
    assert resolve_precision("bf16", cpu) is Precision.BF16
    with pytest.raises(ConfigError, match="^--precision: fp16 needs a CUDA device"):
        resolve_precision("fp16", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_that_is_not_there_is_refused() -> None:
    for choice in ("cuda", "cuda:0", "cuda:7"):
        with pytest.raises(ConfigError, match="^--device: no CUDA device"):
            select_device(choice)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


DRY = ("run", "--dry-run", "--model", "tiny", "--host", "127.0.0.1", "--grpc-port", "0", "--dht-port", "0")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--precision", "fp16", "--device", "cpu"], "--precision"),
        (["--precision", "fp16"], "--precision"),  # auto is the CPU here
        (["--precision", "fp64"], "--precision"),
        (["--device", "cuda:x"], "--device"),
        pytest.param(
            ["--device", "cuda:0"],
            "--device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
)
def test_bad_combinations_exit_2_with_one_line_naming_the_flag(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.setattr(cli, "setup_logging", lambda log_format: None)
    code, err = run_cli(capsys, *DRY, "--metrics-port", "0", "--data-dir", str(tmp_path / "d"), *argv)
    assert code == 2 and len(err) == 1, err
    assert flag in err[0] and argv[-1] in err[0], err
    assert not (tmp_path / "d").exists()


def test_the_environment_and_toml_set_the_precision(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "setup_logging", lambda log_format: None)
    monkeypatch.setenv("SWARMNODE_PRECISION", "bf16")
    code, _ = run_cli(capsys, *DRY, "--metrics-port", "0", "--data-dir", str(tmp_path / "d"))
    assert code == 0
    config = tmp_path / "node.toml"
    config.write_text('precision = "fp16"\ndevice = "cpu"\n')
    monkeypatch.delenv("SWARMNODE_PRECISION")
    code, err = run_cli(
        capsys, *DRY, "--metrics-port", "0", "--data-dir", str(tmp_path / "d"), "--config", str(config)
    )
    assert code == 2 and len(err) == 1 and "--precision" in err[0], err
