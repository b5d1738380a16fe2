"""Hugging Face causal LMs as a model spec (`--model hf:PATH`): a local `transformers` config, or a
directory with one and, optionally, weights to start from (`model.safetensors`, sharded or not).

Never a download: everything is read from PATH (`local_files_only`). The run digest holds the config's
canonical JSON and, when the run starts from weights, their sha256, so nodes with different
architectures or starting points never average. Training runs in fp32 whatever dtype the config names
(fp32 master weights; the accelerator work casts inside the step). `transformers` is the `hf` extra:
it is imported only when such a model is asked for, and its absence is one line naming the extra.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from swarmnode.core.model import next_token_loss
from swarmnode.util.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_VOLATILE_KEYS = ("transformers_version", "_name_or_path")
"""Config keys that say where or with what it was saved, not what it computes."""


def transformers_module() -> ModuleType:
    """`transformers`, or ConfigError naming the extra that brings it."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise ConfigError("--model: hf: models need transformers: pip install 'swarmnode[hf]'") from None
    transformers.utils.logging.disable_progress_bar()  # (the node logs; a bar on stderr is noise)
    return transformers


@dataclass(frozen=True)
class HfSpec:
    path: Path
    """The directory (or config.json) given as hf:PATH."""
    config_json: dict[str, Any]
    """The config as its file has it, less the volatile keys: what the digest holds."""
    weights_sha256: str | None
    """The starting weights' hash; None: built from the config with the run's seed."""
    config: Any = field(compare=False)
    """The `transformers.PretrainedConfig`."""

    @classmethod
    def load(cls, argument: str) -> HfSpec:
        path = Path(argument)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ConfigError(f"--model: no transformers config at {str(config_file)!r}, got 'hf:{argument}'")
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"--model: cannot read {str(config_file)!r} ({exc}), got 'hf:{argument}'"
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--model: {str(config_file)!r} is not a JSON object, got 'hf:{argument}'")
        config = _config(transformers_module(), raw, argument)
        weights = _weights_sha256(path) if path.is_dir() else None
        canonical = {k: v for k, v in raw.items() if k not in _VOLATILE_KEYS}
        return cls(path, canonical, weights, config)

    @property
    def label(self) -> str:
        return f"hf:{self.path}"

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def context(self) -> int | None:
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(getattr(self.config, key, None), int):
                return int(getattr(self.config, key))
        return None

    def build(self, seed: int, device: torch.device) -> nn.Module:
        """From the weights when PATH has them, else `from_config` with the torch RNG seeded by `seed`
        (the process's own RNG state is put back afterwards)."""
        auto = transformers_module().AutoModelForCausalLM
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            if self.weights_sha256 is not None:
                module = auto.from_pretrained(self.path, local_files_only=True, dtype=torch.float32)
            else:
                module = auto.from_config(self.config, dtype=torch.float32)
        finally:
            torch.random.set_rng_state(generator_state)
        module.config.use_cache = False
        return module.to(device)  # type: ignore[no-any-return]

    def logits(self, module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return module(input_ids=inputs, use_cache=False).logits  # type: ignore[no-any-return]

    def loss(self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.logits(module, inputs), targets)

    def describe(self) -> dict[str, Any]:
        return {"model": "hf", "model_cfg": {"config": self.config_json, "weights": self.weights_sha256}}

    def export_hf(self, module: nn.Module, out: Path) -> None:
        """`save_pretrained` (config, safetensors, generation config) and the tokenizer files PATH has."""
        module.config.use_cache = True  # type: ignore[union-attr]
        module.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
        source = self.path if self.path.is_dir() else self.path.parent
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)


def _config(transformers: ModuleType, raw: dict[str, Any], argument: str) -> Any:
    """The PretrainedConfig of `raw`; ConfigError unless it is a causal LM transformers knows."""
    model_type = raw.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(
            model_type, **{k: v for k, v in raw.items() if k != "model_type"}
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--model: not a model type transformers knows ({model_type!r}: {exc}), got 'hf:{argument}'"
        ) from None
    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in causal:
        raise ConfigError(f"--model: {config.model_type!r} is not a causal LM, got 'hf:{argument}'")
    return config


def _weights_sha256(directory: Path) -> str | None:
    """sha256 over the names and sha256s of the directory's safetensors files (None: it has none)."""
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        return None
    files = sorted(
        p for p in directory.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json"))
    )
    overall = hashlib.sha256()
    for path in files:
        overall.update(path.name.encode() + b"\0" + _file_sha256(path).encode() + b"\n")
    return overall.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
