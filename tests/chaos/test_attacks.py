"""One hostile volunteer cannot wreck the model: real `swarmnode run` processes (tiny model, pinned shards,
fixed identities), one of which attacks every round, or a stranger's script proposing groups to every
node. Each cell holds the honest members' held-out loss after ROUNDS rounds to within 5% of the same
honest members averaging alone (same identities, shards and seed), and their rounds per minute to at
least 80% of an attack-free swarm of as many nodes.

The attacks (`swarmnode/util/faults.py`), each under the default --max-norm-ratio 8, so the norm screen
lets it through: −7 × its Δ (`flip`), a fixed direction of 7 × its Δ's norm, noise of its Δ's norm, −4 ×
the last round's average (`minus4`, at the honest weight: the cap's maximum), a weight 100 × the tokens it
trained (`overweight`), and a member that accepts groups and then sends and reduces nothing (`noshow`).
Before the robust outer step `flip` took a 3-node swarm's held-out loss from 1.74 to over 2,000 in 10
rounds; a stranger's group was accepted by every node."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import grpc
import pytest

from swarmnode.net import rpc
from swarmnode.net.identity import Identity
from swarmnode.proto.v1 import averaging_pb2_grpc
from swarmnode.swarm.averaging.trust import AveragingTrust, SenderProof
from swarmnode.swarm.averaging.wire import GroupSpec, Member, spec_to_pb
from swarmtest import NodeProcess, ProcessReaper, cold_metadata, start_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROUNDS = 10
SWARM = (
    *("--inner-steps", "10", "--hot-every", "1000", "--cold-every", "1", "--keep-cold", "100"),
    *("--matchmaking-timeout", "15", "--allreduce-timeout", "20", "--seed", "5", "--threads", "1"),
    *("--run-id", "attack", "--max-outer-steps", str(ROUNDS)),
)
ATTACKS = {
    "flip": "scale@delta=-7",
    "flip2": "scale@delta=-2",
    "direction": "direction@delta=7",
    "noise": "noise@delta",
    "minus4": "follow@delta=-4",
    "overweight": "lie@weight=100",
    "noshow": "drop@allreduce_send",
}
FIRED = {
    "overweight": "tokens a round allows",  # an honest node left its offer out
    "noshow": "sending and reducing nothing",
}
"""What shows the fault fired (in the attacker's log; overweight: in an honest node's)."""
LOSS_BOUND, RATE_BOUND = 1.05, 0.80


@pytest.fixture(scope="module")
def identities(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("identities")
    for i in range(4):
        Identity.load_or_create(root / f"id{i}.key")
    return [root / f"id{i}.key" for i in range(4)]


def run_swarm(
    reaper, base: Path, identities: list[Path], faults: list[str | None], during=None
) -> list[NodeProcess]:
    count = len(faults)
    extra = [["--identity", str(identities[i]), "--shard", str(i)] for i in range(count)]
    nodes = start_swarm(reaper, base, count, [*SWARM, "--wait-peers", str(count - 1)], faults, extra)
    if during is not None:
        during(nodes)
    for node in nodes:
        assert node.wait(900) == 0, node.log_tail()
    return nodes


def final_losses(nodes: list[NodeProcess]) -> list[float]:
    return [cold_metadata(node)[ROUNDS]["heldout_loss"] for node in nodes]


def rounds_per_minute(node: NodeProcess) -> float:
    """From its cold snapshots' times: rounds 1 to ROUNDS (the start-up and first matchmaking left out)."""
    meta = cold_metadata(node)
    return 60 * (ROUNDS - 1) / (meta[ROUNDS]["created_at"] - meta[1]["created_at"])


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def alone(tmp_path_factory, identities) -> dict[int, tuple[list[float], float]]:
    """Attack-free swarms of 2, 3 and 4 members: each member's held-out loss after ROUNDS rounds (the
    reference of the honest members of a swarm one larger) and the swarm's rounds per minute (the
    reference of an attacked swarm as large)."""
    reaper = ProcessReaper()
    try:
        found = {}
        for count in (2, 3, 4):
            nodes = run_swarm(reaper, tmp_path_factory.mktemp(f"alone{count}"), identities, [None] * count)
            found[count] = (final_losses(nodes), mean([rounds_per_minute(n) for n in nodes]))
            print(f"attack-free, {count} members: losses {found[count][0]}, {found[count][1]:.1f} rounds/min")
        return found
    finally:
        reaper.kill_all()


def check_the_honest(
    honest: list[NodeProcess], alone: dict[int, tuple[list[float], float]], members: int, label: str
) -> tuple[float, float]:
    """Returns (the worst honest loss ratio, the rate ratio) after asserting one digest among them."""
    metas = [cold_metadata(node)[ROUNDS] for node in honest]
    assert len({meta["global_digest"] for meta in metas}) == 1
    reference, rate = alone[len(honest)][0], alone[members][1]
    loss_ratio = max(meta["heldout_loss"] / ref for meta, ref in zip(metas, reference, strict=True))
    rate_ratio = mean([rounds_per_minute(n) for n in honest]) / rate
    print(
        f"{label}, {members} members: loss {loss_ratio:.3f}x the honest alone, rounds/min {rate_ratio:.2f}x"
    )
    return loss_ratio, rate_ratio


def groups_joined(honest: NodeProcess, attacker: NodeProcess) -> int:
    rounds = cold_metadata(honest)
    return sum(attacker.info["node_id"] in group_of(rounds[r]) for r in range(1, ROUNDS + 1))


