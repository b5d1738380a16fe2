"""DHT client mode (docs/design.md "Behind NAT"): a node that peers cannot reach queries and stores through
others but never enters their routing tables, and answers nobody."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_dht import FAST, KEY, eventually, run, start_member, swarm, values

pytestmark = pytest.mark.timeout(60)


def test_a_client_publishes_and_reads_but_is_in_no_routing_table() -> None:
    async def scenario() -> None:
        async with swarm(4, dataclasses.replace(FAST, ksize=3)) as members:
            bootstrap = [f"127.0.0.1:{members[0].dht.port}"]
            client = await start_member(bootstrap, dataclasses.replace(FAST, ksize=3, client_mode=True))
            try:
                assert client.dht.client_mode and client.protocol.sender_id is None
                assert await client.dht.publish(KEY, {"who": "client"}, ttl_s=60)
                assert await members[1].dht.publish(KEY, {"who": "peer"}, ttl_s=60)
                expected = {
                    client.identity.node_id_hex: {"who": "client"},
                    members[1].identity.node_id_hex: {"who": "peer"},
                }
                for reader in (members[3], client):
                    assert values(await reader.dht.get(KEY)) == expected
                await client.dht.get(KEY)  # more requests: still nobody verifies or admits it
                for member in members:  # a verification ping is started as a request is answered
                    await asyncio.wait_for(member.protocol.idle(), 10)
                assert client.dht.peer_count() >= 3  # it knows the swarm
                for member in members:
                    assert client.identity.node_id not in member.contacts()
                    assert client.address not in member.contacts().values()
            finally:
                await client.dht.stop()

    run(scenario())


def test_a_client_answers_no_requests_and_becomes_a_contact_once_it_leaves_client_mode() -> None:
    async def scenario() -> None:
        async with swarm(2) as members:
            bootstrap = [f"127.0.0.1:{members[0].dht.port}"]
            client = await start_member(bootstrap, dataclasses.replace(FAST, client_mode=True))
            try:
                ok, _ = await members[1].protocol.call_ping(client.contact)
                assert not ok  # a client serves no one
                assert client.identity.node_id not in members[0].contacts()
                client.dht.set_client_mode(False)
                await client.dht.get(KEY)  # a request naming its id: the receiver verifies it

                async def admitted() -> bool:
                    return client.identity.node_id in members[0].contacts()

                await eventually(admitted)
            finally:
                await client.dht.stop()

    run(scenario())
