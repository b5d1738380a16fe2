"""Tokenizers that `swarmnode data prepare` encodes with: `bytes`, a `tokenizers` JSON file, or a local
`transformers` tokenizer directory (its `tokenizer.json`; nothing is fetched from a hub).

A `TokenizerSpec` is what a worker process needs to build the same encoder (it pickles); its sha256 is
the tokenizer file's, so two volunteers with the same file get the same manifest digest. The end-of-text
id that separates documents is `--eos TOKEN` when given, else the directory's `tokenizer_config.json`
`eos_token`, else the first special token named like one (`<|endoftext|>`, `</s>`, …).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from swarmnode.core.tokens import TokenizerInfo

BYTES = "bytes"
BYTES_EOS = 256
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


class Encoder(Protocol):
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's token ids (no special tokens added, no end-of-text)."""
        ...


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as given on the command line, resolved: enough to rebuild it in a worker."""

    name: str
    file: Path | None
    """The `tokenizer.json`; None for `bytes`."""
    info: TokenizerInfo

    def build(self) -> Encoder:
        if self.file is None:
            return BytesEncoder()
        return HFEncoder(_load_tokenizers_file(self.file, self.name))


def load_tokenizer(given: str, eos: str | None = None) -> TokenizerSpec:
    """`bytes`, a tokenizers JSON file or a transformers tokenizer directory; ValueError (one line
    naming --tokenizer or --eos and the value) when it cannot be used."""
    if given == BYTES:
        if eos is not None:
            raise ValueError(f"--eos: the bytes tokenizer's end-of-text is {BYTES_EOS}, got {eos!r}")
        info = TokenizerInfo(BYTES, hashlib.sha256(b"swarmnode-bytes").hexdigest(), BYTES_EOS + 1, BYTES_EOS)
        return TokenizerSpec(BYTES, None, info)
    path = Path(given)
    if path.is_dir():
        file, config = path / "tokenizer.json", _read_json(path / "tokenizer_config.json")
        if not file.is_file():
            raise ValueError(
                f"--tokenizer: {str(path)!r} has no tokenizer.json "
                "(a fast tokenizer saved with save_pretrained)"
            )
    elif path.is_file():
        file, config = path, {}
    else:
        raise ValueError(
            f"--tokenizer: not 'bytes', a tokenizer.json or a tokenizer directory, got {given!r}"
        )
    tokenizer = _load_tokenizers_file(file, given)
    eos_id = _eos_id(tokenizer, eos or _configured_eos(config), given)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    info = TokenizerInfo(path.name, _sha256(file), max(vocab, eos_id + 1), eos_id)
    return TokenizerSpec(given, file, info)


def _load_tokenizers_file(file: Path, given: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer: needs the tokenizers package: pip install 'swarmnode[hf]'") from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"--tokenizer: {str(file)!r} does not parse as a tokenizer ({reason}), got {given!r}"
        ) from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"--tokenizer: {str(path)!r} is not JSON ({exc})") from None
    return value if isinstance(value, dict) else {}


def _configured_eos(config: dict[str, Any]) -> str | None:
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _eos_id(tokenizer: Any, eos: str | None, given: str) -> int:
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise ValueError(f"--eos: the tokenizer {given!r} has no token {eos!r}")
        return int(eos_id)
    for candidate in EOS_CANDIDATES:
        eos_id = tokenizer.token_to_id(candidate)
        if eos_id is not None:
            return int(eos_id)
    raise ValueError(f"--tokenizer: no end-of-text token found in {given!r}; name one with --eos TOKEN")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class BytesEncoder:
    """UTF-8 bytes as tokens 0–255; 256 is the end-of-text."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class HFEncoder:
    """A `tokenizers.Tokenizer`'s own `encode_batch` (parallel inside, in Rust)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # encode_batch_fast (tokenizers ≥ 0.20) skips computing offsets, which nobody here reads.
        self._encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._encode(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.uint32) for encoding in encodings]


def quiet_worker_parallelism() -> None:
    """In a worker process of a pool, tokenizers' own thread pool would compete with the other workers."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
