"""`swarmnode bench prepare`: `data prepare`'s tokens/s against the tokenizer's own `encode_batch` on the
same documents in the same run, and the peak RSS of a `data prepare` process on a generated jsonl of
`--input-gb` GB (default 1; written to a temporary directory and deleted after).

The tokenizer is a byte-level BPE (vocabulary 8,192) trained here on the default corpus; the documents
are the corpus's paragraphs, `--rounds` copies of them (default 4). The anchor encodes the documents,
already in memory, in batches of 1,024 with `encode_batch`; prepare reads them from a jsonl file, encodes,
and writes and hashes the token file. The memory run uses the `bytes` tokenizer (its bound comes from the
streaming, not the tokenizer; a BPE on a gigabyte takes minutes on two cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from swarmnode.bench.runner import BenchResult, load_note, median
from swarmnode.core.data import default_corpus
from swarmnode.core.encoders import load_tokenizer
from swarmnode.core.prepare import PrepareConfig, prepare
from swarmnode.util.errors import ConfigError

ANCHOR_BATCH = 1024
VOCAB = 8192


def bench_prepare(preset: str, rounds: int = 4, input_gb: float = 1.0) -> BenchResult:
    result = BenchResult("prepare", preset)
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "bench prepare: needs the tokenizers package: pip install 'swarmnode[hf]'"
        ) from None
    docs = [doc for doc in default_corpus().tokens.tobytes().decode().split("\n\n") if doc.strip()] * rounds
    with tempfile.TemporaryDirectory(prefix="swarmnode-bench-prepare-") as tmp:
        root = Path(tmp)
        tok_file = _train_bpe(tokenizers, root / "bpe.json")
        jsonl = root / "docs.jsonl"
        jsonl.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
        _speed(result, tokenizers, docs, tok_file, jsonl, root)
        if input_gb > 0:
            _memory(result, root, input_gb)
    return result


def _train_bpe(tk: Any, path: Path) -> Path:
    """A byte-level BPE trained on the default corpus (`tk`: the tokenizers module)."""
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    text = default_corpus().tokens.tobytes().decode()
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    tokenizer.save(str(path))
    return path


def _speed(
    result: BenchResult, tokenizers: Any, docs: list[str], tok_file: Path, jsonl: Path, root: Path
) -> None:
    anchors: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": []}
    prepares: list[float] = []
    for attempt in range(2):  # interleaved, so every side sees the same machine
        for method, rates in anchors.items():
            fresh = tokenizers.Tokenizer.from_file(str(tok_file))  # (its word cache as cold as prepare's)
            rates.append(_anchor_rate(getattr(fresh, method), docs))
        out = root / f"prepared-{attempt}"
        started = time.perf_counter()
        manifest = prepare(PrepareConfig((jsonl,), load_tokenizer(str(tok_file)), out, progress=False))
        prepares.append((manifest.tokens - manifest.documents) / (time.perf_counter() - started))
    note = f"{len(docs):,} documents, {manifest.tokens - manifest.documents:,} tokens, BPE vocab {VOCAB}"
    result.add("tokenizer encode_batch (anchor)", median(anchors["encode_batch"]), "tokens/s", note)
    result.add("tokenizer encode_batch_fast (no offsets)", median(anchors["encode_batch_fast"]), "tokens/s")
    result.add("data prepare --workers 1 (jsonl → tokens.bin)", median(prepares), "tokens/s", load_note())
    for method, rates in anchors.items():
        result.ratio(f"prepare / {method} tokens/s", median(prepares) / median(rates), "target ≥ 0.8")


def _anchor_rate(encode: Any, docs: list[str]) -> float:
    """Tokens/s of the tokenizer's own batch encoding of `docs` (in memory), ANCHOR_BATCH at a time."""
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(docs), ANCHOR_BATCH):
        tokens += sum(
            len(e.ids) for e in encode(docs[start : start + ANCHOR_BATCH], add_special_tokens=False)
        )
    return tokens / (time.perf_counter() - started)


PEAK_RSS_CHILD = """
import sys
from swarmnode.cli.main import main
code = main(sys.argv[1:])
status = open("/proc/self/status").read()
print(next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")))
sys.exit(code)
"""
"""`data prepare` in a fresh process that prints its own peak RSS in kB (VmHWM belongs to the process's
own memory map, so unlike ru_maxrss it does not inherit the parent's peak across fork and exec)."""


def _memory(result: BenchResult, root: Path, input_gb: float) -> None:
    big = root / "big.jsonl"
    size = _write_big_jsonl(big, int(input_gb * 1e9))
    command = [sys.executable, "-c", PEAK_RSS_CHILD, "data", "prepare", str(big)]
    command += ["--tokenizer", "bytes", "--out", str(root / "big-prepared"), "--no-progress"]
    started = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak_mb = int(done.stdout.split()[-1]) / 1024
    note = f"{size / 1e9:.2f} GB jsonl, bytes tokenizer"
    result.add("data prepare peak RSS (its own process)", peak_mb, "MB", note)
    result.add("data prepare of it", size / seconds / 1e6, "MB/s", f"{seconds:.0f} s")
    result.ratio("prepare peak RSS / 1 GB", peak_mb / 1000, "target ≤ 1")


def _write_big_jsonl(path: Path, size: int) -> int:
    """About `size` bytes of jsonl: the default corpus's paragraphs over and over, each line numbered."""
    paragraphs = [p for p in default_corpus().tokens.tobytes().decode().split("\n\n") if p.strip()]
    written, line = 0, 0
    with path.open("w") as f:
        while written < size:
            block = "".join(json.dumps({"id": line + i, "text": p}) + "\n" for i, p in enumerate(paragraphs))
            f.write(block)
            written, line = written + len(block.encode()), line + len(paragraphs)
    return path.stat().st_size
