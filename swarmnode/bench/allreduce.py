"""`swarmnode bench allreduce`: butterfly all-reduce of a pseudo-gradient of the preset's size among N
local processes, per wire dtype, against torch.distributed gloo's `all_reduce` of the same tensor in as
many processes, and against the butterfly's bandwidth bound, all in the same run.

Each member is a worker process with an `AveragingServicer` on a real gRPC server, its bulk lanes
(`net/bulk.py`, as a node on a plaintext swarm has; none in the `tls` trust mode) and cached channels
to its peers (one torch thread each: the members share the machine's cores). Each member averages
into one buffer it reuses round after round (`butterfly_allreduce(..., out=)`), as gloo's
`all_reduce` works in place. A round tells every member
the group (so calls that come early are held), then starts them together; its time is the slowest
member's `AllReduceResult.seconds`. The gloo ranks (`bench/worker.py`, role `gloo`) meet at a barrier
and time one `all_reduce` (a sum, then divided by N); its time is the slowest rank's. Round 0 warms
both engines up (connections, buffers) and is not counted; then the engines and dtypes take turns,
`rounds` times. The profile: each member's CPU seconds (all threads) and the time at which the slowest
member reached each phase (`AllReduceResult.phases`). The bound is what the butterfly must move
through each member's link: 2(N−1)/N · bytes, at the speed of a raw loopback TCP transfer of the same
bytes between two processes, sampled beside each round. The top-k wire (`--wire-dtype topk`, the
default density) sends each contribution to every member instead ((N − 1) images of Δ per member:
`allreduce.py`); its bytes per member are measured against fp32's in the same run.

`--trust` also measures what trust costs, in bf16, against the plain all-reduce (headers trusted, the
plain mean) in the same run: `robust` (the robust outer step of an honest round: the norm screen, the
coordinate-wise median, the cosines that find nobody opposed and the distances that find nobody far,
then the mean), `clipped` (the same when member 0 sends 7 × its Δ, far but not against the others, so
every part clips: CenteredClip's three iterations), `signed` (signed headers and chunks: token-only
swarms) and `tls` (mutual TLS, certificates naming the node ids), each robust.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from pathlib import Path
from typing import Any

import torch

from swarmnode.bench.fetch import raw_receive
from swarmnode.bench.pki import write_pki
from swarmnode.bench.procs import Worker, free_port
from swarmnode.bench.runner import BenchResult, median
from swarmnode.core.model import build_model, count_parameters
from swarmnode.core.presets import preset
from swarmnode.net.identity import Identity
from swarmnode.swarm.averaging.allreduce import GroupSpec
from swarmnode.swarm.averaging.codecs import encoded_size
from swarmnode.swarm.averaging.wire import WIRE_DTYPES, Member, is_sparse
from swarmnode.util.errors import ConfigError

WORKER_START_S = 120.0
ROUND_TIMEOUT_S = 300.0
TRUST_MODES = ("plain", "robust", "clipped", "signed", "tls")
CLIPPED_SCALE = 7.0
"""Member 0's Δ in the `clipped` mode: under the norm screen's 8, far beyond the others' (a flip would be
left out as `opposed`, which costs less than a clip)."""


def bench_trust(preset_name: str, nodes: int = 3, rounds: int = 3) -> BenchResult:
    """bf16 all-reduces of the preset's Δ among `nodes` processes per trust mode, each against plain."""
    result = BenchResult("allreduce-trust", preset_name)
    numel = _param_count(preset_name)
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp)
        ids = [Identity.load_or_create(keys / f"m{k}.key").node_id_hex for k in range(nodes)]
        for k, node_id in enumerate(ids):
            (keys / f"m{k}.key").rename(keys / f"{node_id}.key")
        write_pki(keys, ids)
        for mode in TRUST_MODES:
            with contextlib.ExitStack() as children:
                members, workers = _butterfly_members(keys, children, ids, mode, str(keys))
                seconds, coverage = [], 1.0
                for r in range(rounds):
                    spec = GroupSpec("bench", r, f"{mode}-{r}", members, "bf16", ROUND_TIMEOUT_S)
                    replies = _one_round(workers, spec, numel, CLIPPED_SCALE if mode == "clipped" else 1.0)
                    coverage = min([coverage, *(reply["coverage"] for reply in replies)])
                    seconds.append(max(reply["seconds"] for reply in replies))
            best[mode] = min(seconds)
            note = f"median {median(seconds) * 1e3:.0f} ms; coverage {coverage:.2f}"
            result.add(f"all-reduce bf16, {mode}", best[mode] * 1e3, "ms", note)
    for mode in TRUST_MODES[1:]:
        result.ratio(f"all-reduce bf16 {mode} / plain", best[mode] / best["plain"], "cost of trust")
    return result


