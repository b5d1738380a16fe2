"""Token sources, deterministic per-node shards and the resumable loader cursor.

The default corpus is a fixed file shipped inside the package, so it is the same on every machine and
every volunteer's default node can join every other's default run: Shakespeare's 42 plays and poems
(public domain; the Open Shakespeare edition, CC BY 2.5, see `corpus/NOTICE`), read as bytes (vocab 256).
`--data` takes a directory made by `swarmnode data prepare` (tokens by memmap; the manifest's digest,
not the path, is the corpus digest), a nanoGPT-style uint16 `.bin`, or text files read as bytes.

A corpus is cut into `num_shards` contiguous shards after a held-out tail (for evaluation). A shard is a
list of windows of `seq_len + 1` tokens; every epoch visits them in an order that is a pure function of
(seed, shard, epoch), so the cursor (shard, epoch, position) — position counted in windows — is all a
restart needs to produce exactly the batches an uninterrupted run would have produced.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from swarmnode.core.tokens import MANIFEST_NAME, TOKENS_NAME, load_prepared
from swarmnode.util.validate import parse_cursor

HELDOUT_FRACTION = 0.01
DEFAULT_CORPUS_NAME = "shakespeare"
DEFAULT_CORPUS_FILE = "shakespeare.txt"


@dataclass(frozen=True)
class Corpus:
    """A 1-D array of tokens, its vocabulary size, its sha256 digest and where it came from."""

    tokens: np.ndarray
    vocab_size: int
    digest: str
    description: str

    @cached_property
    def train_len(self) -> int:
        return len(self.tokens) - self.heldout_len

    @cached_property
    def heldout_len(self) -> int:
        total = len(self.tokens)
        return max(int(total * HELDOUT_FRACTION), min(total // 10, 16385))


def load_corpus(data: str | None) -> Corpus:
    """The embedded default corpus (None), a prepared directory, a nanoGPT-style uint16 `.bin`, or a
    text file/directory (bytes)."""
    if data is None:
        return default_corpus()
    path = Path(data)
    if not path.exists():
        raise ValueError(f"--data: no such file or directory, got {data!r}")
    if path.is_dir() and ((path / MANIFEST_NAME).exists() or (path / TOKENS_NAME).exists()):
        # (a token file without its manifest is a half-prepared directory: refused, never read as text)
        prepared = load_prepared(path, "--data")
        return Corpus(prepared.tokens, prepared.vocab_size, prepared.digest, f"prepared:{path}")
    if path.is_file() and path.suffix == ".bin":
        return _token_file(path)
    return _text_corpus(_text_files(path), f"text:{path}")


@cache
def default_corpus() -> Corpus:
    """The corpus shipped in the package (decompressed once per process)."""
    packed = resources.files("swarmnode.core").joinpath(f"corpus/{DEFAULT_CORPUS_FILE}.zst").read_bytes()
    text = zstandard.ZstdDecompressor().decompress(packed)
    return _text_corpus_of([(DEFAULT_CORPUS_FILE, text)], DEFAULT_CORPUS_NAME)


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ValueError(f"--data: directory has no files, got {str(path)!r}")
    return files


def _text_corpus(files: list[Path], description: str) -> Corpus:
    return _text_corpus_of([(path.name, path.read_bytes()) for path in files], description)


def _text_corpus_of(named: list[tuple[str, bytes]], description: str) -> Corpus:
    """Bytes as tokens (vocab 256); the digest covers each file's name, length and content."""
    digest = hashlib.sha256()
    for name, content in named:
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    tokens = np.frombuffer(b"".join(content for _, content in named), dtype=np.uint8)
    return Corpus(tokens, 256, digest.hexdigest(), description)


def _token_file(path: Path) -> Corpus:
    size = path.stat().st_size
    if size == 0:  # (numpy cannot map an empty file: say which flag gave it)
        raise ValueError(f"--data: empty token file {str(path)!r}")
    if size % 2:
        raise ValueError(f"--data: a .bin token file holds uint16 tokens, odd size in {str(path)!r}")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    vocab = (int(tokens.max()) + 1 + 63) // 64 * 64
    return Corpus(tokens, vocab, digest.hexdigest(), f"tokens:{path}")


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # [batch, seq_len] int64
    targets: torch.Tensor  # [batch, seq_len] int64
    epoch: int
    position: int  # window index in the epoch's order of the batch's first window

    @property
    def num_tokens(self) -> int:
        return self.inputs.numel()


