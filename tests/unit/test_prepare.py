"""`swarmnode data prepare`: every input format gives the same tokens, whatever --workers; the manifest's
digest (not the path) is the run's corpus digest; bad input is one line and exit 2, leaving nothing."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

from swarmnode.bench.procs import wait_until
from swarmnode.cli.main import main
from swarmnode.core.data import ShardLoader, default_corpus, load_corpus
from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.tokens import load_prepared
from swarmnode.core.training import run_digest

tokenizers = pytest.importorskip("tokenizers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [f"Act {i}.\nTo be, or not to be: that is the question {i}.\n" * (i + 1) for i in range(40)] + [
    "Ünïcödé, ☃ and \u00a0 spaces"
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained here on the default corpus (no hub)."""
    text = default_corpus().tokens[:1_000_000].tobytes().decode("utf-8")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The same documents as a txt directory, jsonl (plain, gz, zst), parquet and a saved dataset."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "txt").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "txt" / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    lines = "".join(json.dumps({"text": doc, "id": i}) + "\n" for i, doc in enumerate(DOCS)).encode()
    (root / "d.jsonl").write_bytes(lines)
    (root / "d.jsonl.gz").write_bytes(gzip.compress(lines))
    (root / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(
        pa.table({"id": list(range(len(DOCS))), "text": DOCS}), root / "d.parquet", row_group_size=7
    )
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(root / "saved"))
    split = len(DOCS) // 2
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS[:split]}),
            "test": datasets.Dataset.from_dict({"text": DOCS[split:]}),
        }
    ).save_to_disk(str(root / "saved_dict"))
    return {
        "txt": root / "txt",
        "jsonl": root / "d.jsonl",
        "gz": root / "d.jsonl.gz",
        "zst": root / "d.jsonl.zst",
        "parquet": root / "d.parquet",
        "datasets": root / "saved",
        "datasets_dict": root / "saved_dict",
    }


def prepare(inputs: list[Path], out: Path, tokenizer: str, *extra: str) -> int:
    return main(["data", "prepare", *map(str, inputs), "--tokenizer", tokenizer, "--out", str(out), *extra])


def test_every_format_gives_the_same_tokens(tmp_path, bpe, inputs, capsys) -> None:
    expected = tokenizers.Tokenizer.from_file(str(bpe)).encode_batch(DOCS, add_special_tokens=False)
    eos = tokenizers.Tokenizer.from_file(str(bpe)).token_to_id("<|endoftext|>")
    want = np.concatenate([np.append(e.ids, eos) for e in expected]).astype(np.uint16)
    for name, path in inputs.items():
        assert prepare([path], tmp_path / name, str(bpe), "--no-progress") == 0, name
        prepared = load_prepared(tmp_path / name)
        assert np.array_equal(prepared.tokens, want), name
        assert prepared.manifest.documents == len(DOCS) and prepared.manifest.tokenizer.eos_id == eos
    digests = {load_prepared(tmp_path / name).digest for name in inputs}
    assert len(digests) == 1  # the digest says what the tokens are, not where they came from
    assert "41 documents" in capsys.readouterr().out


def test_output_is_byte_identical_whatever_workers(tmp_path, bpe, inputs, monkeypatch) -> None:
    monkeypatch.setattr("swarmnode.core.readers.PIECE_CHARS", 100)  # many pieces, many batches
    monkeypatch.setattr("swarmnode.core.prepare.BATCH_CHARS", 500)
    sources = [inputs["jsonl"], inputs["txt"], inputs["parquet"]]
    for workers in (1, 3):
        assert prepare(sources, tmp_path / f"w{workers}", str(bpe), "--workers", str(workers)) == 0
    one, three = (tmp_path / "w1", tmp_path / "w3")
    assert (one / "tokens.bin").read_bytes() == (three / "tokens.bin").read_bytes()
    assert load_prepared(one).digest == load_prepared(three).digest
    assert load_prepared(one).manifest.documents == 3 * len(DOCS)


