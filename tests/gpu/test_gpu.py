"""swarmnode on a CUDA device (marker `gpu`; skipped without one): each check of `gpu_checks.py`, the
same functions `scripts/gpu-check` runs without pytest."""

from __future__ import annotations

from collections.abc import Callable

import gpu_checks
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("check", gpu_checks.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_on_the_gpu(check: Callable[[], gpu_checks.Figures]) -> None:
    check()
