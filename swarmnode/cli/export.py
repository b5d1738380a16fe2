"""`swarmnode export` and `swarmnode sample`: the trained weights as something people use.

`export --format safetensors` writes the weights as one plain file (names as the model has them);
`--format hf` writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads (the
model spec's own `export_hf`: a preset as GPT-2, an hf: model as itself). Either is written under a
temporary name beside `--out` and renamed, so a failure leaves neither a half export nor a `.part`.
`sample` prints text the weights generate from a prompt. The model is the snapshot's own `model`
(its --model value) unless `--model` names it (an hf: path that moved).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

import torch
from torch import nn

from swarmnode.core.model_choice import ModelKind, parse_model_choice
from swarmnode.core.model_spec import ModelSpec, load_model_spec, load_weights
from swarmnode.snapshot.format import SnapshotError, parse_snapshot_name
from swarmnode.snapshot.read import read_snapshot
from swarmnode.snapshot.tensors import LoadedSnapshot
from swarmnode.snapshot.write import write_safetensors
from swarmnode.util.errors import ConfigError


class ExportFormat(StrEnum):
    SAFETENSORS = "safetensors"
    HF = "hf"


def export_command(path: Path, out: Path, fmt: ExportFormat, local: bool, model: str | None) -> int:
    """Write the global (default) or local weights of a snapshot; exit 2 for a bad --out or --model,
    1 for a bad snapshot."""
    check_out(out, fmt)
    loaded = read_or_report(path, "export")
    if loaded is None:
        return 1
    weights = snapshot_weights(loaded, local)
    if not weights:
        print(f"swarmnode export: {path}: no weights in this snapshot", file=sys.stderr)
        return 1
    if fmt is ExportFormat.SAFETENSORS:
        write_safetensors(out, weights, _info(loaded, local))
        total = sum(t.numel() for t in weights.values())
        print(f"wrote {out}: {len(weights)} tensors, {total:,} parameters ({_dtype_names(weights)})")
        return 0
    spec = snapshot_spec(loaded, weights, model)
    module = loaded_module(spec, weights)
    write_directory(out, lambda part: spec.export_hf(module, part))
    print(
        f"wrote {out}: {spec.label} at outer step {loaded.metadata.get('outer_step')} "
        "(AutoModelForCausalLM.from_pretrained loads it)"
    )
    return 0


def check_out(out: Path, fmt: ExportFormat) -> None:
    """ConfigError (exit 2) unless `out` can be written: its parent is a directory, and it is not a
    directory (safetensors) or not a non-empty one (hf)."""
    if not out.absolute().parent.is_dir():
        raise ConfigError(
            f"--out: the directory {str(out.absolute().parent)!r} does not exist, got {str(out)!r}"
        )
    if fmt is ExportFormat.SAFETENSORS and out.is_dir():
        raise ConfigError(f"--out: is a directory (give a file name), got {str(out)!r}")
    if fmt is ExportFormat.HF and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: exists and is not an empty directory, got {str(out)!r}")


def write_directory(out: Path, write: Callable[[Path], None]) -> None:
    """Run `write(part)` into a fresh temporary directory beside `out`, then rename it to `out`."""
    part = out.absolute().with_name(f".{out.name}.part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir()
    try:
        write(part)
        if out.is_dir():
            out.rmdir()  # (checked empty)
        os.replace(part, out)
    finally:
        shutil.rmtree(part, ignore_errors=True)


def read_or_report(path: Path, command: str) -> LoadedSnapshot | None:
    parsed = parse_snapshot_name(path.name)
    try:
        return read_snapshot(path, expected_id=parsed[3] if parsed else None)
    except SnapshotError as exc:
        print(f"swarmnode {command}: {path}: {exc}", file=sys.stderr)
        return None


def snapshot_weights(loaded: LoadedSnapshot, local: bool) -> dict[str, torch.Tensor]:
    """The global (or local) weights by parameter name."""
    prefix = "model/" if local else "global/"
    return {n[len(prefix) :]: t.contiguous() for n, t in loaded.tensors.items() if n.startswith(prefix)}


def snapshot_spec(loaded: LoadedSnapshot, weights: dict[str, torch.Tensor], model: str | None) -> ModelSpec:
    """The spec of the snapshot's model (`model`: a --model value instead of the snapshot's own)."""
    choice = parse_model_choice(model or str(loaded.metadata.get("model")))
    embedding = weights.get("tok.weight")  # a preset's vocabulary is its data's
    vocab = int(embedding.shape[0]) if embedding is not None else 0
    return load_model_spec(choice, vocab or (256 if choice.kind is ModelKind.PY else 0))


def loaded_module(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> nn.Module:
    module = spec.build(0, torch.device("cpu"))
    try:
        load_weights(module, weights)
    except ValueError as exc:
        raise ConfigError(f"--model: {exc}, got {spec.label!r}") from None
    return module.eval()


def _info(loaded: LoadedSnapshot, local: bool) -> dict[str, str]:
    meta = loaded.metadata
    return {
        "source_snapshot": loaded.snapshot_id,
        "run_id": str(meta.get("run_id")),
        "model": str(meta.get("model")),
        "outer_step": str(meta.get("outer_step")),
        "weights": "local" if local else "global",
        "format": "pt",
    }


def _dtype_names(weights: dict[str, torch.Tensor]) -> str:
    return ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()}))
