"""The snapshot file format: bit-exact round trips, standard tools, and refusal of bad files."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load_file

from swarmnode.snapshot.format import SnapshotError, SnapshotMismatch, parse_snapshot_name
from swarmnode.snapshot.read import read_header, read_snapshot, verify_snapshot
from swarmnode.snapshot.write import write_snapshot

META = {"outer_step": 2, "inner_step": 17, "run_id": "r", "node_id": "n", "cursor": {"shard": 1}}


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/w": torch.randn(300, 257, generator=g) * 0.02,
        "model/b": torch.zeros(257),
        "inner/w/exp_avg_sq": torch.rand(300, 257, generator=g) ** 4 * 1e-6,
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(33, generator=g).to(torch.float16),
        "steps": torch.arange(12, dtype=torch.int64),
        "rng/torch": torch.random.get_rng_state(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "big": torch.randn(400_000, generator=g),  # gets frames of its own
    }


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("layout", ["planes", "plain"])
def test_round_trip_is_bit_exact(tmp_path: Path, layout: str) -> None:
    state = sample_state()
    info, raw_bytes = write_snapshot(tmp_path, state, META, kind="hot", layout=layout)
    loaded = read_snapshot(info.path, expected_id=info.snapshot_id)
    assert set(loaded.tensors) == set(state)
    for name, tensor in state.items():
        got = loaded.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(_bytes_of(got), _bytes_of(tensor)), name
    assert loaded.metadata["cursor"] == {"shard": 1}
    assert loaded.metadata["kind"] == "hot" and loaded.metadata["layout"] == layout
    assert raw_bytes > info.size_bytes
    assert parse_snapshot_name(info.path.name) == ("hot", 2, 17, info.snapshot_id)


def test_id_is_sha256sum_of_the_file(tmp_path: Path) -> None:
    info, _ = write_snapshot(tmp_path, sample_state(), META, kind="cold", fsync=True)
    out = subprocess.run(["sha256sum", str(info.path)], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == info.snapshot_id
    assert not list(tmp_path.glob(".tmp-*")), "temporary file left behind"


def test_plain_layout_decompresses_to_an_ordinary_safetensors_file(tmp_path: Path) -> None:
    state = sample_state()
    info, _ = write_snapshot(tmp_path, state, META, kind="hot", layout="plain")
    out = tmp_path / "plain.safetensors"
    subprocess.run(["zstd", "-d", "-q", str(info.path), "-o", str(out)], check=True)
    opened = load_file(str(out))
    for name, tensor in state.items():
        assert torch.equal(opened[name], tensor), name


def test_planes_layout_is_honest_uint8_to_a_plain_reader(tmp_path: Path) -> None:
    state = sample_state()
    info, _ = write_snapshot(tmp_path, state, META, kind="hot", layout="planes")
    out = tmp_path / "planes.safetensors"
    subprocess.run(["zstd", "-d", "-q", str(info.path), "-o", str(out)], check=True)
    opened = load_file(str(out))
    w = state["model/w"]
    assert opened["model/w"].dtype == torch.uint8 and tuple(opened["model/w"].shape) == (4, w.numel())
    planes = w.reshape(-1).view(torch.uint8).reshape(-1, 4).t()
    assert torch.equal(opened["model/w"], planes)


def test_planes_compress_better_than_plain_on_trained_like_floats(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(1 << 20, generator=g) * 0.02, "v": torch.rand(1 << 20, generator=g) ** 6 * 1e-5}
    planes, _ = write_snapshot(tmp_path, state, META, kind="hot", layout="planes")
    plain, _ = write_snapshot(tmp_path, state, META, kind="cold", layout="plain")
    assert planes.size_bytes < 0.95 * plain.size_bytes


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_bit_flip_is_rejected(tmp_path: Path) -> None:
    info, _ = write_snapshot(tmp_path, sample_state(), META, kind="hot")
    _flip_byte(info.path, info.size_bytes // 2)
    with pytest.raises(SnapshotError):
        read_snapshot(info.path, expected_id=info.snapshot_id)


def test_truncated_file_is_rejected(tmp_path: Path) -> None:
    info, _ = write_snapshot(tmp_path, sample_state(), META, kind="hot")
    with info.path.open("r+b") as f:
        f.truncate(info.size_bytes * 2 // 3)
    with pytest.raises(SnapshotError, match="truncated|corrupt"):
        read_snapshot(info.path, expected_id=info.snapshot_id)


def test_valid_file_with_other_id_is_rejected(tmp_path: Path) -> None:
    info, _ = write_snapshot(tmp_path, sample_state(), META, kind="hot")
    with pytest.raises(SnapshotError, match="sha256 mismatch"):
        verify_snapshot(info.path, expected_id="0" * 64)


def _raw_snapshot(path: Path, header: dict, data: bytes = b"", length: int | None = None) -> Path:
    body = json.dumps(header).encode()
    prefix = (len(body) if length is None else length).to_bytes(8, "little")
    path.write_bytes(zstandard.ZstdCompressor().compress(prefix + body + data))
    return path


def _meta(layout: str = "plain", planes: dict | None = None) -> dict:
    return {
        "format": "swarmnode-snapshot",
        "format_version": "1",
        "layout": layout,
        "planes": json.dumps(planes or {}),
        "swarmnode": json.dumps(META),
    }


class Evil:
    def __reduce__(self):
        return (Path("/tmp/swarmnode-pwned").touch, ())


def test_pickle_payload_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = Path("/tmp/swarmnode-pwned")
    marker.unlink(missing_ok=True)
    payload = pickle.dumps({"model": Evil()})
    (tmp_path / "evil.snap.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    for name in ("evil.snap.zst", "evil.pt"):
        with pytest.raises(SnapshotError):
            read_snapshot(tmp_path / name)
    assert not marker.exists(), "a snapshot read executed pickled code"


@pytest.mark.parametrize(
    "case",
    [
        "huge_header_length",
        "offsets_lie",
        "huge_declared",
        "wrong_dtype",
        "gap",
        "not_json",
        "planes_shape_lie",
        "no_metadata",
    ],
)
def test_malformed_headers_are_refused_without_allocating(tmp_path: Path, case: str) -> None:
    f4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    headers = {
        "offsets_lie": {"__metadata__": _meta(), "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}},
        "huge_declared": {
            "__metadata__": _meta(),
            "a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]},
        },
        "wrong_dtype": {"__metadata__": _meta(), "a": {"dtype": "O", "shape": [4], "data_offsets": [0, 16]}},
        "gap": {
            "__metadata__": _meta(),
            "a": f4,
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [32, 48]},
        },
        "planes_shape_lie": {
            "__metadata__": _meta("planes", {"a": {"dtype": "F32", "shape": [8]}}),
            "a": {"dtype": "U8", "shape": [4, 4], "data_offsets": [0, 16]},
        },
        "no_metadata": {"a": f4},
    }
    path = tmp_path / "bad.snap.zst"
    if case == "huge_header_length":
        _raw_snapshot(path, {"__metadata__": _meta()}, length=1 << 40)
    elif case == "not_json":
        path.write_bytes(zstandard.ZstdCompressor().compress((5).to_bytes(8, "little") + b"{oops"))
    else:
        _raw_snapshot(path, headers[case], b"\0" * 16)
    with pytest.raises(SnapshotError):
        read_snapshot(path, max_bytes=1 << 30)


def test_template_refuses_foreign_tensor_sets(tmp_path: Path) -> None:
    info, _ = write_snapshot(
        tmp_path, {"a": torch.zeros(4), "rng/torch": torch.zeros(3, dtype=torch.uint8)}, META, kind="hot"
    )
    with pytest.raises(SnapshotError, match="expects"):
        read_snapshot(info.path, template={"a": (torch.float32, (5,))})
    with pytest.raises(SnapshotError, match="lacks"):
        read_snapshot(info.path, template={"a": (torch.float32, (4,)), "b": (torch.float32, (1,))})
    template = {
        "a": (torch.float32, (4,)),
        "rng/torch": (torch.uint8, (3,)),
        "rng/cuda/0": (torch.uint8, (16,)),
    }
    loaded = read_snapshot(info.path, template=template)  # a CPU node's snapshot read by a GPU node
    assert set(loaded.tensors) == {"a", "rng/torch"}
    gpu, _ = write_snapshot(
        tmp_path,
        {
            "a": torch.zeros(4),
            "rng/torch": torch.zeros(3, dtype=torch.uint8),
            "rng/cuda/0": torch.zeros(16, dtype=torch.uint8),
        },
        META,
        kind="cold",
    )
    cpu_template = {"a": (torch.float32, (4,)), "rng/torch": (torch.uint8, (3,))}
    assert set(read_snapshot(gpu.path, template=cpu_template).tensors) == {"a", "rng/torch", "rng/cuda/0"}


def test_a_peer_cannot_smuggle_a_huge_extra_tensor_past_the_template(tmp_path: Path) -> None:
    big = {
        "a": torch.zeros(4),
        "rng/torch": torch.zeros(3, dtype=torch.uint8),
        "rng/evil": torch.zeros(1 << 20, dtype=torch.uint8),
        "rng/cuda/1": torch.zeros(1 << 20, dtype=torch.uint8),
    }
    template = {"a": (torch.float32, (4,)), "rng/torch": (torch.uint8, (3,))}
    for extra in ("rng/evil", "rng/cuda/1"):
        state = {k: v for k, v in big.items() if k in ("a", "rng/torch", extra)}
        info, _ = write_snapshot(tmp_path / extra.replace("/", "_"), state, META, kind="hot")
        with pytest.raises(SnapshotMismatch, match="lacks"):
            read_snapshot(info.path, template=template)


def test_header_alone_is_cheap_to_read(tmp_path: Path) -> None:
    info, _ = write_snapshot(tmp_path, sample_state(), META, kind="hot")
    header = read_header(info.path)
    assert header.metadata["inner_step"] == 17
    assert {e.name for e in header.entries} == set(sample_state())
    assert np.all(np.diff([e.begin for e in header.entries]) >= 0)


def test_a_small_file_claiming_gigabytes_is_refused_with_bounded_memory(tmp_path: Path) -> None:
    """Run in a child so its peak RSS measures only this read: VmHWM, the child's own memory map's peak
    (ru_maxrss carries pytest's own peak across the spawn's exec, over 1 GB late in a full run)."""
    path = tmp_path / "liar.snap.zst"
    declared = 8 << 30  # 8 GiB of float32 that the 1 KB file cannot hold
    header = {
        "__metadata__": _meta(),
        "a": {"dtype": "F32", "shape": [declared // 4], "data_offsets": [0, declared]},
    }
    _raw_snapshot(path, header, b"\0" * 1024)
    script = (
        "import re\n"
        "from pathlib import Path\n"
        "from swarmnode.snapshot.format import SnapshotError\n"
        "from swarmnode.snapshot.read import read_snapshot\n"
        "try:\n"
        f"    read_snapshot(Path({str(path)!r}))\n"
        "except SnapshotError as exc:\n"
        "    print('refused:', exc)\n"
        "status = Path('/proc/self/status').read_text()\n"
        "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1)) // 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    refusal, peak_mb = out.stdout.strip().splitlines()
    assert refusal.startswith("refused:") and "over the limit" in refusal
    assert int(peak_mb) < 1024, f"peak RSS {peak_mb} MB while refusing a file that claims 8 GiB"
