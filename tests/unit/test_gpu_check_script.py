"""`scripts/gpu-check` on a machine without CUDA: one line saying it skipped, exit 0 (it runs on the
GPU machines only, and must never fail a machine that has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu-check"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_gpu_check_skips_in_one_line_without_cuda() -> None:
    assert os.access(SCRIPT, os.X_OK)
    out = subprocess.run(
        [str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [out.stdout.strip()] and "skipped" in out.stdout
    assert out.stderr == ""
