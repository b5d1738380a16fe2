"""What `--device` and `--precision` may say, checked without torch (the flag table reads them, and
`status`/`fetch` must start without importing torch). Whether the device exists is
`model.select_device`'s start-up check; what a precision means on it, `precision.resolve_precision`'s."""

from __future__ import annotations

import re

DEVICE_NAMES = ("auto", "cpu", "cuda")
_CUDA_INDEX = re.compile(r"cuda:(0|[1-9][0-9]{0,2})")

PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")
"""`--precision` values: auto is bf16 on a CUDA device that supports it, else fp32."""


def check_device_choice(text: str) -> str:
    """auto, cpu, cuda (the current GPU) or cuda:N (GPU N); ValueError otherwise."""
    if text not in DEVICE_NAMES and not _CUDA_INDEX.fullmatch(text):
        raise ValueError("must be one of auto|cpu|cuda|cuda:N")
    return text
