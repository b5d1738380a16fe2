"""`swarmnode export --format hf` and `swarmnode sample` (cli/export.py, cli/sample.py): what a node
trained loads with `from_pretrained` and computes the same logits; bad --out values are one line."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hfmodels import llama_config, transformers

from swarmnode.cli.main import main
from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.diloco import AveragedDelta, DilocoConfig
from swarmnode.core.model_spec import load_model_spec
from swarmnode.core.training import RunIdentity, TrainingRun, run_digest
from swarmnode.snapshot.write import write_snapshot
from swarmnode.util.metrics import Metrics

NODE_ID = "cd" * 20


def trained_snapshot(model: str, directory: Path, steps: int = 3) -> tuple[Path, TrainingRun]:
    """A snapshot of a run of `model` after `steps` inner steps and one outer step of its own."""
    corpus = default_corpus()
    spec = load_model_spec(model, corpus.vocab_size)
    loader = ShardLoader(corpus, 0, 16, 2, 32, seed=0)
    digest = run_digest(spec, 32, 16, 0, DilocoConfig(), corpus.digest)
    identity = RunIdentity("test", NODE_ID, digest, corpus.digest, spec.label)
    run = TrainingRun(spec, DilocoConfig(), loader, corpus, identity, 0, torch.device("cpu"), Metrics())
    run.inner_phase(steps, None, threading.Event(), lambda: None)
    start = run.prepare_round()
    run.apply_outer(AveragedDelta(start.delta.clone(), ((0, start.delta.numel()),)), {}, None)
    info, _ = write_snapshot(directory, run.state_tensors(), run.state_metadata(), kind="hot")
    return info.path, run


def global_logits(run: TrainingRun, batch: torch.Tensor) -> torch.Tensor:
    """The node's own logits of θ_g on `batch`."""
    trainer = run.trainer
    trainer.reset_local_to_global()
    run.model.eval()
    with torch.no_grad():
        return run.model_spec.logits(run.model, batch)


@pytest.mark.parametrize("model", ["tiny", "hf"])
def test_exported_model_loads_with_from_pretrained_and_gives_the_node_logits(
    model: str, tmp_path: Path, capsys
) -> None:
    value = f"hf:{llama_config(tmp_path / 'llama')}" if model == "hf" else model
    snapshot, run = trained_snapshot(value, tmp_path / "snapshots")
    out = tmp_path / "exported"
    assert main(["export", str(snapshot), "--format", "hf", "--out", str(out)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    batch = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    want = global_logits(run, batch)
    with torch.no_grad():
        got = loaded(input_ids=batch).logits
    assert (got - want).abs().max().item() <= 1e-5
    if model == "hf":
        assert torch.equal(got, want)  # the same module class, the same weights
    generated = loaded.generate(batch[:1, :4], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 9)
    assert not list(tmp_path.glob(".*.part"))


def test_sample_prints_the_prompt_and_its_continuation(tmp_path: Path, capsys) -> None:
    snapshot, _ = trained_snapshot("tiny", tmp_path)
    args = ["sample", str(snapshot), "--prompt", "def ", "--tokens", "12", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert first.startswith("def ") and capsys.readouterr().out == first  # seeded: the same text


@pytest.mark.parametrize(
    ("fmt", "out", "message"),
    [
        ("safetensors", "missing/w.safetensors", "does not exist"),
        ("safetensors", ".", "is a directory"),
        ("hf", "missing/dir", "does not exist"),
        ("hf", "occupied", "not an empty directory"),
    ],
)
def test_a_bad_out_is_one_line_and_leaves_nothing(
    fmt: str, out: str, message: str, tmp_path: Path, capsys
) -> None:
    snapshot, _ = trained_snapshot("tiny", tmp_path / "snapshots", steps=1)
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "keep").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    code = main(["export", str(snapshot), "--format", fmt, "--out", str(tmp_path / out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert sorted(tmp_path.rglob("*")) == before
