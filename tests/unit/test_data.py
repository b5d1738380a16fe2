"""Corpora, shards and the cursor: resuming yields exactly the uninterrupted stream's batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from swarmnode.core.data import ShardLoader, default_corpus, load_corpus, window_order


@pytest.fixture(scope="module")
def corpus():
    return default_corpus()


DEFAULT_CORPUS_DIGEST = "b8c552eb5f38051d86b5659c39ce1d9006bdb7d7fef25b4061e896771a804626"
"""The shipped corpus's digest: the same on every machine and Python, so every default run is one run."""


def test_default_corpus_is_the_shipped_shakespeare_with_a_pinned_digest(corpus) -> None:
    assert corpus.digest == DEFAULT_CORPUS_DIGEST
    assert corpus.vocab_size == 256 and len(corpus.tokens) == 5_057_362
    assert b"To be, or not to be" in corpus.tokens.tobytes()


def test_resumed_cursor_yields_the_same_batches(corpus) -> None:
    straight = ShardLoader(corpus, 3, 16, 4, 64, seed=1)
    expected = [straight.next_batch() for _ in range(40)]
    first = ShardLoader(corpus, 3, 16, 4, 64, seed=1)
    for _ in range(17):
        first.next_batch()
    resumed = ShardLoader(corpus, 3, 16, 4, 64, seed=1)
    resumed.load_state_dict(dict(first.state_dict()))
    for want in expected[17:]:
        got = resumed.next_batch()
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.targets, want.targets)
        assert (got.epoch, got.position) == (want.epoch, want.position)


def test_epochs_wrap_and_reshuffle(corpus) -> None:
    loader = ShardLoader(corpus, 0, 1000, 2, 64, seed=0)
    per_epoch = loader.num_windows // 2
    first = [loader.next_batch() for _ in range(per_epoch)]
    second = loader.next_batch()
    assert second.epoch == 1 and second.position == 0 and loader.state_dict()["epoch"] == 1
    assert not torch.equal(first[0].inputs, second.inputs)


def test_targets_are_inputs_shifted(corpus) -> None:
    batch = ShardLoader(corpus, 5, 16, 3, 32, seed=0).next_batch()
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def test_shards_are_disjoint_and_exclude_heldout(corpus) -> None:
    a = ShardLoader(corpus, 0, 16, 2, 64, seed=0)
    b = ShardLoader(corpus, 1, 16, 2, 64, seed=0)
    assert a._start + a.num_windows * 64 <= b._start
    last = ShardLoader(corpus, 15, 16, 2, 64, seed=0)
    assert last._start + last.num_windows * 64 + 1 <= corpus.train_len
    held = a.heldout_batches(2)
    assert held and held[0].inputs.shape == (2, 64)
    pairs = zip(held, b.heldout_batches(2), strict=True)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in pairs)


def test_a_loader_moved_to_another_shard_reads_it_from_its_start(corpus) -> None:
    moved = ShardLoader(corpus, 0, 16, 4, 64, seed=1)
    moved.next_batch()
    moved.move_to(5)
    fresh = ShardLoader(corpus, 5, 16, 4, 64, seed=1)
    assert moved.state_dict() == {"shard": 5, "epoch": 0, "position": 0}
    assert torch.equal(moved.next_batch().inputs, fresh.next_batch().inputs)


def test_window_order_is_a_permutation() -> None:
    order = window_order(3, 2, 1, 1000)
    assert sorted(order.tolist()) == list(range(1000))
    assert not np.array_equal(order, window_order(3, 2, 2, 1000))


def test_token_file_and_text_directory(tmp_path: Path) -> None:
    tokens = (np.arange(50_000) % 1000).astype(np.uint16)
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    corpus = load_corpus(str(tmp_path / "train.bin"))
    assert corpus.vocab_size == 1024 and corpus.tokens.dtype == np.uint16
    batch = ShardLoader(corpus, 0, 2, 2, 16, seed=0).next_batch()
    assert batch.inputs.max() < 1000
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("hello world " * 4000)
    (docs / "b.txt").write_text("swarm " * 4000)
    text = load_corpus(str(docs))
    assert text.vocab_size == 256 and len(text.tokens) == 48_000 + 24_000
    # the digest a text corpus had before prepared directories existed: such runs keep their run digest
    assert text.digest == "c81f3bae5d2d7c704ff6a6bb877b91507501c9185de1dccdf3679370943b1ecc"


def test_missing_data_and_tiny_shards_are_usage_errors(tmp_path: Path, corpus) -> None:
    with pytest.raises(ValueError, match="--data"):
        load_corpus(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="--num-shards"):
        ShardLoader(corpus, 0, 100_000, 8, 128, seed=0)


def test_an_empty_token_file_names_the_flag(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^--data: empty token file .*empty\.bin"):
        load_corpus(str(empty))