GLOO_DTYPES = ("fp32", "bf16")


def bench_allreduce(preset_name: str, nodes: int = 4, rounds: int = 5, trust: bool = False) -> BenchResult:
    """`nodes`: group members (processes, for both engines); `rounds`: timed all-reduces per engine and
    dtype, interleaved, after one warm-up each that is not counted (with `trust`: per trust mode)."""
    if nodes < 2:
        raise ConfigError(f"--nodes: an all-reduce needs at least 2 members, got {nodes}")
    if trust:
        return bench_trust(preset_name, nodes, rounds)
    result = BenchResult("allreduce", preset_name)
    numel = _param_count(preset_name)
    result.add("pseudo-gradient", numel / 1e6, "M values", f"{nodes} member processes per engine")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as children:
        ids = [hashlib.sha256(f"bench-member-{k}".encode()).hexdigest()[:40] for k in range(nodes)]
        members, workers = _butterfly_members(Path(tmp), children, ids)
        glooers = _gloo_members(Path(tmp), children, nodes)
        sender = children.enter_context(Worker(Path(tmp), "serve"))
        tcp_port = sender.read(WORKER_START_S)["tcp"]
        samples: dict[str, list[dict[str, Any]]] = {}
        for r in range(rounds + 1):  # round 0 warms up every engine and dtype
            _sample_gloo(glooers, numel, r, samples)
            for wire_dtype in WIRE_DTYPES:
                raw = raw_receive(tcp_port, encoded_size(wire_dtype, numel), None)[0]
                spec = GroupSpec("bench", r, f"{wire_dtype}-{r}", members, wire_dtype, ROUND_TIMEOUT_S)
                replies = _one_round(workers, spec, numel)
                if r > 0:
                    samples.setdefault(wire_dtype, []).append({"raw": raw, "replies": replies})
    _report_gloo(result, samples)
    for wire_dtype in WIRE_DTYPES:
        _report(result, wire_dtype, encoded_size(wire_dtype, numel), nodes, samples[wire_dtype])
    _report_anchor(result, samples)
    _report_sent(result, samples)
    return result


def _report_sent(result: BenchResult, samples: dict[str, list[dict[str, Any]]]) -> None:
    """Bytes each member sent in fp32 against every other wire dtype, measured in the same run."""

    def sent(wire_dtype: str) -> float:
        last = samples[wire_dtype][-1]["replies"]
        return sum(reply["bytes_sent"] for reply in last) / len(last)

    for wire_dtype in WIRE_DTYPES[1:]:
        target = "target ≥ 100" if is_sparse(wire_dtype) else ""
        result.ratio(f"bytes sent per member, fp32 / {wire_dtype}", sent("fp32") / sent(wire_dtype), target)


def _butterfly_members(
    tmp: Path, children: contextlib.ExitStack, ids: list[str], *args: str
) -> tuple[tuple[Member, ...], list[Worker]]:
    """An `average` worker per node id (`args`: its further arguments) and the group's members."""
    workers = [children.enter_context(Worker(tmp, "average", node_id, *args)) for node_id in ids]
    members = tuple(
        Member(node_id, f"127.0.0.1:{worker.read(WORKER_START_S)['grpc']}")
        for node_id, worker in zip(ids, workers, strict=True)
    )
    return members, workers


def _gloo_members(tmp: Path, children: contextlib.ExitStack, nodes: int) -> list[Worker]:
    port = free_port()
    glooers = [
        children.enter_context(Worker(tmp, "gloo", str(k), str(nodes), str(port))) for k in range(nodes)
    ]
    for worker in glooers:
        worker.read(WORKER_START_S)
    return glooers


def _sample_gloo(glooers: list[Worker], numel: int, r: int, samples: dict[str, list[dict[str, Any]]]) -> None:
    """One gloo `all_reduce` per dtype, its time the slowest rank's (round 0: warm-up, not kept)."""
    for dtype in GLOO_DTYPES:
        for k, worker in enumerate(glooers):
            worker.ask({"numel": numel, "seed": k, "dtype": dtype}, ROUND_TIMEOUT_S)
        for worker in glooers:
            worker.send({"go": True})
        replies = [worker.read(ROUND_TIMEOUT_S) for worker in glooers]
        if r > 0:
            samples.setdefault(f"gloo {dtype}", []).append(
                {"seconds": max(reply["seconds"] for reply in replies), "cpu_s": _mean_cpu(replies)}
            )


def _param_count(preset_name: str) -> int:
    return count_parameters(build_model(preset(preset_name, 256), 0, torch.device("cpu")))