class ShardLoader:
    """Batches of one shard in a seeded per-epoch order; `state_dict()` is the cursor."""

    def __init__(
        self, corpus: Corpus, shard: int, num_shards: int, batch_size: int, seq_len: int, seed: int
    ) -> None:
        self.corpus, self.shard, self.num_shards = corpus, shard, num_shards
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        shard_len = corpus.train_len // num_shards
        self._start = shard * shard_len
        self.num_windows = max((shard_len - 1) // seq_len, 0)
        if self.num_windows < batch_size:
            raise ValueError(
                f"--num-shards: shard {shard} has {self.num_windows} windows of {seq_len} tokens, fewer "
                f"than --batch-size {batch_size}; use fewer shards or more data, got {num_shards}"
            )
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def move_to(self, shard: int) -> None:
        """Read shard `shard` from its start instead (every shard has the same length)."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} is not below the {self.num_shards} shards")
        self.shard, self._start = shard, shard * (self.corpus.train_len // self.num_shards)
        self.epoch, self.position = 0, 0
        self._order_epoch = -1

    def state_dict(self) -> dict[str, int]:
        return {"shard": self.shard, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = self.check_state_dict(state)

    def check_state_dict(self, state: Any) -> tuple[int, int]:
        """(epoch, position) of a cursor this loader can resume; ValueError otherwise."""
        cursor = parse_cursor(state)
        if cursor["shard"] != self.shard:
            raise ValueError(f"cursor is for shard {cursor['shard']}, this loader reads shard {self.shard}")
        if cursor["position"] > self.num_windows:
            raise ValueError(
                f"cursor position {cursor['position']} beyond the shard's {self.num_windows} windows"
            )
        return cursor["epoch"], cursor["position"]

    def next_batch(self) -> Batch:
        epoch, position = self._advance()
        windows = self._epoch_order()[position : position + self.batch_size]
        return self._gather(self._start + windows * self.seq_len, epoch, position)

    def next_batch_of(self, rank: int, world: int) -> Batch:
        """Rank `rank`'s batch of the next `world` batches of the stream, the cursor past all of them:
        the ranks of a node read batches k, k+N, k+2N, … of its one stream, so between steps every
        rank's cursor is the node's, and the stream — which batches a cursor has passed — is the same
        for any N (a restart with another N neither skips nor repeats one)."""
        for _ in range(rank):
            self._advance()
        batch = self.next_batch()
        for _ in range(world - rank - 1):
            self._advance()
        return batch

    def _advance(self) -> tuple[int, int]:
        """(epoch, position) of the next batch, and the cursor moved past it (nothing is read)."""
        if self.position + self.batch_size > self.num_windows:
            self.epoch, self.position = self.epoch + 1, 0
        position = self.position
        self.position += self.batch_size
        return self.epoch, position

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = window_order(self.seed, self.shard, self.epoch, self.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def _gather(self, starts: np.ndarray, epoch: int, position: int) -> Batch:
        offsets = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        windows = torch.from_numpy(np.asarray(self.corpus.tokens[offsets], dtype=np.int64))
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), epoch, position)

    def heldout_batches(self, num_batches: int) -> list[Batch]:
        """Fixed batches from the corpus's held-out tail (the same for every node of a run)."""
        start = self.corpus.train_len
        count = (self.corpus.heldout_len - 1) // self.seq_len
        batches: list[Batch] = []
        if count == 0:
            return batches
        for b in range(num_batches):
            index = (np.arange(self.batch_size) + b * self.batch_size) % count
            batches.append(self._gather(start + index * self.seq_len, -1, b))
        return batches


def window_order(seed: int, shard: int, epoch: int, num_windows: int) -> np.ndarray:
    """The epoch's visiting order of a shard's windows, stable across numpy versions.

    Built from the raw PCG64 stream (which NEP 19 keeps stable) and a stable argsort, not from
    `Generator.permutation`, whose algorithm numpy may change between releases.
    """
    bits = np.random.PCG64(np.random.SeedSequence([seed, shard, epoch])).random_raw(num_windows)
    return np.argsort(np.asarray(bits), kind="stable").astype(np.int64)
