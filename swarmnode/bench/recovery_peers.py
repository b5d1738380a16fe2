"""`swarmnode bench recovery --peers K --mbit R`: a recovery from one peer against one from K peers at
once, same run, on a bandwidth-capped bed (`bench/netbed.py`; root only).

K source nodes, each in a network namespace of its own with its link capped at R Mbit/s each way
(`tc tbf`), train two rounds together (`--inner-steps 4`, so θ_g and the outer momentum are an averaged
state, not the initial one) and then hold: a fault pauses each one's training thread at inner step 9
while its event loop goes on serving, so the swarm keeps one agreed state at outer step 2 for as long
as the bench needs. A fresh node (new data dir, `--reachable no`, so it is never a source itself)
then joins with `--recovery-peers 1` (one whole snapshot from one peer), is killed once its restart
receipt is written, and another fresh node joins with `--recovery-peers K`. The figure is each
receipt's recovery seconds (look-up, fetch, verify, load) and their ratio.

The recovering node's own link is capped at K·R: on a bed where every link has the same R, K peers
cannot beat one (the receiver's downlink is the bottleneck). What K peers can cut is the part that
travels as shared ranges (θ_g and outer momentum); the inner moments come from one peer, which sets
a floor: against one peer's whole snapshot of all five state tensors, `small` from K peers costs about
max(moments, (shared + moments) / K) of its link time (both compressed as ranges are: 72 MB of
moments, 62 MB shared), after the time that peer takes to read its snapshot into ranges (its manifest
goes out, and its node ranges start, before the other sources are asked: many_peers.HEAD_START_S).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmnode.bench import netbed
from swarmnode.bench.netbed import NetBed
from swarmnode.bench.procs import ChildFailed, NodeProcess, json_lines, samples, stop_all, wait_until
from swarmnode.bench.runner import BenchResult, load_note
from swarmnode.swarm.recovery.restore import RECEIPTS_FILE
from swarmnode.util.errors import ConfigError

RUN_ID = "bench-recovery-peers"
INNER_STEPS = 4
HOLD = f"sleep@inner_step#{2 * INNER_STEPS + 1}=1800"
"""Pauses every source's training thread in round 2 (its event loop serves on) until the bench ends."""
TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Recovery:
    peers: int
    receipt: dict[str, Any]

    @property
    def seconds(self) -> float:
        return float(self.receipt["seconds"])


def bench_recovery_peers(preset_name: str, peers: int, mbit: float) -> BenchResult:
    if peers < 2:
        raise ConfigError(f"--peers: recovery from many peers needs at least 2, got {peers}")
    netbed.require_bed("bench recovery --peers", mbit)
    one, many = _measure(preset_name, peers, mbit)
    result = BenchResult("recovery", preset_name)
    result.add("sources × link cap", peers, "nodes", f"{mbit:g} Mbit/s each way per source (tc tbf)")
    result.add("recovering node's link cap", peers * mbit, "Mbit/s", "K·R: so K sources can fill it")
    for r in (one, many):
        receipt = r.receipt
        tag = f"from {r.peers} peer{'s' if r.peers > 1 else ''}:"
        wire = f"{receipt['bytes'] / 1e6:.1f} MB on the wire"
        result.add(f"{tag} recovery (restart receipt)", r.seconds, "s", wire)
        for stage, seconds in sorted(receipt["stages_s"].items()):
            result.add(f"  {tag} stage {stage}", seconds, "s")
        if receipt.get("ranges_per_peer"):
            shares = " ".join(f"{n}" for n in receipt["ranges_per_peer"].values())
            result.add(f"  {tag} ranges per peer", len(receipt["peers"]), "peers", shares)
    result.add("load", os.getloadavg()[0], "", load_note())
    result.ratio(
        f"recovery from {peers} peers / from one", many.seconds / one.seconds, "issue 12 target ≤ 0.45"
    )
    return result


