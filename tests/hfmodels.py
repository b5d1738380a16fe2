"""Tiny `transformers` causal LMs for the tests: written as a config directory (`hf:DIR`), or with
weights (`save_pretrained`), and a `py:` factory module."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def llama_config(directory: Path, **changes: object) -> Path:
    """A 2-layer, hidden-64 Llama config (byte vocabulary) in `directory`; returns the directory."""
    transformers.LlamaConfig(**{**LLAMA, **changes}).save_pretrained(directory)
    return directory


def pretrained_llama(directory: Path, seed: int = 11) -> Path:
    """The same Llama with weights of its own (seeded), saved with `save_pretrained`."""
    transformers.set_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.save_pretrained(directory)
    return directory
