"""Documents from the files datasets ship in, streamed: `.txt` (a file is one document), `.jsonl`
(`.gz`, `.zst`; a line is one document, its `--text-field`), `.parquet` (a row is one document, its
text column), a directory of them, and a Hugging Face `datasets` dataset saved with `save_to_disk`
(its Arrow files read with pyarrow; `datasets` itself is not needed).

Each reader yields `Piece`s in a fixed order, so the same inputs give the same tokens. A long text is
cut into pieces at line ends (at most `PIECE_CHARS` characters each) so no single document has to fit
in memory at once; only a document's last piece ends it. Anything unreadable is a ValueError naming the
file and the line, row or column (the CLI prints it as one line, exit 2).
"""

from __future__ import annotations

import gzip
import io
import json
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec
import zstandard

PIECE_CHARS = 1 << 20
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
DATASETS_MARKERS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Piece:
    text: str
    ends_document: bool
    input_bytes: int
    """How many bytes of input files this piece accounts for (for progress)."""


def input_files(given: list[Path]) -> list[Path]:
    """Every file the inputs name, in reading order (a directory: sorted by path)."""
    files: list[Path] = []
    for path in given:
        if not path.exists():
            raise ValueError(f"INPUT: no such file or directory, got {str(path)!r}")
        files.extend(_files_of(path) if path.is_dir() else [_checked_suffix(path)])
    if not files:
        raise ValueError(
            f"INPUT: no .txt, .jsonl(.gz/.zst) or .parquet files in {', '.join(map(str, given))}"
        )
    return files


def _files_of(directory: Path) -> list[Path]:
    if _is_datasets_dir(directory):
        return _datasets_arrow_files(directory)
    found = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [_checked_suffix(p) for p in found]


def _checked_suffix(path: Path) -> Path:
    if _kind(path) is None:
        raise ValueError(
            f"INPUT: not .txt, .jsonl(.gz/.zst), .parquet or a saved datasets directory, got {str(path)!r}"
        )
    return path


def _kind(path: Path) -> str | None:
    name = path.name
    for kind, suffixes in (
        ("txt", TEXT_SUFFIXES),
        ("jsonl", JSONL_SUFFIXES),
        ("parquet", PARQUET_SUFFIXES),
        ("arrow", (".arrow",)),
    ):
        if name.endswith(suffixes):
            return kind
    return None


def _is_datasets_dir(directory: Path) -> bool:
    return any((directory / marker).is_file() for marker in DATASETS_MARKERS)


def _datasets_arrow_files(directory: Path) -> list[Path]:
    """A saved `Dataset`'s Arrow files (state.json order); a `DatasetDict`'s splits in its own order."""
    if (directory / "dataset_dict.json").is_file():
        splits = _json_file(directory / "dataset_dict.json").get("splits", [])
        return [file for split in splits for file in _datasets_arrow_files(directory / str(split))]
    state = _json_file(directory / "state.json")
    files = [directory / str(entry.get("filename", "")) for entry in state.get("_data_files", [])]
    if not files:
        raise ValueError(f"INPUT: {str(directory / 'state.json')!r} lists no data files")
    return files


