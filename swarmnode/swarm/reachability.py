"""Whether peers can reach this node, and so which mode it runs in (docs/design.md "Behind NAT").

`--reachable yes|no` fixes the mode; `auto` (the default) decides it by the dial-back probe
(`net/dial_back.py`): the node asks up to `PROBERS` reachable peers to dial it back — those that say
so under `swarmnode/<run>/reachable` (every reachable node keeps one small entry there from its start,
`ProberRecord`: a swarm that starts together has no snapshot announcements yet), announce a serving
address or offer one in the current round. Any "reached you" makes it reachable; every
prober answering "could not" makes it a client; no answer at all leaves the mode as it is and asks again
`RETRY_S` later. Until the first answer a node that joins through --peers is a client (the safe side: a
client still trains and averages, a node wrongly taken as reachable makes its peers dial it in vain) and
a node that starts a swarm is reachable (its peers bootstrap from it). Once decided the probe runs again
every `REPROBE_S`, and a change of the address the probers see is logged: a new address (a laptop on
another network, a new lease) is probed again the same way.

The mode takes effect at once: the DHT switches client mode (`SwarmDHT.set_client_mode`), and the
next announcement and round offer carry it. A client (`Reachability.CLIENT`) is a member of rounds but
never a reducer or a leader, is never dialled, and serves its snapshots only to its own restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

import msgspec

from swarmnode.net import rpc
from swarmnode.net.dht import SwarmDHT
from swarmnode.net.dht_records import decode_typed_value
from swarmnode.net.dial_back import DIAL_TIMEOUT_S, DialBackAnswer, ask_dial_back
from swarmnode.swarm.announcements import Announcement, snapshots_key
from swarmnode.swarm.averaging.matchmaking import Offer, round_key
from swarmnode.util.labels import ProbeResult, Reachability
from swarmnode.util.validate import is_sha256_hex, parse_host_port

logger = logging.getLogger(__name__)

SETTINGS = ("auto", "yes", "no")
PROBERS = 2
"""Peers asked to dial this node back in one probe."""
RETRY_S = 5.0
"""How soon a probe that got no answer (or found no prober) is tried again."""
REPROBE_S = 300.0
"""How often a decided mode is probed again."""
PROBE_TIMEOUT_S = DIAL_TIMEOUT_S + 2.0
"""How long the caller waits for a prober's answer (its dial-back included)."""
PROBER_TTL_S = 900.0


def probers_key(run_id: str) -> str:
    """The run's key under which every reachable node keeps its gRPC address (one entry per node)."""
    return f"swarmnode/{run_id}/reachable"


class ProberRecord(msgspec.Struct, frozen=True):
    """A reachable node's entry under `probers_key`: where to ask for a dial-back (and its run digest)."""

    node_id: str = msgspec.field(name="node")
    address: str = msgspec.field(name="addr")
    run_digest: str = msgspec.field(name="run")

    def __post_init__(self) -> None:
        parse_host_port(self.address)
        if not is_sha256_hex(self.run_digest):
            raise ValueError("the run digest must be a sha256 hex digest")

    def to_value(self) -> dict[str, Any]:
        return {"addr": self.address, "run": self.run_digest}


def initial_mode(setting: str, has_peers: bool) -> Reachability:
    """The mode before any probe: the flag's, else client when joining and reachable when starting."""
    if setting not in SETTINGS:
        raise ValueError(f"--reachable must be one of {'|'.join(SETTINGS)}, got {setting!r}")
    if setting == "yes" or (setting == "auto" and not has_peers):
        return Reachability.REACHABLE
    return Reachability.CLIENT


