"""Regenerate the committed Python stubs under `swarmnode/proto/` from `protos/`.

Usage: `python protos/generate.py` (needs grpcio-tools, pinned in constraints.txt).

protoc names a generated module after the path it knows the .proto file by, so the files in
`protos/swarmnode/v1/` are mapped onto the virtual directory `swarmnode/proto/v1/`
(`-I swarmnode/proto/v1=protos/swarmnode/v1`). The stubs then live in the `swarmnode.proto.v1`
package and import each other as `swarmnode.proto.v1.x_pb2`, with no post-processing and no
sys.path tricks. The protobuf package (`swarmnode.v1`) and so the wire names are unaffected.
A .proto file that imports a sibling must name it by that virtual path:
`import "swarmnode/proto/v1/other.proto";`.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "protos" / "swarmnode" / "v1"
VIRTUAL_DIR = "swarmnode/proto/v1"
INIT_FILES = {
    "swarmnode/proto/__init__.py": '"""Generated protobuf and gRPC stubs (see protos/generate.py)."""\n',
    "swarmnode/proto/v1/__init__.py": '"""Stubs for the `swarmnode.v1` protobuf package."""\n',
}


def proto_files() -> list[Path]:
    """Every .proto file of the `swarmnode.v1` package, sorted."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write the stubs (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) and package `__init__.py` files
    under `out_root` (the repository root for the committed copy); return the files written."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_DIR}={PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p) for p in proto_files()),
    ]
    (out_root / VIRTUAL_DIR).mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for rel, text in INIT_FILES.items():
        (out_root / rel).write_text(text)
    return sorted(p for p in (out_root / VIRTUAL_DIR).parent.rglob("*") if p.is_file())


def main() -> int:
    for path in generate(REPO):
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
