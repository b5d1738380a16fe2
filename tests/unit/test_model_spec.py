"""The model seam (core/model_spec.py): the presets keep their run digests, --model values parse,
and every spec builds the same module for the same seed."""

from __future__ import annotations

import pytest
import torch

from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.model_choice import ModelKind, parse_model_choice
from swarmnode.core.model_spec import load_model_spec
from swarmnode.core.training import run_digest
from swarmnode.util.errors import ConfigError

# Computed with the code before the seam existed (run_digest(name, preset(name, vocab), ...)): a
# preset's run keeps its digest, so nodes of either version still average together.
PINNED = {
    "tiny": "12771e178228b8cc09b42076dc3b04787c35b68c22287b8c1988aae7a936553b",
    "small": "24c813459b59eae51a556103274d80f732d46ed1a58dadf6be83c69212364f0d",
    "base": "6274b1514949707746b48fe44cadfc9b27a4ea1496d47bf8750444c68c81dbab",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_presets_keep_their_run_digests(name: str) -> None:
    spec = load_model_spec(name, 256)
    assert run_digest(spec, 64, 16, 0, DilocoConfig(), "c" * 64) == PINNED[name]


def test_a_preset_with_fragments_and_no_mix_keeps_its_digest() -> None:
    spec = GptSpec.preset("tiny", 50257)
    digest = run_digest(spec, 128, 4, 7, DilocoConfig(fragments=3, outer_mix=0.0), "d" * 64)
    assert digest == "5ccbc01d5a96e354a8fd3a191ebd06373c965b9743162ba4ffb8935fea5b8a7d"


@pytest.mark.parametrize(
    ("text", "kind", "argument"),
    [
        ("tiny", ModelKind.GPT, "tiny"),
        ("hf:/m/llama", ModelKind.HF, "/m/llama"),
        ("py:a.b:make", ModelKind.PY, "a.b:make"),
    ],
)
def test_model_values_parse(text: str, kind: ModelKind, argument: str) -> None:
    choice = parse_model_choice(text)
    assert (choice.kind, choice.argument, choice.label) == (kind, argument, text)


@pytest.mark.parametrize("text", ["huge", "hf:", "py:nomodule", "py:a.b:", "gpt:tiny", ""])
def test_bad_model_values_are_one_line(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_model_choice(text)
    assert "\n" not in str(caught.value)


def test_the_flag_names_itself_when_a_model_cannot_be_had(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^--model: no transformers config"):
        load_model_spec(f"hf:{tmp_path}", 256)
    with pytest.raises(ConfigError, match=r"^--model: cannot import 'no_such_module_here'"):
        load_model_spec("py:no_such_module_here:make", 256)


def test_a_preset_builds_the_same_weights_for_the_same_seed() -> None:
    spec = GptSpec.preset("tiny", 256)
    a, b = spec.build(3, torch.device("cpu")), spec.build(3, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    batch = torch.randint(0, 256, (2, 16))
    assert torch.equal(spec.loss(a, batch, batch), spec.loss(b, batch, batch))
