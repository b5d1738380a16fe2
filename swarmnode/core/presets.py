"""The GPT presets: shapes only, no torch (the CLI's flag table reads their names).

With the byte vocabulary of 256: tiny ≈ 0.45M parameters, small ≈ 10.8M, base ≈ 85M (≈ 124M with
GPT-2's 50k vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_embd: int
    n_head: int
    context: int
    vocab_size: int = 256

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layer=2, n_embd=128, n_head=4, context=128),
    "small": ModelConfig(n_layer=6, n_embd=384, n_head=6, context=256),
    "base": ModelConfig(n_layer=12, n_embd=768, n_head=12, context=512),
}


def preset(name: str, vocab_size: int) -> ModelConfig:
    base = PRESETS[name]
    return ModelConfig(base.n_layer, base.n_embd, base.n_head, base.context, vocab_size)


MODEL_PRESETS = tuple(PRESETS)