class ReachabilityMonitor:
    """One node's mode: fixed by the flag, or probed (`probe`, then `run` in the background)."""

    def __init__(
        self,
        setting: str,
        mode: Reachability,
        node_id: str,
        grpc_port: int,
        address: str,
        dht: SwarmDHT,
        dht_run: str,
        run_digest: str,
        on_probe: Callable[[str], None] | None = None,
        on_mode: Callable[[Reachability], None] | None = None,
        channels: rpc.ChannelCache | None = None,
    ) -> None:
        """`on_probe(result)` counts probes ("reachable", "unreachable", "unanswered"); `on_mode(mode)` is
        told the mode now and at every change."""
        self.setting, self.mode, self.node_id, self.grpc_port = setting, mode, node_id, grpc_port
        self.address = address
        self._advertised: Reachability | None = None
        self.dht, self.dht_run, self.run_digest = dht, dht_run, run_digest
        self.on_probe, self.on_mode, self.channels = on_probe, on_mode, channels
        self.decided = setting != "auto"
        self.observed_host: str | None = None
        logger.info("reachability: %s to begin with (--reachable %s)", mode, setting)
        self._apply(mode)

    def reachable(self) -> bool:
        return self.mode == Reachability.REACHABLE

    async def run(self) -> None:
        """Probe when due, until cancelled (nothing to do when the flag fixed the mode)."""
        while self.setting == "auto":
            await asyncio.sleep(REPROBE_S if self.decided else RETRY_S)
            try:
                await self.probe()
            except Exception:  # a probe must never end the node
                logger.exception("reachability probe failed")

    async def probe(self) -> bool:
        """One probe (auto only): True when the mode is decided; then the mode is advertised (a
        reachable node's `ProberRecord` published, a client's withdrawn)."""
        decided = self.setting != "auto" or await self._probe_peers()
        await self._advertise()
        return decided

    async def _advertise(self) -> None:
        if self._advertised == self.mode:
            return
        key = probers_key(self.dht_run)
        if self.reachable():
            record = ProberRecord(self.node_id, self.address, self.run_digest)
            with contextlib.suppress(OSError, RuntimeError):  # not published: asked again at the next probe
                await self.dht.publish(key, record.to_value(), PROBER_TTL_S)
        else:
            self.dht.withdraw(key)
        self._advertised = self.mode

    async def _probe_peers(self) -> bool:
        probers = await self._probers()
        if not probers:
            logger.debug("reachability: no reachable peer to ask yet")
            return False
        answers = await asyncio.gather(*(self._ask(p) for p in probers))
        heard = [a for a in answers if a is not None]
        if not heard:
            return False
        self._note_host(heard)
        reachable = any(a.reachable for a in heard)
        if not reachable:
            logger.info("reachability: %s", "; ".join(a.reason for a in heard))
        self.decided = True
        self._apply(Reachability.REACHABLE if reachable else Reachability.CLIENT)
        return True

    async def _ask(self, prober: str) -> DialBackAnswer | None:
        answer = await ask_dial_back(prober, self.grpc_port, self.node_id, PROBE_TIMEOUT_S, self.channels)
        if self.on_probe is not None:
            result = ProbeResult.UNANSWERED if answer is None else ProbeResult.UNREACHABLE
            self.on_probe(ProbeResult.REACHABLE if answer is not None and answer.reachable else result)
        return answer

    async def _probers(self) -> list[str]:
        """Up to `PROBERS` addresses of reachable peers of this run, at random."""
        addresses: set[str] = set()
        for node_id, entry in (await self.dht.get(probers_key(self.dht_run))).items():
            record = decode_typed_value(ProberRecord, node_id, entry.value)
            if record is not None and self._other_of_run(node_id, record):
                addresses.add(record.address)
        for node_id, entry in (await self.dht.get(snapshots_key(self.dht_run))).items():
            announcement = Announcement.from_value(node_id, entry.value)
            if announcement is not None and announcement.serves and self._other_of_run(node_id, announcement):
                addresses.add(announcement.address)
        for node_id, entry in (await self.dht.get(round_key(self.dht_run))).items():
            offer = Offer.from_entry(node_id, entry)
            if offer is not None and offer.reachable and self._other_of_run(node_id, offer):
                addresses.add(offer.address)
        return random.sample(sorted(addresses), min(PROBERS, len(addresses)))

    def _other_of_run(self, node_id: str, value: Announcement | Offer | ProberRecord) -> bool:
        return node_id != self.node_id and value.run_digest == self.run_digest

    def _note_host(self, heard: list[DialBackAnswer]) -> None:
        host = heard[0].observed_host
        if self.observed_host is not None and host != self.observed_host:
            logger.warning("reachability: peers now see this node at %s (was %s)", host, self.observed_host)
        self.observed_host = host

    def _apply(self, mode: Reachability) -> None:
        if mode != self.mode:
            logger.warning("reachability: now %s (was %s)", mode, self.mode)
        self.mode = mode
        self.dht.set_client_mode(mode == Reachability.CLIENT)
        if self.on_mode is not None:
            self.on_mode(mode)
