"""No network path unpickles: a static scan of the package, and a crafted payload served by a peer."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import re
import time
from pathlib import Path

import pytest
import zstandard

import swarmnode
from swarmnode.net import snapshot_client, snapshot_server
from swarmnode.snapshot.format import SnapshotError, SnapshotInfo
from swarmnode.snapshot.read import read_snapshot

PACKAGE = Path(swarmnode.__file__).parent
FORBIDDEN = [
    (
        re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|marshal|shelve|joblib)\b", re.M),
        "a pickle module",
    ),
    (re.compile(r"\bpickle\.loads?\b|\bUnpickler\b"), "unpickling"),
    (re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle=True"),
    (re.compile(r"\b(Server|server|dht)\.(load_state|save_state\w*)\("), "kademlia's pickled state"),
    (re.compile(r"(?<![\w.])(eval|exec)\("), "eval/exec"),
]


def package_sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "proto" not in p.relative_to(PACKAGE).parts]


@pytest.mark.parametrize("pattern,what", FORBIDDEN, ids=[w for _, w in FORBIDDEN])
def test_package_never_unpickles(pattern: re.Pattern[str], what: str) -> None:
    offenders = []
    for path in package_sources():
        text = path.read_text()
        offenders += [f"{path.name}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not offenders, f"{what} in the package: {offenders}"


class Evil:
    def __reduce__(self):
        return (Path("/tmp/swarmnode-pwned-net").touch, ())


def test_a_peer_serving_a_pickle_gets_it_refused_and_never_executed(tmp_path: Path) -> None:
    marker = Path("/tmp/swarmnode-pwned-net")
    marker.unlink(missing_ok=True)
    payload = zstandard.ZstdCompressor().compress(pickle.dumps({"model": Evil()}))
    snapshot_id = hashlib.sha256(payload).hexdigest()
    served = tmp_path / "served" / f"hot-o00000009-i0000000099-{snapshot_id}.snap.zst"
    served.parent.mkdir()
    served.write_bytes(payload)
    info = SnapshotInfo(snapshot_id, served, len(payload), 9, 99, "hot", time.time(), "planes", "r", "evil")

    class Catalog:
        def list_snapshots(self):
            return [info]

        def find(self, wanted):
            return info

    async def fetch_from_the_evil_peer() -> Path:
        server = await snapshot_server.start_server("127.0.0.1", 0, Catalog(), lambda: None)
        try:
            out = tmp_path / "fetched.snap.zst"
            await snapshot_client.fetch_snapshot(f"127.0.0.1:{server.port}", out, snapshot_id=snapshot_id)
            return out
        finally:
            await server.stop(0)

    fetched = asyncio.run(fetch_from_the_evil_peer())  # the bytes match their id: the transfer is fine
    with pytest.raises(SnapshotError):
        read_snapshot(fetched, expected_id=snapshot_id)
    assert not marker.exists(), "reading a peer's snapshot executed pickled code"