def _json_file(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"INPUT: cannot read {str(path)!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"INPUT: {str(path)!r} is not a JSON object")
    return value


def read_pieces(files: list[Path], text_field: str) -> Iterator[Piece]:
    """Every input's documents, in order, cut into pieces."""
    for path in files:
        kind = _kind(path)
        if kind == "txt":
            yield from _text_pieces(path)
        elif kind == "jsonl":
            yield from _jsonl_pieces(path, text_field)
        else:
            yield from _arrow_pieces(path, text_field, parquet=kind == "parquet")


def _text_pieces(path: Path) -> Iterator[Piece]:
    """A text file is one document, read a block of whole lines at a time."""
    offset = 0
    with path.open("rb") as f:
        lines = f.readlines(PIECE_CHARS)
        while lines:
            block, lines = b"".join(lines), f.readlines(PIECE_CHARS)
            for piece in split_document(_utf8(block, path, offset), len(block)):
                yield Piece(piece.text, piece.ends_document and not lines, piece.input_bytes)
            offset += len(block)
    if offset == 0:
        yield Piece("", True, 0)


def _utf8(block: bytes, path: Path, offset: int) -> str:
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{str(path)!r}: not UTF-8 text at byte {offset + exc.start}") from None


def _open_jsonl(raw: IO[bytes], path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return typing.cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    if path.name.endswith(".zst"):
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


def _jsonl_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    """A line is one document; progress counts the file's (maybe compressed) bytes read so far."""
    consumed, decode = 0, _document_decoder(text_field)
    try:
        with path.open("rb") as raw, _open_jsonl(raw, path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = decode(line).text
                except msgspec.MsgspecError:
                    text = _jsonl_text(line, path, number, text_field)  # (it says what is wrong)
                progress, consumed = raw.tell() - consumed, raw.tell()
                yield from split_document(text, progress)
    except (OSError, EOFError, zstandard.ZstdError) as exc:
        raise ValueError(f"{str(path)!r}: cannot decompress it ({exc})") from None


def _document_decoder(text_field: str) -> Any:
    """msgspec's decoder of a line that builds only the text field's value (the fast path)."""
    document = msgspec.defstruct("Document", [("text", str)], rename={"text": text_field})
    return msgspec.json.Decoder(document).decode


def _jsonl_text(line: bytes, path: Path, number: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{str(path)!r} line {number}: not JSON ({exc})") from None
    if not isinstance(record, dict) or text_field not in record:
        raise ValueError(f"{str(path)!r} line {number}: no {text_field!r} field (--text-field)")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{str(path)!r} line {number}: {text_field!r} is {type(text).__name__}, not text")
    return text


def split_document(text: str, input_bytes: int) -> Iterator[Piece]:
    """A document as pieces of at most about PIECE_CHARS characters, cut after a line end when one is
    near (else anywhere): the tokenizer never sees one huge string."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = text.rfind("\n", start, start + PIECE_CHARS) + 1
        cut = cut if cut > start else start + PIECE_CHARS
        yield Piece(text[start:cut], False, 0)
        start = cut
    yield Piece(text[start:], True, input_bytes)


def _arrow_pieces(path: Path, text_field: str, parquet: bool) -> Iterator[Piece]:
    """Rows of a parquet file or a datasets Arrow file, a record batch at a time."""
    row = 0
    for column, input_bytes in _text_columns(path, text_field, parquet):
        texts = column.to_pylist()
        for offset, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"{str(path)!r} row {row + offset}: column {text_field!r} is not text")
            yield from split_document(text, input_bytes if offset == len(texts) - 1 else 0)
        row += len(texts)


def _text_columns(path: Path, text_field: str, parquet: bool) -> Iterator[tuple[Any, int]]:
    """The text column, a record batch at a time, with the share of the file's bytes it stands for."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"INPUT: reading {str(path)!r} needs pyarrow: pip install 'swarmnode[hf]'") from None
    size = path.stat().st_size
    try:
        if parquet:
            source = pq.ParquetFile(path)
            _check_column(path, source.schema_arrow, text_field, pa)
            rows = max(source.metadata.num_rows, 1)
            for batch in source.iter_batches(batch_size=1024, columns=[text_field]):
                yield batch.column(0), size * batch.num_rows // rows
            return
        with pa.memory_map(str(path)) as mapped:
            reader = pa.ipc.open_stream(mapped)
            _check_column(path, reader.schema, text_field, pa)
            for batch in reader:
                yield batch.column(text_field), batch.nbytes
    except (pa.ArrowException, OSError) as exc:
        kind = "parquet" if parquet else "Arrow"
        raise ValueError(f"{str(path)!r}: not a readable {kind} file ({exc})") from None


def _check_column(path: Path, schema: Any, text_field: str, pa: Any) -> None:
    if text_field not in schema.names:
        raise ValueError(
            f"{str(path)!r}: no column {text_field!r} (--text-field); it has {', '.join(schema.names)}"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{str(path)!r}: column {text_field!r} is {kind}, not text")
