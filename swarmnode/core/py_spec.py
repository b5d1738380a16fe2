"""The user's own `nn.Module` as a model spec (`--model py:package.module:factory`).

The contract (README "Your own model", docs/models.md): `factory(vocab_size: int) -> nn.Module`; the
module's `forward(input_ids)` takes [batch, time] int64 token ids and returns [batch, time, vocab]
logits (or an object with `.logits`); an int attribute `context` on the module, if any, caps --seq-len.
The factory must be deterministic given the torch RNG (the node seeds it), importable from the node's
Python path, and its source file's sha256 enters the run digest.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmnode.core.model import next_token_loss
from swarmnode.util.errors import ConfigError


@dataclass(frozen=True)
class PySpec:
    target: str
    """package.module:factory"""
    factory: Callable[[int], nn.Module]
    source_sha256: str
    vocab_size: int
    context: int | None

    @classmethod
    def load(cls, target: str, vocab_size: int) -> PySpec:
        factory = _factory(target)
        source = inspect.getsourcefile(factory)
        if source is None:
            raise ConfigError(f"--model: the factory has no source file, got 'py:{target}'")
        digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()
        probe = _seeded(factory, vocab_size, 0)
        context = getattr(probe, "context", None)
        return cls(target, factory, digest, vocab_size, context if isinstance(context, int) else None)

    @property
    def label(self) -> str:
        return f"py:{self.target}"

    def build(self, seed: int, device: torch.device) -> nn.Module:
        return _seeded(self.factory, self.vocab_size, seed).to(device)

    def logits(self, module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        out = module(inputs)
        return out if isinstance(out, torch.Tensor) else out.logits

    def loss(self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.logits(module, inputs), targets)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.label,
            "model_cfg": {"source_sha256": self.source_sha256, "vocab_size": self.vocab_size},
        }

    def export_hf(self, module: nn.Module, out: Path) -> None:
        """Only a factory that returns a `transformers` model (it has `save_pretrained`) exports as one."""
        save = getattr(module, "save_pretrained", None)
        if save is None:
            raise ConfigError(
                f"--format hf: py:{self.target} is no transformers model; use --format safetensors"
            )
        save(out, safe_serialization=True)


def _factory(target: str) -> Callable[[int], nn.Module]:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--model: cannot import {module_name!r} ({exc}), got 'py:{target}'") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"--model: {module_name} has no callable {attribute!r}, got 'py:{target}'")
    return factory  # type: ignore[no-any-return]


def _seeded(factory: Callable[[int], nn.Module], vocab_size: int, seed: int) -> nn.Module:
    """factory(vocab_size) with the torch RNG seeded (and the process's own state put back)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        module = factory(vocab_size)
    finally:
        torch.random.set_rng_state(state)
    if not isinstance(module, nn.Module):
        raise ConfigError(f"--model: the factory returned {type(module).__name__}, not an nn.Module")
    return module
