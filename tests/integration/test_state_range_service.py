"""`StateRangeService` over real gRPC on 127.0.0.1: a snapshot served as verifiable ranges, and the
server's bounds (unknown step, root or index; ranges in flight per caller host)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from swarmnode.bench.runner import trained_run
from swarmnode.net import rpc, snapshot_server, state_ranges
from swarmnode.net.identity import Identity
from swarmnode.snapshot.format import SnapshotInfo
from swarmnode.snapshot.ranges import RAW, EncodedRange, decode_range, shared_layout
from swarmnode.snapshot.write import write_snapshot
from swarmnode.swarm.recovery.range_source import SnapshotRanges

LOCALHOST = "127.0.0.1"


def status() -> rpc.NodeStatus:
    return rpc.NodeStatus(node_id="ab" * 20, run_id="ranges")


class Catalog:
    def __init__(self, infos: list[SnapshotInfo]) -> None:
        self.infos = infos

    def list_snapshots(self) -> list[SnapshotInfo]:
        return self.infos

    def find(self, snapshot_id: str | None) -> SnapshotInfo | None:
        return None


async def serve(catalog: Catalog, servicer: state_ranges.StateRangeServicer) -> snapshot_server.RpcServer:
    return await snapshot_server.start_server(
        LOCALHOST, 0, catalog, status, extra_servicers=[servicer.register]
    )


def test_a_snapshot_is_served_as_ranges_that_verify_and_join_to_its_shared_state() -> None:
    run = trained_run("tiny", 2, 32, 2)
    template = run.template()
    with tempfile.TemporaryDirectory() as tmp:
        tensors = {k: v.detach().clone() for k, v in run.state_tensors().items()}
        info, _ = write_snapshot(Path(tmp), tensors, run.state_metadata(), kind="cold")
        expected = b"".join(tensors[name].numpy().tobytes() for name, _ in shared_layout(template).tensors)

        server_identity = Identity.generate()

        async def scenario() -> None:
            catalog = Catalog([info])
            provider = SnapshotRanges(lambda: catalog.infos, template)
            server = await serve(catalog, state_ranges.StateRangeServicer(provider, server_identity))
            address = f"{LOCALHOST}:{server.port}"
            try:
                manifest = await state_ranges.get_range_manifest(address, info.outer_step, 30)
                assert manifest.snapshot_id == info.snapshot_id and manifest.shared.total_bytes == len(
                    expected
                )
                assert manifest.signed_by(server_identity.node_id_hex)  # signed as it crossed gRPC
                assert not manifest.signed_by(Identity.generate().node_id_hex)
                pieces = []
                for i in range(len(manifest.shared)):
                    encoding, sent = await state_ranges.fetch_range(address, manifest.shared.root, i, 10)
                    start, stop = manifest.shared.span(i)
                    data = decode_range(encoding, sent, stop - start)
                    manifest.shared.check(i, data)
                    pieces.append(data)
                assert b"".join(pieces) == expected
                for bad in (
                    state_ranges.get_range_manifest(address, info.outer_step + 1, 10),
                    state_ranges.fetch_range(address, "0" * 64, 0, 10),
                    state_ranges.fetch_range(address, manifest.shared.root, len(manifest.shared), 10),
                ):
                    with pytest.raises(rpc.PeerUnavailable) as refused:
                        await bad
                    assert refused.value.reason == "refused"
            finally:
                await server.stop(0)

        asyncio.run(asyncio.wait_for(scenario(), 60))


class HeldProvider:
    """Holds every range request until released: ranges in flight pile up."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def manifest(self, outer_step: int) -> state_ranges.RangeManifest | None:
        return None

    async def range(self, root: str, index: int) -> EncodedRange | None:
        await self.release.wait()
        return RAW, b"x"


def test_one_host_gets_at_most_max_ranges_per_host_in_flight() -> None:
    async def scenario() -> None:
        provider = HeldProvider()
        server = await serve(Catalog([]), state_ranges.StateRangeServicer(provider, None))
        address = f"{LOCALHOST}:{server.port}"
        channels = rpc.ChannelCache()
        try:
            calls = [
                asyncio.create_task(state_ranges.fetch_range(address, "a" * 64, i, 10, channels))
                for i in range(state_ranges.MAX_RANGES_PER_HOST + 1)
            ]
            done, _ = await asyncio.wait(calls, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1
            refused = done.pop().exception()
            assert isinstance(refused, rpc.PeerUnavailable) and "too many ranges" in str(refused)
            provider.release.set()
            answers = await asyncio.gather(*(c for c in calls if not c.done()))
            assert answers == [(RAW, b"x")] * state_ranges.MAX_RANGES_PER_HOST
        finally:
            await channels.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))
