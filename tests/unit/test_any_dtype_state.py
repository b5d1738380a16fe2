"""The training state takes whatever the model has (docs/models.md "The seam"): a `py:` module in bf16
with tied weights trains, snapshots and restores bit for bit; tied weights are stored once; state ranges
cut its moments in 2 byte planes; the factory's source is in the run digest."""

from __future__ import annotations

from pathlib import Path

import torch

from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.diloco import DilocoConfig, DilocoTrainer
from swarmnode.core.model_spec import load_model_spec
from swarmnode.core.training import run_digest
from swarmnode.snapshot.ranges import decode_range, encode_range, node_layout, shared_layout
from swarmnode.snapshot.read import read_snapshot
from swarmnode.snapshot.write import write_snapshot

FACTORY = """
import torch
from torch import nn


class Bigram(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, input_ids):
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))


def make(vocab_size):
    return Bigram(vocab_size).to(torch.bfloat16)
"""


def bf16_spec(tmp_path: Path, monkeypatch, name: str = "bf16_models"):
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return load_model_spec(f"py:{name}:make", 256)


def snapshot_metadata(optimizer: dict) -> dict:
    """What the writer reads of a snapshot's metadata (the rest is the training run's business)."""
    cursor = {"shard": 0, "epoch": 0, "position": 0}
    names = {"run_id": "r", "node_id": "ab" * 20, "created_at": 1.0, "cursor": cursor}
    return {"optimizer": optimizer, "outer_step": 0, "inner_step": 3, **names}


def trained(spec, steps: int) -> DilocoTrainer:
    trainer = DilocoTrainer(
        spec.build(0, torch.device("cpu")), DilocoConfig(), torch.device("cpu"), spec.loss
    )
    loader = ShardLoader(default_corpus(), 0, 16, 2, 16, seed=0)
    for _ in range(steps):
        trainer.inner_step(loader.next_batch())
    return trainer


def test_a_bf16_module_with_tied_weights_snapshots_and_restores_bit_for_bit(
    tmp_path: Path, monkeypatch
) -> None:
    spec = bf16_spec(tmp_path, monkeypatch)
    trainer = trained(spec, 3)
    state = trainer.state_tensors()
    assert state["model/embed.weight"].dtype == torch.bfloat16 and "model/head.weight" not in state
    assert state["inner/embed.weight/exp_avg"].dtype == torch.bfloat16
    assert state["global/embed.weight"].dtype == torch.float32
    meta = {"adam_step": 3, "schedule_step": trainer.schedule_step}
    info, _ = write_snapshot(tmp_path / "snaps", state, snapshot_metadata(meta), kind="hot")
    template = {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}
    loaded = read_snapshot(info.path, template=template)
    restored = trained(spec, 0)
    restored.load_state(loaded.tensors, meta)
    for name, tensor in restored.state_tensors().items():
        assert torch.equal(tensor, state[name]), name
    batch = ShardLoader(default_corpus(), 0, 16, 2, 16, seed=1).next_batch()
    assert restored.inner_step(batch) == trainer.inner_step(batch)


def test_state_ranges_cut_each_blob_by_its_element_size(tmp_path: Path, monkeypatch) -> None:
    state = trained(bf16_spec(tmp_path, monkeypatch), 2).state_tensors()
    template = {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}
    assert (shared_layout(template).element_bytes, node_layout(template).element_bytes) == (4, 2)
    moments = state["inner/embed.weight/exp_avg_sq"].contiguous().view(torch.uint8).numpy().tobytes()
    encoding, sent = encode_range(moments, 2)
    assert encoding == "zstd-planes2" and len(sent) < len(moments)
    assert decode_range(encoding, sent, len(moments)) == moments


def test_the_factory_source_is_in_the_run_digest(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = bf16_spec(tmp_path / "a", monkeypatch, "fa")
    (tmp_path / "b" / "fb.py").write_text(FACTORY + "\n# edited\n")
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    edited = load_model_spec("py:fb:make", 256)
    digests = {run_digest(s, 16, 16, 0, DilocoConfig(), "c" * 64) for s in (first, edited)}
    assert len(digests) == 2
