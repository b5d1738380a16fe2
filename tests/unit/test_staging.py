"""Snapshot staging (snapshot/staging.py): host tensors copied into buffers reused snapshot after
snapshot; device tensors laid out once in one arena of aligned views (the GPU copies themselves are
checked by tests/gpu)."""

from __future__ import annotations

import torch

from swarmnode.snapshot.staging import DeviceArena, StagingBuffers, layout_of
from swarmnode.util.pinned import ALIGN_BYTES, aligned_offsets


def state() -> dict[str, torch.Tensor]:
    return {
        "model/w": torch.randn(3, 5),
        "model/b": torch.randn(7).to(torch.bfloat16),
        "inner/step": torch.tensor(3.0),
        "rng/torch": torch.random.get_rng_state(),
        "empty": torch.empty(0, dtype=torch.float16),
    }


def test_host_tensors_are_copied_into_reused_buffers() -> None:
    staging, tensors = StagingBuffers(), state()
    first = staging.stage(tensors)
    assert first.copied == ()  # nothing to wait for on the CPU
    first.wait()
    for name, t in tensors.items():
        assert torch.equal(first.tensors[name], t)
        assert t.numel() == 0 or first.tensors[name].data_ptr() != t.data_ptr()  # a copy
    tensors["model/w"].add_(1.0)
    second = staging.stage(tensors)
    assert second.tensors["model/w"].data_ptr() == first.tensors["model/w"].data_ptr()  # reused
    assert torch.equal(second.tensors["model/w"], tensors["model/w"])
    assert list(second.tensors) == list(tensors)  # the state's order, as the writer lays it out


def test_aligned_offsets_start_every_block_on_the_boundary() -> None:
    offsets, total = aligned_offsets([3, 64, 0, 130, 1])
    assert offsets == [0, 64, 128, 128, 320]
    assert total == 321
    assert all(o % ALIGN_BYTES == 0 for o in offsets)


def test_the_device_arena_holds_disjoint_aligned_views_of_each_tensor() -> None:
    tensors = state()
    arena = DeviceArena(layout_of(tensors))
    spans = []
    base = arena.buffer.tensor.data_ptr()
    for name, t in tensors.items():
        view = arena.views[name]
        assert (view.dtype, view.shape) == (t.dtype, t.shape), name
        start = view.data_ptr() - base
        assert start % ALIGN_BYTES == 0
        spans.append((start, start + t.numel() * t.element_size()))
        view.copy_(t)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no two views overlap
    assert spans[-1][1] <= arena.buffer.nbytes
    for name, t in tensors.items():
        assert torch.equal(arena.views[name], t), name  # each copy landed whole, untouched by the others
    arena.close()