def _one_round(
    workers: list[Worker], spec: GroupSpec, numel: int, scale0: float = 1.0
) -> list[dict[str, Any]]:
    """One all-reduce of random Δs (member k's from seed k; member 0's × `scale0`)."""
    for k, worker in enumerate(workers):
        request = {"spec": spec.to_dict(), "numel": numel, "seed": k, "scale": scale0 if k == 0 else 1.0}
        if not worker.ask(request, ROUND_TIMEOUT_S)["ready"]:
            raise RuntimeError(f"member {k} refused group {spec.group_id}")
    for worker in workers:
        worker.send({"go": True})
    return [worker.read(ROUND_TIMEOUT_S) for worker in workers]


def _report(
    result: BenchResult, wire_dtype: str, size: int, nodes: int, samples: list[dict[str, Any]]
) -> None:
    # The top-k wire relays each contribution to every member: (N − 1) images, not 2(N − 1)/N.
    share = (nodes - 1) if is_sparse(wire_dtype) else 2 * (nodes - 1) / nodes
    seconds = [max(reply["seconds"] for reply in sample["replies"]) for sample in samples]
    bound = share * min(sample["raw"] for sample in samples)
    coverage = min(reply["coverage"] for sample in samples for reply in sample["replies"])
    last = samples[-1]["replies"]
    sent = sum(reply["bytes_sent"] for reply in last) / len(last)
    result.add(
        f"all-reduce {wire_dtype}",
        median(seconds) * 1e3,
        "ms",
        f"median of {len(seconds)}, best {min(seconds) * 1e3:.0f} ms; coverage {coverage:.2f}",
    )
    cpu = median([_mean_cpu(sample["replies"]) for sample in samples])
    result.add(f"  where the time went, {wire_dtype}", cpu * 1e3, "ms CPU", _phases_note(samples))
    result.add(
        f"raw TCP of the {wire_dtype} bytes",
        size / min(sample["raw"] for sample in samples) / 1e9,
        "GB/s",
        f"{size / 1e6:.1f} MB; butterfly bound {bound * 1e3:.1f} ms",
    )
    bound_note = "(N-1) x bytes" if is_sparse(wire_dtype) else "2(N-1)/N x bytes"
    result.add(f"bytes sent per member, {wire_dtype}", sent / (share * size), "x bound", bound_note)
    result.add(f"bytes sent per member, {wire_dtype} (MB)", sent / 1e6, "MB", "measured, last round")
    result.ratio(f"all-reduce {wire_dtype} / butterfly bound", median(seconds) / bound, "medians")


def _phases_note(samples: list[dict[str, Any]]) -> str:
    """The slowest member's phases (median over rounds): when its parts were encoded, sent, its own part
    reduced, the results in, and Δ assembled, each since the all-reduce began."""
    phases: dict[str, list[float]] = {}
    for sample in samples:
        slowest = max(sample["replies"], key=lambda reply: reply["seconds"])
        for name, at in slowest["phases"].items():
            phases.setdefault(name, []).append(at)
    marks = ", ".join(f"{name} {median(ats) * 1e3:.0f}" for name, ats in phases.items())
    return f"per member (all threads); slowest member reached {marks} ms"


def _mean_cpu(replies: list[dict[str, Any]]) -> float:
    return sum(reply["cpu_s"] for reply in replies) / len(replies)


def _report_gloo(result: BenchResult, samples: dict[str, list[dict[str, Any]]]) -> None:
    for dtype in GLOO_DTYPES:
        seconds = [sample["seconds"] for sample in samples[f"gloo {dtype}"]]
        cpu = median([sample["cpu_s"] for sample in samples[f"gloo {dtype}"]])
        result.add(
            f"gloo all_reduce {dtype} (anchor)",
            median(seconds) * 1e3,
            "ms",
            f"median of {len(seconds)}, best {min(seconds) * 1e3:.0f} ms; CPU {cpu * 1e3:.0f} ms per rank",
        )


def _report_anchor(result: BenchResult, samples: dict[str, list[dict[str, Any]]]) -> None:
    gloo = median([sample["seconds"] for sample in samples["gloo fp32"]])
    gloo_cpu = median([sample["cpu_s"] for sample in samples["gloo fp32"]])
    for wire_dtype, target in (("fp32", "target ≤ 1.5"), ("bf16", "target < 1")):
        ours = median([max(r["seconds"] for r in sample["replies"]) for sample in samples[wire_dtype]])
        result.ratio(f"all-reduce {wire_dtype} / gloo fp32", ours / gloo, f"medians; {target}")
    ours_cpu = median([_mean_cpu(sample["replies"]) for sample in samples["fp32"]])
    result.ratio("CPU per member, fp32 / gloo fp32", ours_cpu / gloo_cpu, "medians; all threads")
