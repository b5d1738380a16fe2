"""The committed gRPC/protobuf stubs under swarmnode/proto are exactly what protos/generate.py makes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUB_ROOT = REPO / "swarmnode" / "proto"


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "swarmnode_protos_generate", REPO / "protos" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_committed_stubs_match_regenerated(tmp_path: Path) -> None:
    written = _load_generator().generate(tmp_path)
    fresh = {p.relative_to(tmp_path / "swarmnode" / "proto"): p.read_bytes() for p in written}
    committed = {
        p.relative_to(STUB_ROOT): p.read_bytes()
        for p in STUB_ROOT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    hint = "stale stubs: run `python protos/generate.py` and commit swarmnode/proto/"
    assert sorted(fresh) == sorted(committed), hint
    for rel, text in fresh.items():
        assert committed[rel] == text, f"{rel}: {hint}"


def test_stubs_import_as_a_subpackage() -> None:
    from swarmnode.proto.v1 import snapshot_pb2, snapshot_pb2_grpc

    assert snapshot_pb2.DESCRIPTOR.package == "swarmnode.v1"
    assert snapshot_pb2.FetchSnapshotChunk.__module__ == "swarmnode.proto.v1.snapshot_pb2"
    assert hasattr(snapshot_pb2_grpc, "SnapshotServiceStub")
