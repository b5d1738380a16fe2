"""Mixed precision of the inner step: autocast around the forward pass and the loss, fp32 everywhere else.

The model's own parameters keep their dtype (fp32 for the presets: the master weights), and so do
AdamW's moments; θ_g, its momentum and Δ are fp32 whatever the precision (`diloco.py`). bf16 needs no
loss scaling; fp16 does (its range is narrow): a `torch.amp.GradScaler` scales the loss, unscales the
gradients before the clip, skips a step whose gradients overflowed and moves its scale. The scaler's
state — its scale and how many good steps it has counted towards the next growth — is part of the
training state (`state_metadata`, in every snapshot), so a restarted node scales exactly as it would
have. A snapshot without it (fp32, bf16, or written before fp16 existed) leaves a fresh scaler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

import torch

from swarmnode.snapshot.metadata import parse_grad_scaler
from swarmnode.util.errors import ConfigError


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16}.get(self, torch.float16)


def resolve_precision(choice: str, device: torch.device) -> Precision:
    """The precision `--precision CHOICE` means on `device`; ConfigError (one line naming the flag) for
    fp16 on the CPU (CPU autocast is made for bf16, and fp16 there is slower than fp32) or bf16 on a GPU
    without bf16 kernels."""
    if choice == "auto":
        return Precision.BF16 if device.type == "cuda" and _cuda_bf16(device) else Precision.FP32
    precision = Precision(choice)
    if precision is Precision.FP16 and device.type != "cuda":
        raise ConfigError(f"--precision: fp16 needs a CUDA device (use bf16 or fp32 on {device}), got 'fp16'")
    if precision is Precision.BF16 and device.type == "cuda" and not _cuda_bf16(device):
        raise ConfigError(f"--precision: {device} has no bf16 support (use fp16 or fp32), got 'bf16'")
    return precision


def _cuda_bf16(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return bool(torch.cuda.is_bf16_supported())


class MixedPrecision:
    """The inner step's precision on one device: `autocast()` around forward and loss, `backward_step`
    for the rest; fp32 is plain training, bit for bit."""

    def __init__(self, precision: Precision, device: torch.device) -> None:
        self.precision, self.device = precision, device
        self.scaler = torch.amp.GradScaler(device.type) if precision is Precision.FP16 else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision is Precision.FP32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.dtype)

    def backward_step(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        clip: float,
    ) -> None:
        """backward, gradient-norm clip at `clip`, optimizer step (with fp16: scaled, unscaled before
        the clip, skipped when a gradient overflowed)."""
        self.backward(loss)
        self.step(optimizer, params, clip)

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass (with fp16: of the scaled loss)."""
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], clip: float) -> None:
        """After `backward` (and a node's gradient all-reduce): the clip at `clip` and the optimizer
        step (with fp16: unscaled before the clip, skipped when a gradient overflowed)."""
        if self.scaler is None:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
            optimizer.step()
            return
        self.scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_metadata(self) -> dict[str, Any]:
        """The grad scaler's state for a snapshot's metadata ({} without one)."""
        if self.scaler is None:
            return {}
        state = self.scaler.state_dict()
        scale, tracker = float(state["scale"]), int(state["_growth_tracker"])
        return {"grad_scaler": {"scale": scale, "growth_tracker": tracker}}

    def load_state(self, metadata: Mapping[str, Any]) -> None:
        """Restore the grad scaler from `state_metadata()`'s output (absent: the scaler stays as it is)."""
        saved = metadata.get("grad_scaler")
        if self.scaler is None or saved is None:
            return
        scale, tracker = parse_grad_scaler(saved)
        state = self.scaler.state_dict()
        self.scaler.load_state_dict({**state, "scale": scale, "_growth_tracker": tracker})