def _source_args(preset_name: str, count: int, index: int, host: str) -> list[str]:
    return [
        *("--host", host, "--model", preset_name, "--threads", "1", "--seq-len", "64", "--batch-size", "4"),
        *("--inner-steps", str(INNER_STEPS), "--hot-every", str(INNER_STEPS), "--cold-every", "1"),
        *("--keep-hot", "2", "--num-shards", str(count), "--shard", str(index)),
        *("--matchmaking-timeout", "15", "--allreduce-timeout", "180", "--wait-peers", str(count - 1)),
        *("--run-id", RUN_ID, "--seed", "1"),
    ]


def _joiner_args(preset_name: str, count: int, host: str, peers: int, bootstrap: str) -> list[str]:
    return [
        *("--host", host, "--model", preset_name, "--threads", "1", "--seq-len", "64", "--batch-size", "4"),
        *("--inner-steps", str(INNER_STEPS), "--num-shards", str(count)),
        *("--run-id", RUN_ID, "--seed", "1", "--reachable", "no", "--peers", bootstrap),
        *("--recovery-peers", str(peers)),
    ]


def _measure(preset_name: str, count: int, mbit: float) -> tuple[Recovery, Recovery]:
    net = 100 + os.getpid() % 100
    subnet = f"10.{net}.70"
    with NetBed() as bed, tempfile.TemporaryDirectory(prefix="swarmnode-bench-recovery-") as tmp:
        wan = bed.bridge(f"{subnet}.0/24")
        sources: list[NodeProcess] = []
        try:
            for i in range(count):
                ns, host = bed.namespace(f"s{i}"), f"{subnet}.{10 + i}"
                bed.attach(ns, wan, host, rate_mbit=mbit)
                args = _source_args(preset_name, count, i, host)
                if sources:
                    args += ["--peers", f"{subnet}.10:{sources[0].info['dht_port']}"]
                sources.append(NodeProcess(Path(tmp) / f"s{i}", args, faults=HOLD, prefix=ns.prefix).start())
                sources[-1].wait_ready(300)
            wait_until(lambda: _held(sources), TIMEOUT_S, "the sources to hold at outer step 2", 1.0)
            bootstrap = f"{subnet}.10:{sources[0].info['dht_port']}"
            found = []
            for k, peers in enumerate((1, count)):
                ns, host = bed.namespace(f"r{k}"), f"{subnet}.{50 + k}"
                bed.attach(ns, wan, host, rate_mbit=count * mbit)
                args = _joiner_args(preset_name, count, host, peers, bootstrap)
                found.append(Recovery(peers, _recover(Path(tmp) / f"r{k}", args, ns.prefix)))
            return found[0], found[1]
        finally:
            stop_all(sources, 10)


def _held(sources: list[NodeProcess]) -> bool:
    """Every source paused in round 2, after its cold snapshot at outer step 2."""
    for p in sources:
        if not p.alive():
            raise p.fail("source exited during the bench")
    values = [samples(p.metrics(timeout_s=20)) for p in sources]
    return all(v.get("swarmnode_outer_step", 0) >= 2 for v in values) and all(
        v.get("swarmnode_inner_steps_total", 0) >= 2 * INNER_STEPS + 1 for v in values
    )


def _recover(data_dir: Path, args: list[str], prefix: list[str]) -> dict[str, Any]:
    with NodeProcess(data_dir, args, prefix=prefix) as joiner:
        receipts = data_dir / RECEIPTS_FILE

        def written() -> list[dict[str, Any]] | None:
            if not joiner.alive():
                raise joiner.fail("the recovering node exited")
            return json_lines(receipts) or None

        receipt = wait_until(written, TIMEOUT_S, "the recovering node's receipt", 0.2)[0]
        joiner.kill()
    if receipt["source"] != "peer":
        raise ChildFailed(f"the recovering node did not recover from a peer: {receipt}")
    return receipt
