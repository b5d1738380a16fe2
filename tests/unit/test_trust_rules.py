"""The trust rules of the all-reduce without a network: who a header proves to be, what a chunk's and a
group's signature bind, and the robust aggregation that leaves a poisoner out."""

from __future__ import annotations

import math

import pytest
import torch

from swarmnode.net.identity import Identity
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging import wire
from swarmnode.swarm.averaging.aggregation import average, robust_filter
from swarmnode.swarm.averaging.trust import AveragingTrust, SenderProof
from swarmnode.swarm.averaging.wire import GroupSpec, Member
from swarmnode.util import faults
from swarmnode.util.labels import AveragingReject, Exclusion


@pytest.fixture(scope="module")
def group() -> tuple[list[Identity], GroupSpec]:
    identities = [Identity.generate() for _ in range(3)]
    members = tuple(Member(i.node_id_hex, f"127.0.0.1:{5000 + k}") for k, i in enumerate(identities))
    return identities, GroupSpec("run", 3, "3-group", members, "fp32", 20.0)


def signed_header(identity: Identity, spec: GroupSpec, sender: int, part: int) -> pb.ContributionHeader:
    trust = AveragingTrust(SenderProof.SIGNATURE, identity)
    return trust.sign_header(wire.contribution_header(spec, sender, part, 10.0, 300))


def test_a_signed_header_proves_its_sender_and_a_lie_about_the_index_is_caught(group) -> None:
    identities, spec = group
    checker = AveragingTrust(SenderProof.SIGNATURE, identities[1])
    honest = signed_header(identities[0], spec, 0, 1)
    assert checker.speaker(honest, None, spec).refusal is None
    assert checker.speaker(honest, None, spec).node_id == identities[0].node_id_hex
    # Member 2 claims to be member 0 (index and id), signing with its own key: caught, and attributed.
    liar = wire.contribution_header(spec, 0, 1, 10.0, 300)
    liar = AveragingTrust(SenderProof.SIGNATURE, identities[2]).sign_header(liar)
    speaker = checker.speaker(liar, None, spec)
    assert speaker.refusal == AveragingReject.IMPERSONATION
    assert speaker.node_id == identities[2].node_id_hex
    # With member 0's public key but not its private key, the signature cannot verify.
    liar.public_key = identities[0].public_key
    assert checker.speaker(liar, None, spec).refusal == AveragingReject.BAD_SIGNATURE
    # Any changed field of a captured header (here its weight) breaks its signature.
    altered = signed_header(identities[0], spec, 0, 1)
    altered.weight = 1e9
    assert checker.speaker(altered, None, spec).refusal == AveragingReject.BAD_SIGNATURE


def test_a_chunk_signature_binds_group_part_index_and_bytes(group) -> None:
    identities, spec = group
    sender = AveragingTrust(SenderProof.SIGNATURE, identities[0])
    checker = AveragingTrust(SenderProof.SIGNATURE, identities[1])
    data = [memoryview(b"a" * 100), memoryview(b"b" * 100)]
    signatures = sender.sign_chunks(spec, 1, data)
    header = signed_header(identities[0], spec, 0, 1)

    assert checker.chunk_ok(header, spec, 0, b"a" * 100, signatures[0])
    assert checker.chunk_ok(header, spec, 1, b"b" * 100, signatures[1])
    assert not checker.chunk_ok(header, spec, 0, b"c" * 100, signatures[0])  # other bytes
    assert not checker.chunk_ok(header, spec, 1, b"a" * 100, signatures[0])  # another index
    to_part_2 = signed_header(identities[0], spec, 0, 2)  # replayed to reducer 2: another part
    assert not checker.chunk_ok(to_part_2, spec, 0, b"a" * 100, signatures[0])
    later = GroupSpec("run", 4, "4-group", spec.members, "fp32", 20.0)  # another round and group
    assert not checker.chunk_ok(header, later, 0, b"a" * 100, signatures[0])
    assert sender.signs_chunks and not AveragingTrust(SenderProof.CERTIFICATE, identities[0]).signs_chunks


