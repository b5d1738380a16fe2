"""Model FLOPs utilisation: the training FLOPs a run's tokens/s stand for, against what this device's
matrix multiply reaches in the same precision, measured here in the same run (never a datasheet
figure, which no volunteer's card meets under its own clocks and cooling).

A token costs 6·N FLOPs of training for N parameters that multiply (forward 2·N, backward 4·N;
Kaplan et al. 2020, PaLM appendix B), plus 12·L·T·d for causal attention over T positions; the
position embedding multiplies nothing. For a model that is not a GPT preset (hf:, py:) only 6·N is
counted, with N all of its parameters.
"""

from __future__ import annotations

import time

import torch

from swarmnode.core.model_choice import ModelKind, parse_model_choice
from swarmnode.core.precision import Precision
from swarmnode.core.presets import preset

MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}
"""Side of the square matrices timed for the peak (large enough to be compute-bound)."""


def training_flops_per_token(model_name: str, parameters: int, seq_len: int) -> float:
    """FLOPs of one trained token (forward and backward) of the --model at `seq_len`."""
    choice = parse_model_choice(model_name)
    if choice.kind is not ModelKind.GPT:
        return 6.0 * parameters
    shape = preset(choice.argument, 256)
    multiplying = parameters - shape.context * shape.n_embd  # less the position embedding
    return 6.0 * multiplying + 12.0 * shape.n_layer * seq_len * shape.n_embd


def matmul_flops_per_s(device: torch.device, precision: Precision, seconds: float = 1.0) -> float:
    """The best rate of an n×n matmul in the precision's dtype on `device` (fp32 stays fp32: TF32 is
    whatever torch's settings make it, as for training)."""
    n = MATMUL_SIZE[device.type]
    a = torch.randn(n, n, device=device, dtype=precision.dtype)
    b = torch.randn(n, n, device=device, dtype=precision.dtype)
    best, deadline = 0.0, time.perf_counter() + seconds
    _sync(device, a @ b)  # warm-up (kernel choice, clocks)
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        _sync(device, a @ b)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - started))
    return best


def _sync(device: torch.device, result: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    del result
