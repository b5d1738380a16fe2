"""The kademlia/rpcudp adapter: every upstream member it overrides or relies on still exists with the
signature it was written against, and the packages are the versions it was written for. A version bump
fails here, by name, not silently in a swarm."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from importlib.metadata import version

import pytest
from kademlia.crawling import NodeSpiderCrawl
from kademlia.node import Node

from swarmnode.net import kademlia_adapter
from swarmnode.net.dht import DHTConfig, SwarmDHT
from swarmnode.net.identity import Identity


@pytest.mark.parametrize("package", sorted(kademlia_adapter.UPSTREAM_VERSIONS))
def test_the_packages_are_the_versions_the_adapter_was_written_for(package: str) -> None:
    assert version(package) == kademlia_adapter.UPSTREAM_VERSIONS[package]


@pytest.mark.parametrize(("where", "signature"), sorted(kademlia_adapter.UPSTREAM.items()))
def test_each_overridden_or_used_member_has_its_signature(where: tuple[str, str], signature: str) -> None:
    module, qualname = where
    member = importlib.import_module(module)
    for part in qualname.split("."):
        member = getattr(member, part)
    assert str(inspect.signature(member)) == signature, f"{module}.{qualname} changed"


def test_the_attributes_the_adapter_reads_exist_on_live_objects() -> None:
    async def scenario() -> None:
        dht = SwarmDHT(Identity.generate(), DHTConfig())
        await dht.start([])
        try:
            server = dht._running()
            protocol = server.protocol
            assert isinstance(protocol._outstanding, dict) and protocol._wait_timeout > 0
            assert protocol.source_node.id == server.node.id and protocol.storage is dht._storage
            bucket = protocol.router.buckets[protocol.router.get_bucket_for(server.node)]
            assert isinstance(bucket.nodes, dict) and server.transport is protocol.transport
            crawl = NodeSpiderCrawl(protocol, Node(b"\x01" * 20), [], 20, 3)
            assert crawl.last_ids_crawled == [] and len(crawl.nearest) == 0
        finally:
            await dht.stop()

    asyncio.run(scenario())
