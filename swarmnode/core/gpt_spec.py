"""The built-in GPT presets as a model spec (`model_spec.ModelSpec`), and their export as GPT-2.

The GPT's layout is GPT-2's (fused qkv, learned positions, pre-norm, tied head) but for the exact GELU
and `nn.Linear`'s [out, in] weights, where GPT-2's `Conv1D` keeps [in, out]: the export transposes
those and names the activation `gelu`, so `GPT2LMHeadModel` computes the same function.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from swarmnode.core.model import build_model
from swarmnode.core.presets import ModelConfig, preset

_GPT2_LINEARS = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "fc": "mlp.c_fc", "out": "mlp.c_proj"}
_GPT2_NORMS = {"ln1": "ln_1", "ln2": "ln_2"}


@dataclass(frozen=True)
class GptSpec:
    label: str
    """The preset's name."""
    cfg: ModelConfig

    @classmethod
    def preset(cls, name: str, vocab_size: int) -> GptSpec:
        return cls(name, preset(name, vocab_size))

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def context(self) -> int:
        return self.cfg.context

    def build(self, seed: int, device: torch.device) -> nn.Module:
        return build_model(self.cfg, seed, device)

    def logits(self, module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return module(inputs)  # type: ignore[no-any-return]

    def loss(self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return module.loss(inputs, targets)  # type: ignore[operator,no-any-return]

    def describe(self) -> dict[str, Any]:
        return {"model": self.label, "model_cfg": asdict(self.cfg)}

    def export_hf(self, module: nn.Module, out: Path) -> None:
        weights = gpt2_weights(module.state_dict())
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(gpt2_config(self.cfg), indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps({"do_sample": True}, indent=2) + "\n")


def gpt2_config(cfg: ModelConfig) -> dict[str, Any]:
    """The `transformers` GPT-2 config that computes what the preset computes."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": 4 * cfg.n_embd,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def gpt2_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GPT's state dict renamed (and its linear weights transposed) as GPT-2's `transformer.*`."""
    out = {"transformer.wte.weight": state["tok.weight"], "transformer.wpe.weight": state["pos.weight"]}
    for name, tensor in state.items():
        if not name.startswith("blocks."):
            if name.startswith("ln_f."):
                out[f"transformer.{name}"] = tensor
            continue
        _, index, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        if module in _GPT2_LINEARS:
            target = _GPT2_LINEARS[module]
            tensor = tensor.t() if kind == "weight" else tensor
        else:
            target = _GPT2_NORMS[module]
        out[f"transformer.h.{index}.{target}.{kind}"] = tensor
    return {name: tensor.detach().contiguous().cpu() for name, tensor in out.items()}