def group_of(meta: dict) -> list[str]:
    return (meta.get("last_round") or {}).get("group", [])


def averaged_in(meta: dict) -> list[str]:
    return (meta.get("last_round") or {}).get("included", [])


def weights_of(meta: dict) -> dict[str, float]:
    return (meta.get("last_round") or {}).get("weights", {})


@pytest.mark.parametrize("members", [3, 4])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_one_hostile_member_cannot_move_the_honest_loss(
    tmp_path: Path, reaper, identities, alone, members: int, attack: str
) -> None:
    nodes = run_swarm(reaper, tmp_path, identities, [*[None] * (members - 1), ATTACKS[attack]])
    honest, attacker = nodes[:-1], nodes[-1]
    where = honest[0].log() + honest[-1].log() if attack == "overweight" else attacker.log()
    assert FIRED.get(attack, "pseudo-gradient is poisoned") in where  # the fault fired
    loss_ratio, rate_ratio = check_the_honest(honest, alone, members, attack)
    assert loss_ratio <= LOSS_BOUND
    joined = groups_joined(honest[0], attacker)
    if attack == "overweight":
        # Refused at the offer: never averaged in (a round it had no tokens for, it may sit in a group
        # at weight 0), and no member of any group weighed more than a round allows.
        rounds = cold_metadata(honest[0])
        cap = re.search(r"over the (\d+) tokens a round allows", where)
        assert cap is not None
        assert not any(attacker.info["node_id"] in averaged_in(rounds[r]) for r in range(1, ROUNDS + 1))
        assert max(w for r in range(1, ROUNDS + 1) for w in weights_of(rounds[r]).values()) <= int(cap[1])
    elif attack == "noshow":
        # In a group, cut off after a grace (not the all-reduce budget), then left out and not waited
        # for until it delivers: at most 3 of 10 groups even were it always on time.
        assert 1 <= joined <= 3, joined
        assert any("never called" in node.log() for node in honest)
    else:
        assert joined >= ROUNDS // 2, joined  # it took part: the aggregation, not its absence, held
    if attack in ("flip", "flip2"):  # against the others: left out, whatever its norm under the screen
        assert any(re.search(r"left member \d .* out of part \d+: opposed", node.log()) for node in honest)
    if attack == "direction":  # far from the others: clipped (or left out, where it points against them)
        assert any(re.search(r"clipped member|: opposed", node.log()) for node in honest)
    assert rate_ratio >= RATE_BOUND


class Stranger:
    """A fresh key, never in the DHT, never offering: proposes every round's group of all the nodes plus
    itself (a client member of weight 1e6) to every node, a few times a second, until stopped."""

    def __init__(self, nodes: list[NodeProcess], budget_s: float) -> None:
        self.identity = Identity.generate()
        self.nodes, self.budget_s = nodes, budget_s
        self.trust = AveragingTrust(SenderProof.SIGNATURE, self.identity)
        self.stop = threading.Event()
        self.sent = self.accepted = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    @property
    def node_id(self) -> str:
        return self.identity.node_id_hex

    def _group(self, round_index: int, serial: int) -> GroupSpec:
        members = [Member(n.info["node_id"], f"127.0.0.1:{n.info['grpc_port']}") for n in self.nodes]
        members.append(Member(self.node_id, "", 1e6, reachable=False))
        return GroupSpec(
            "attack", round_index, f"{round_index}-stranger-{serial}", tuple(members), "fp32", self.budget_s
        )

    async def _run(self) -> None:
        channels = [rpc.open_channel(f"127.0.0.1:{n.info['grpc_port']}") for n in self.nodes]
        stubs = [averaging_pb2_grpc.AveragingServiceStub(c) for c in channels]
        serial = 0
        try:
            while not self.stop.is_set():
                for round_index in range(ROUNDS + 1):
                    serial += 1
                    proposal = self.trust.sign_proposal(spec_to_pb(self._group(round_index, serial)))
                    for stub in stubs:
                        try:
                            reply = await stub.Propose(proposal, timeout=5)
                            self.accepted += reply.accepted
                        except grpc.aio.AioRpcError:
                            pass  # a node that has stopped
                        self.sent += 1
                await asyncio.sleep(0.3)
        finally:
            for channel in channels:
                await channel.close()


@pytest.mark.parametrize("budget_s", [30.0, 600.0])
def test_a_strangers_proposals_are_refused_and_cost_the_swarm_nothing(
    tmp_path: Path, reaper, identities, alone, budget_s: float
) -> None:
    strangers: list[Stranger] = []

    def propose(nodes: list[NodeProcess]) -> None:
        strangers.append(Stranger(nodes, budget_s))

    try:
        nodes = run_swarm(reaper, tmp_path, identities, [None] * 3, during=propose)
    finally:
        for stranger in strangers:
            stranger.stop.set()
            stranger.thread.join(30)
    stranger = strangers[0]
    refused = sum(
        len(re.findall(rf"refused group \S+ proposed by {stranger.node_id[:12]}", n.log())) for n in nodes
    )
    print(f"stranger ({budget_s:.0f} s budget): {stranger.sent} proposals sent, {refused} refused")
    assert stranger.accepted == 0 and refused >= ROUNDS  # the fault fired: it proposed in every round
    loss_ratio, rate_ratio = check_the_honest(nodes, alone, 3, f"stranger {budget_s:.0f} s")
    assert all(stranger.node_id not in group_of(meta) for meta in cold_metadata(nodes[0]).values())
    assert loss_ratio <= LOSS_BOUND and rate_ratio >= RATE_BOUND
