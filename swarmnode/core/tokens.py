"""A prepared token directory (made by `swarmnode data prepare`): `tokens.bin` and `manifest.json`.

`tokens.bin` is the documents' tokens back to back, each document followed by the tokenizer's
end-of-text id, as little-endian uint16 (a vocabulary of at most 65,536) or uint32. The manifest names
the format version, the tokenizer (sha256 of its file, vocabulary size, end-of-text id), the counts, each
input's sha256 and size, and the token file's sha256. A node reads the tokens by memmap after checking
the file's size against the manifest; `verify_prepared` hashes the whole file.

The manifest's digest (`ManifestDigest`) covers what the tokens are, never where they came from: the
format, the tokenizer, the dtype, the counts and the token file's sha256, not the inputs' paths or the
time of preparation. Two volunteers who prepared the same data with the same tokenizer share a digest
(and so a run), wherever their files live.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

FORMAT = "swarmnode-tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENS_NAME = "tokens.bin"
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
HASH_BLOCK = 1 << 24


class TokenizerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    """What was given: `bytes`, a tokenizer file's or directory's name."""
    sha256: str
    vocab_size: int
    eos_id: int


class InputInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    sha256: str
    size: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    version: int
    tokenizer: TokenizerInfo
    dtype: str
    documents: int
    tokens: int
    tokens_sha256: str
    inputs: tuple[InputInfo, ...]
    text_field: str

    def digest(self) -> str:
        """sha256 of what the tokens are (not of where they came from): the corpus digest of a run."""
        agreed = {
            "format": self.format,
            "version": self.version,
            "tokenizer_sha256": self.tokenizer.sha256,
            "vocab_size": self.tokenizer.vocab_size,
            "eos_id": self.tokenizer.eos_id,
            "dtype": self.dtype,
            "documents": self.documents,
            "tokens": self.tokens,
            "tokens_sha256": self.tokens_sha256,
        }
        return hashlib.sha256(json.dumps(agreed, sort_keys=True).encode()).hexdigest()


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class PreparedTokens:
    tokens: np.ndarray
    manifest: Manifest
    digest: str

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size


def read_manifest(directory: Path, flag: str) -> Manifest:
    """The directory's manifest, checked; ValueError (one line naming `flag` and the path) otherwise."""
    path = directory / MANIFEST_NAME
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
    except FileNotFoundError:
        raise ValueError(
            f"{flag}: no {MANIFEST_NAME} (not a prepared directory), got {str(directory)!r}"
        ) from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(
            f"{flag}: {MANIFEST_NAME} is not a token manifest ({exc}), got {str(path)!r}"
        ) from None
    if manifest.format != FORMAT or manifest.version != FORMAT_VERSION:
        raise ValueError(
            f"{flag}: {MANIFEST_NAME} is {manifest.format!r} version {manifest.version}, this swarmnode "
            f"reads {FORMAT!r} version {FORMAT_VERSION}; prepare the data again, got {str(path)!r}"
        )
    if manifest.dtype not in DTYPES:
        raise ValueError(f"{flag}: {MANIFEST_NAME} names dtype {manifest.dtype!r}, got {str(path)!r}")
    return manifest


def load_prepared(directory: Path, flag: str = "--data") -> PreparedTokens:
    """The directory's tokens by memmap, after the manifest and the token file's size are checked."""
    manifest = read_manifest(directory, flag)
    path = directory / TOKENS_NAME
    dtype = DTYPES[manifest.dtype]
    size = path.stat().st_size if path.exists() else -1
    if size != manifest.tokens * dtype.itemsize:
        raise ValueError(
            f"{flag}: {TOKENS_NAME} holds {size} bytes, the manifest says {manifest.tokens} {manifest.dtype} "
            f"tokens; prepare the data again, got {str(directory)!r}"
        )
    if manifest.tokens == 0:
        raise ValueError(f"{flag}: the prepared directory holds no tokens, got {str(directory)!r}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return PreparedTokens(tokens, manifest, manifest.digest())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def verify_prepared(directory: Path) -> list[str]:
    """What is wrong with a prepared directory (empty: nothing): the token file's sha256 and size,
    and that every token is below the vocabulary size."""
    prepared = load_prepared(directory, "DIR")
    manifest, problems = prepared.manifest, []
    if file_sha256(directory / TOKENS_NAME) != manifest.tokens_sha256:
        problems.append(f"{TOKENS_NAME}: sha256 differs from the manifest's {manifest.tokens_sha256}")
    largest = max(int(block.max()) for block in _blocks(prepared.tokens))
    if largest >= manifest.tokenizer.vocab_size:
        problems.append(
            f"{TOKENS_NAME}: token {largest} is not below the vocabulary size {manifest.tokenizer.vocab_size}"
        )
    eos_count = sum(
        int(np.count_nonzero(block == manifest.tokenizer.eos_id)) for block in _blocks(prepared.tokens)
    )
    if eos_count < manifest.documents:
        problems.append(f"{TOKENS_NAME}: {eos_count} end-of-text tokens for {manifest.documents} documents")
    return problems


def _blocks(tokens: np.ndarray, size: int = 1 << 24) -> list[np.ndarray]:
    return [tokens[start : start + size] for start in range(0, len(tokens), size)]
