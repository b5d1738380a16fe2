"""`--shard-model`'s units: what FSDP2 shards one at a time (the sharded node itself: test_nproc.py)."""

from __future__ import annotations

import torch
from torch import nn

from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.sharding import _units


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # (a list inside a unit)
        self.out = nn.Linear(2, 2)


def test_units_are_the_outermost_modules_held_in_lists_that_have_parameters() -> None:
    blocks = [Block(), Block()]
    model = nn.Sequential(nn.Embedding(3, 2), nn.ModuleList([*blocks, nn.ReLU()]))
    assert _units(model) == blocks  # not the heads inside a block (sharded before it), nor the ReLU


def test_a_presets_units_are_its_transformer_blocks() -> None:
    model = GptSpec.preset("tiny", 256).build(0, torch.device("cpu"))
    units = _units(model)
    assert len(units) >= 2 and all(type(u) is type(units[0]) for u in units)
    assert sum(p.numel() for u in units for p in u.parameters()) < sum(p.numel() for p in model.parameters())