def test_a_group_must_be_signed_by_one_of_its_members_and_not_altered(group) -> None:
    identities, spec = group
    checker = AveragingTrust(SenderProof.SIGNATURE, identities[1])
    signed = AveragingTrust(SenderProof.SIGNATURE, identities[0]).sign_proposal(wire.spec_to_pb(spec))
    assert checker.proposal_refusal(signed, wire.spec_from_pb(signed), None) is None
    altered = pb.GroupProposal()
    altered.CopyFrom(signed)
    altered.timeout_s = 500.0
    assert (
        checker.proposal_refusal(altered, wire.spec_from_pb(altered), None) == AveragingReject.BAD_SIGNATURE
    )
    stranger = AveragingTrust(SenderProof.SIGNATURE, Identity.generate()).sign_proposal(wire.spec_to_pb(spec))
    assert checker.proposal_refusal(stranger, spec, None) == AveragingReject.IMPERSONATION
    unsigned = wire.spec_to_pb(spec)
    assert checker.proposal_refusal(unsigned, spec, None) == AveragingReject.BAD_SIGNATURE


def test_a_group_budget_is_bounded() -> None:
    member = (Member("01", "127.0.0.1:1"),)
    with pytest.raises(ValueError, match="timeout"):
        GroupSpec("run", 0, "g", member, "fp32", wire.MAX_TIMEOUT_S + 1)


def honest(seed: int, n: int = 1000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01


def test_robust_filter_leaves_out_a_scaled_or_nonfinite_contribution() -> None:
    scaled = honest(3) * 1000
    nan = honest(4)
    nan[7] = math.nan
    contributions = [(0, 1.0, honest(0)), (1, 1.0, honest(1)), (2, 1.0, scaled), (3, 1.0, nan)]
    kept, excluded = robust_filter(contributions, 8.0)
    assert [index for index, _, _ in kept] == [0, 1]
    assert excluded == ((2, Exclusion.NORM), (3, Exclusion.NONFINITE))
    # Two members: the lower median is the smaller norm, so one honest member screens the other.
    kept, excluded = robust_filter([(0, 1.0, honest(0)), (1, 1.0, scaled)], 8.0)
    assert [index for index, _, _ in kept] == [0] and excluded == ((1, Exclusion.NORM),)
    # Honest contributions of unequal size (a member that trained fewer steps) are all kept.
    kept, excluded = robust_filter([(0, 1.0, honest(0)), (1, 1.0, honest(1) * 4)], 8.0)
    assert len(kept) == 2 and not excluded


def test_average_counts_neither_the_poisoners_values_nor_its_tokens() -> None:
    a, b = honest(0, 64), honest(1, 64)
    averaged = average([(0, 1.0, a), (1, 3.0, b), (2, 1e6, honest(2, 64) * 1e4)], "fp32", 64)
    assert averaged.included == (0, 1) and averaged.excluded == ((2, Exclusion.NORM),)
    assert averaged.values is not None
    assert torch.allclose(averaged.values, 0.25 * a + 0.75 * b)


def test_poisoning_and_lying_faults_parse_and_apply_only_where_due() -> None:
    try:
        faults.configure("scale@delta#2=1000,nan@delta#3,lie@sender")
        assert faults.due("scale", "delta", 1) is None
        fault = faults.due("scale", "delta", 2)
        assert fault is not None and fault.arg == 1000
        assert faults.due("nan", "delta", 3) is not None
        assert faults.find("lie", "sender") is not None and faults.find("lie", "part") is None
    finally:
        faults.configure(None)


def test_the_attack_faults_send_what_they_say() -> None:
    """The chaos cell's attackers (`tests/chaos/test_attacks.py`): each poison is what its spec names."""
    from swarmnode.core.training import _poisoned

    delta, last = torch.randn(1000), torch.randn(1000)
    original = delta.clone()
    try:
        faults.configure("direction@delta=7")
        first, second = _poisoned(delta, 1, None), _poisoned(2 * delta, 2, None)
        assert abs(float(first.norm()) - 7 * float(delta.norm())) < 1e-3 * float(delta.norm())
        assert torch.allclose(first / first.norm(), second / second.norm())  # one fixed direction
        faults.configure("noise@delta")
        noise = _poisoned(delta, 1, None)
        assert (
            abs(float(noise.norm() / delta.norm()) - 1) < 1e-4
            and abs(float(noise @ delta)) < float(delta.norm()) ** 2 / 4
        )
        faults.configure("follow@delta=-4")
        assert torch.equal(_poisoned(delta, 1, None), -4 * delta)  # its own Δ before any average
        assert torch.equal(_poisoned(delta, 2, last), -4 * last)
        assert torch.equal(delta, original)  # the trainer's Δ is never touched
        faults.configure("lie@weight=100,drop@allreduce_send")
        assert faults.find("lie", "weight").arg == 100 and faults.find("drop", "allreduce_send") is not None
    finally:
        faults.configure(None)
