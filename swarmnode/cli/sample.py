"""`swarmnode sample`: text from a snapshot's global weights, so a volunteer sees what the swarm has
learned. The snapshot is a file, or a live node's newest (HOST:GRPC_PORT: fetched and verified first).

Text becomes tokens with the hf: model's `tokenizer.json` when its directory has one, else as UTF-8
bytes (the byte corpora's vocabulary: ids below 256). Sampling is plain temperature sampling from the
model's own logits (`ModelSpec.logits`), with a seeded generator: the same seed, the same text.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from swarmnode.cli.export import loaded_module, read_or_report, snapshot_spec, snapshot_weights
from swarmnode.core.hf_spec import HfSpec
from swarmnode.core.model_spec import ModelSpec
from swarmnode.net.rpc import PeerUnavailable
from swarmnode.net.snapshot_client import fetch_snapshot
from swarmnode.util.errors import ConfigError


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    tokens: int
    temperature: float
    seed: int
    model: str | None


def sample_command(source: str, request: SampleRequest) -> int:
    """Print the prompt and its continuation; exit 1 when the snapshot cannot be had or read."""
    path = Path(source)
    if path.exists():
        return _sample_file(path, request)
    with tempfile.TemporaryDirectory() as tmp:
        fetched = Path(tmp) / "newest.snap.zst"
        try:
            asyncio.run(fetch_snapshot(source, fetched))
        except ValueError as exc:
            raise ConfigError(f"not a snapshot file nor a HOST:PORT ({exc}), got {source!r}") from None
        except (PeerUnavailable, OSError) as exc:
            print(f"swarmnode sample: {source}: {exc}", file=sys.stderr)
            return 1
        return _sample_file(fetched, request)


def _sample_file(path: Path, request: SampleRequest) -> int:
    loaded = read_or_report(path, "sample")
    if loaded is None:
        return 1
    weights = snapshot_weights(loaded, local=False)
    spec = snapshot_spec(loaded, weights, request.model)
    module = loaded_module(spec, weights)
    codec = TextCodec.for_spec(spec)
    ids = generate(spec, module, codec.encode(request.prompt), request)
    print(request.prompt + codec.decode(ids))
    return 0


@torch.no_grad()
def generate(spec: ModelSpec, module: nn.Module, prompt: list[int], request: SampleRequest) -> list[int]:
    """`request.tokens` new token ids after `prompt` (temperature 0: the most likely each time)."""
    generator = torch.Generator().manual_seed(request.seed)
    ids = torch.tensor([prompt or [0]], dtype=torch.long)
    window = spec.context or ids.shape[1] + request.tokens
    for _ in range(request.tokens):
        logits = spec.logits(module, ids[:, -window:])[0, -1].float()
        if request.temperature <= 0:
            chosen = logits.argmax().view(1)
        else:
            chosen = torch.multinomial(
                torch.softmax(logits / request.temperature, -1), 1, generator=generator
            )
        ids = torch.cat([ids, chosen.view(1, 1)], dim=1)
    return [int(i) for i in ids[0, len(prompt or [0]) :]]


class TextCodec:
    """Text <-> token ids: a `tokenizers` tokenizer, or UTF-8 bytes."""

    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> TextCodec:
        if isinstance(spec, HfSpec):
            directory = spec.path if spec.path.is_dir() else spec.path.parent
            if (directory / "tokenizer.json").is_file():
                import tokenizers  # (the hf extra, present since the hf: model loaded)

                return cls(tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")))
        return cls(None)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())
        return list(self.tokenizer.encode(text).ids)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode(errors="replace")
        return str(self.tokenizer.decode(ids))  # type: ignore[attr-defined]
