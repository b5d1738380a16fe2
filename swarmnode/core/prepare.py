"""`swarmnode data prepare`: documents from the inputs → one token file and its manifest, streamed.

Memory stays bounded whatever the input's size: the main process reads pieces (readers.py) and groups
them into batches of about `BATCH_CHARS` characters; at most `2 × workers` batches are being encoded at
once; each batch's tokens are appended to the token file (and its sha256) in input order. The batches
depend only on the inputs, never on `--workers`, so the output is byte-identical for any worker count.

Atomic: everything is written into a hidden sibling of `--out` and renamed to it at the end, so a killed
prepare leaves no directory a node would accept (and the partial one is removed on any error).
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np

from swarmnode.core.encoders import Encoder, TokenizerSpec, quiet_worker_parallelism
from swarmnode.core.readers import Piece, input_files, read_pieces
from swarmnode.core.tokens import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TOKENS_NAME,
    InputInfo,
    Manifest,
    dtype_for,
    file_sha256,
)

BATCH_CHARS = 1 << 20
BATCH_PIECES = 1024


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[Path, ...]
    tokenizer: TokenizerSpec
    out: Path
    text_field: str = "text"
    workers: int = 1
    """Encoding processes; 1 encodes in this process (the tokenizer is parallel inside already)."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers: at least 1, got {self.workers}")
        if self.out.exists():
            raise ValueError(f"--out: already exists (prepare writes a new directory), got {str(self.out)!r}")
        if not self.out.absolute().parent.is_dir():
            raise ValueError(f"--out: its parent directory does not exist, got {str(self.out)!r}")


@dataclass
class _Counts:
    documents: int = 0
    tokens: int = 0
    open_document_tokens: int = 0
    sha256: Any = field(default_factory=hashlib.sha256)


def prepare(cfg: PrepareConfig) -> Manifest:
    """Encode the inputs into `cfg.out` (ValueError, one line naming the file, on bad input)."""
    files = input_files(list(cfg.inputs))
    partial = cfg.out.absolute().parent / f".{cfg.out.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        manifest = _write(cfg, files, partial)
        os.rename(partial, cfg.out)
        return manifest
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _write(cfg: PrepareConfig, files: list[Path], partial: Path) -> Manifest:
    dtype = DTYPES[dtype_for(cfg.tokenizer.info.vocab_size)]
    counts = _Counts()
    total_bytes = sum(path.stat().st_size for path in files)
    with (partial / TOKENS_NAME).open("wb") as out, _progress(cfg.progress, total_bytes) as bar:
        for batch, encoded in _encoded_batches(cfg, read_pieces(files, cfg.text_field)):
            _append(out, batch, encoded, dtype, cfg.tokenizer.info.eos_id, counts)
            bar.update(sum(piece.input_bytes for piece in batch), counts.tokens)
        out.flush()
        os.fsync(out.fileno())
    if counts.tokens == 0:
        raise ValueError(f"INPUT: no text in {', '.join(map(str, cfg.inputs))} (an empty result)")
    manifest = _manifest(cfg, files, counts, dtype)
    (partial / MANIFEST_NAME).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    return manifest


def _append(
    out: IO[bytes], batch: list[Piece], encoded: list[np.ndarray], dtype: np.dtype, eos: int, counts: _Counts
) -> None:
    """A batch's tokens, an end-of-text after each document that has any."""
    parts: list[np.ndarray] = []
    for piece, ids in zip(batch, encoded, strict=True):
        parts.append(ids)
        counts.open_document_tokens += len(ids)
        if piece.ends_document and counts.open_document_tokens:
            parts.append(np.array([eos]))
            counts.documents, counts.open_document_tokens = counts.documents + 1, 0
    if not parts:
        return
    data = np.concatenate(parts).astype(dtype).tobytes()
    out.write(data)
    counts.sha256.update(data)
    counts.tokens += len(data) // dtype.itemsize


def _manifest(cfg: PrepareConfig, files: list[Path], counts: _Counts, dtype: np.dtype) -> Manifest:
    inputs = tuple(InputInfo(str(path), file_sha256(path), path.stat().st_size) for path in files)
    return Manifest(
        FORMAT,
        FORMAT_VERSION,
        cfg.tokenizer.info,
        dtype_for(cfg.tokenizer.info.vocab_size),
        counts.documents,
        counts.tokens,
        counts.sha256.hexdigest(),
        inputs,
        cfg.text_field,
    )


def batches(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    """Pieces grouped into batches of about BATCH_CHARS characters (a function of the pieces only)."""
    batch: list[Piece] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_PIECES:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded_batches(
    cfg: PrepareConfig, pieces: Iterable[Piece]
) -> Iterator[tuple[list[Piece], list[np.ndarray]]]:
    """Each batch with its tokens, in order, while the next batches are read: up to `2 × workers`
    batches are being encoded at once (one worker: a thread, which the tokenizer's encode lets run
    beside the reading; more: spawned processes)."""
    with _encoding_pool(cfg) as pool:
        pending: deque[tuple[list[Piece], Future[list[np.ndarray]]]] = deque()
        for batch in batches(pieces):
            pending.append((batch, pool.submit(_encode_in_worker, [piece.text for piece in batch])))
            if len(pending) >= 2 * cfg.workers:
                done, result = pending.popleft()
                yield done, result.result()
        while pending:
            done, result = pending.popleft()
            yield done, result.result()


def _encoding_pool(cfg: PrepareConfig) -> Executor:
    if cfg.workers == 1:
        _start_worker(cfg.tokenizer, quiet=False)
        return ThreadPoolExecutor(1, thread_name_prefix="prepare-encode")
    return ProcessPoolExecutor(
        cfg.workers,
        mp_context=multiprocessing.get_context("spawn"),  # a fork would copy the reader's state and locks
        initializer=_start_worker,
        initargs=(cfg.tokenizer,),
    )


_worker_encoder: Encoder | None = None


def _start_worker(spec: TokenizerSpec, quiet: bool = True) -> None:
    """The encoder of this process (quiet: without the tokenizer's own thread pool, one of several)."""
    global _worker_encoder
    if quiet:
        quiet_worker_parallelism()
    _worker_encoder = spec.build()


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    assert _worker_encoder is not None
    return _worker_encoder.encode_batch(texts)


class _Bar:
    """tqdm over input bytes with tokens/s beside it, or nothing."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.started = bar, time.monotonic()

    def update(self, input_bytes: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(input_bytes)
            rate = tokens / max(time.monotonic() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)


@contextlib.contextmanager
def _progress(enabled: bool, total_bytes: int) -> Iterator[_Bar]:
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield _Bar(None)
        return
    bar_args = {"unit": "B", "unit_scale": True, "desc": "prepare", "file": sys.stderr, "disable": None}
    with tqdm(total=total_bytes, **bar_args) as bar:  # (disable=None: no bar when not a terminal)
        yield _Bar(bar)
