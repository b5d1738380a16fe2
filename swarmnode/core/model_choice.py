"""What `--model` names, parsed without torch (the flag table reads it): a GPT preset (`tiny`, `small`,
`base`), a Hugging Face causal LM (`hf:PATH`, a local directory or its `config.json`) or the user's own
module (`py:package.module:factory`). Building the model is `model_spec.load_model_spec`'s job."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from swarmnode.core.presets import MODEL_PRESETS

_TARGET = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*")


class ModelKind(StrEnum):
    GPT = "gpt"
    HF = "hf"
    PY = "py"


@dataclass(frozen=True)
class ModelChoice:
    kind: ModelKind
    argument: str
    """The preset's name, the hf: path, or the py: `package.module:factory`."""

    @property
    def label(self) -> str:
        """The flag's value again: what snapshots record as their `model`."""
        return self.argument if self.kind is ModelKind.GPT else f"{self.kind}:{self.argument}"


def parse_model_choice(text: str) -> ModelChoice:
    """ValueError (one line, no flag name: the caller adds it) unless `text` is a valid --model value."""
    if text in MODEL_PRESETS:
        return ModelChoice(ModelKind.GPT, text)
    kind, _, argument = text.partition(":")
    if kind == ModelKind.HF and argument:
        return ModelChoice(ModelKind.HF, argument)
    if kind == ModelKind.PY and _TARGET.fullmatch(argument):
        return ModelChoice(ModelKind.PY, argument)
    if kind == ModelKind.PY:
        raise ValueError("py: needs package.module:factory")
    raise ValueError("must be one of " + "|".join(MODEL_PRESETS) + ", hf:PATH or py:package.module:factory")


def check_model_choice(text: str) -> str:
    """The flag table's validator: `text` itself when it parses."""
    parse_model_choice(text)
    return text