def test_a_transformers_tokenizer_directory_and_bytes(tmp_path, bpe, inputs) -> None:
    saved = tmp_path / "hf-tokenizer"
    saved.mkdir()
    shutil.copy(bpe, saved / "tokenizer.json")
    (saved / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert prepare([inputs["jsonl"]], tmp_path / "hf", str(saved)) == 0
    assert load_prepared(tmp_path / "hf").digest == _prepared_digest(
        tmp_path / "file", [inputs["jsonl"]], bpe
    )
    assert prepare([inputs["jsonl"]], tmp_path / "bytes", "bytes") == 0
    raw = load_prepared(tmp_path / "bytes")
    assert raw.manifest.tokenizer.vocab_size == 257 and raw.tokens.dtype == np.uint16
    assert bytes(raw.tokens[: len(DOCS[0].encode())].astype(np.uint8)) == DOCS[0].encode()


def _prepared_digest(out: Path, inputs: list[Path], tokenizer: Path) -> str:
    assert prepare(inputs, out, str(tokenizer)) == 0
    return load_prepared(out).digest


def test_the_manifest_digest_is_the_run_corpus_digest(tmp_path, bpe, inputs) -> None:
    assert prepare([inputs["parquet"]], tmp_path / "a", str(bpe)) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "b")
    a, b = load_corpus(str(tmp_path / "a")), load_corpus(str(tmp_path / "elsewhere" / "b"))
    assert a.digest == b.digest == load_prepared(tmp_path / "a").digest and a.vocab_size == 600

    def digest(corpus) -> str:
        return run_digest(GptSpec.preset("tiny", corpus.vocab_size), 16, 4, 0, DilocoConfig(), corpus.digest)

    assert digest(a) == digest(b)
    assert prepare([inputs["parquet"]], tmp_path / "c", "bytes") == 0
    assert digest(load_corpus(str(tmp_path / "c"))) != digest(a)
    loader = ShardLoader(a, 1, 2, 2, 8, seed=0)  # a node reads it by memmap
    batch = loader.next_batch()
    assert batch.inputs.shape == (2, 8) and int(batch.inputs.max()) < 600


def test_verify_finds_a_changed_token_file(tmp_path, bpe, inputs, capsys) -> None:
    assert prepare([inputs["jsonl"]], tmp_path / "p", str(bpe)) == 0
    assert main(["data", "verify", str(tmp_path / "p")]) == 0
    tokens = tmp_path / "p" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[10] ^= 1
    tokens.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["data", "verify", str(tmp_path / "p")]) == 1
    assert "sha256 differs" in capsys.readouterr().out
    tokens.write_bytes(bytes(data[:-2]))
    assert main(["data", "verify", str(tmp_path / "p")]) == 2


def _one_line_error(capsys, *needles: str) -> None:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_bad_inputs_are_one_line_exit_2_and_leave_nothing(tmp_path, bpe, inputs, capsys) -> None:
    out = tmp_path / "out"
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    assert prepare([tmp_path / "nocol.parquet"], out, str(bpe)) == 2
    _one_line_error(capsys, "nocol.parquet", "no column 'text'", "body")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    assert prepare([tmp_path / "bad.jsonl"], out, str(bpe)) == 2
    _one_line_error(capsys, "bad.jsonl", "line 2", "not JSON")
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    assert prepare([tmp_path / "nofield.jsonl"], out, str(bpe)) == 2
    _one_line_error(capsys, "nofield.jsonl", "line 1", "'text'")
    (tmp_path / "tok.json").write_text('{"version": "1.0", "model": 7}')
    assert prepare([inputs["jsonl"]], out, str(tmp_path / "tok.json")) == 2
    _one_line_error(capsys, "tok.json", "does not parse")
    (tmp_path / "empty.txt").write_text("")
    assert prepare([tmp_path / "empty.txt"], out, str(bpe)) == 2
    _one_line_error(capsys, "empty result")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert prepare([tmp_path / "latin1.txt"], out, "bytes") == 2
    _one_line_error(capsys, "latin1.txt", "not UTF-8", "byte 3")
    assert prepare([inputs["jsonl"]], out, str(bpe), "--eos", "<nope>") == 2
    _one_line_error(capsys, "--eos", "<nope>")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert prepare([inputs["jsonl"]], out, "bytes") == 0
    assert prepare([inputs["jsonl"]], out, "bytes") == 2  # never over an existing directory
    _one_line_error(capsys, "--out", "already exists")


def test_a_killed_prepare_leaves_nothing_a_node_would_accept(tmp_path) -> None:
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": "To be, or not to be, that is the question. " * 40}) + "\n"
    big.write_text(line * 60_000)  # ~100 MB: long enough to be killed on the way
    out = tmp_path / "out"
    command = [sys.executable, "-m", "swarmnode.cli", "data", "prepare", str(big), "--tokenizer", "bytes"]
    child = subprocess.Popen([*command, "--out", str(out)], stderr=subprocess.DEVNULL)
    try:
        partial = wait_until(lambda: next(tmp_path.glob(".out.partial-*/tokens.bin"), None), 60, "tokens")
        wait_until(lambda: partial.stat().st_size > 0, 60, "the first tokens written")
    finally:
        child.kill()
        child.wait(30)
    assert not out.exists()
    with pytest.raises(ValueError, match="no manifest.json"):
        load_corpus(str(partial.parent))
    dry = ["run", "--dry-run", "--data", str(partial.parent), "--data-dir", str(tmp_path / "node")]
    assert main(dry) == 2
