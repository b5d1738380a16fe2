"""The model seam: what a node trains is a `ModelSpec` it is given, never a model it builds itself.

A spec builds the module for a seed and a device (every node of a run starts identical), computes the
logits and the loss of a batch, names its vocabulary and context, describes itself for the run digest
(nodes whose descriptions differ never average) and writes the trained weights as a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads. Three implementations: the GPT presets
(`gpt_spec.py`), Hugging Face causal LMs (`hf_spec.py`) and the user's own module (`py_spec.py`).
Nothing outside them — training, snapshots, the swarm — knows which one it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.hf_spec import HfSpec
from swarmnode.core.model_choice import ModelChoice, ModelKind, parse_model_choice
from swarmnode.core.py_spec import PySpec
from swarmnode.util.errors import ConfigError


class ModelSpec(Protocol):
    """What the daemon needs to know of a model (README "Your own model", docs/models.md)."""

    @property
    def label(self) -> str:
        """The --model value it came from; snapshots record it as their `model`."""

    @property
    def vocab_size(self) -> int:
        """Token ids of the run's data must be below it."""

    @property
    def context(self) -> int | None:
        """The longest sequence the module takes (None: it sets no limit)."""

    def build(self, seed: int, device: torch.device) -> nn.Module:
        """The initial module, a pure function of (spec, seed), on `device`."""

    def logits(self, module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """[batch, time, vocab] logits of [batch, time] token ids."""

    def loss(self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the batch (a scalar to call `backward` on)."""

    def describe(self) -> dict[str, Any]:
        """What the run digest holds of the model: `model` (a name) and `model_cfg` (its shape, and
        whatever else must agree for nodes to average, e.g. the starting weights' hash)."""

    def export_hf(self, module: nn.Module, out: Path) -> None:
        """Write `module` (trained weights loaded) into the empty directory `out` so that
        `AutoModelForCausalLM.from_pretrained(out)` loads it; ConfigError where that is impossible."""


def load_model_spec(choice: str | ModelChoice, vocab_size: int) -> ModelSpec:
    """The spec a --model value names, for data of `vocab_size` token ids (a GPT preset takes it as its
    vocabulary; the others must cover it). ConfigError (exit 2, naming --model) when it cannot be had."""
    if isinstance(choice, str):
        try:
            choice = parse_model_choice(choice)
        except ValueError as exc:
            raise ConfigError(f"--model: {exc}, got {choice!r}") from None
    spec: ModelSpec
    if choice.kind is ModelKind.GPT:
        spec = GptSpec.preset(choice.argument, vocab_size)
    elif choice.kind is ModelKind.HF:
        spec = HfSpec.load(choice.argument)
    else:
        spec = PySpec.load(choice.argument, vocab_size)
    if vocab_size > spec.vocab_size:
        raise ConfigError(
            f"--model: its vocabulary of {spec.vocab_size} is smaller than the data's {vocab_size} "
            f"token ids, got {choice.label!r}"
        )
    return spec


def load_weights(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy `weights` (by parameter name, as `named_parameters()` gives them: tied weights once) into
    `module`; ValueError naming the first parameter that is missing or has another shape."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            given = weights.get(name)
            if given is None or tuple(given.shape) != tuple(param.shape):
                raise ValueError(f"the weights do not fit this model: {name!r} is missing or misshaped")
            param.copy_(given)
