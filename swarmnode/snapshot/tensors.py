"""The training state's tensors as a snapshot holds them: torch dtypes by safetensors name, the byte
view of a tensor, and what a read snapshot is. (`format.py` has the torch-free rest of the format.)"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swarmnode.snapshot.format import SnapshotHeader

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class LoadedSnapshot:
    snapshot_id: str
    header: SnapshotHeader
    tensors: dict[str, torch.Tensor]
    compressed_bytes: int = 0

    @property
    def metadata(self) -> dict[str, Any]:
        return self.header.metadata


TensorTemplate = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()
