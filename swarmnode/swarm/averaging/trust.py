"""Who is speaking in an all-reduce (docs/design.md "Trust"): every contribution is bound to an authenticated
member, and every group to the leader that froze it.

- With mutual TLS (`SenderProof.CERTIFICATE`) the reducer takes the sender from the connection: the
  caller's certificate, which the swarm's CA signed in the handshake, names its node id
  (`security.authenticated_node_id`).
- Without it (`SenderProof.SIGNATURE`: a token-only or open swarm) the sender signs with its DHT
  identity key (Ed25519; its node id is the hash of that key): the contribution header (which carries
  the public key, so the id it claims is checked against the group's member), and every chunk over
  (run, round, group id, part, chunk index, sha256 of the chunk's bytes). A chunk replayed to another
  reducer (another part), into another group or round, out of order, or with other bytes fails its
  signature; a whole call replayed to the same reducer is a second call from that sender (refused).
- `SenderProof.NONE` trusts the header's word: only for in-process tests and benches that build a
  servicer without an identity.

The leader signs the group it proposes (`sign_proposal`); a member accepts it only if the signature
verifies with a key whose node id is one of the group's members (and, with mutual TLS, the caller's).

Every check returns a refusal reason (`AveragingReject`) or None, never raises for a peer's input.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from swarmnode.net.identity import Identity, node_id_from_public_key, verify_signature
from swarmnode.net.security import authenticated_node_id
from swarmnode.proto.v1 import averaging_pb2 as pb
from swarmnode.swarm.averaging.wire import GroupSpec
from swarmnode.util.labels import AveragingReject

DEFAULT_MAX_NORM_RATIO = 8.0
"""Default of --max-norm-ratio, the robust aggregation's bound (`aggregation.robust_filter`;
docs/benchmarks.md "Robust aggregation's bound" has the measurement it comes from)."""
_HEADER_TAG = b"swarmnode/v1/contribution-header\x00"
_CHUNK_TAG = b"swarmnode/v1/contribution-chunk\x00"
_PROPOSAL_TAG = b"swarmnode/v1/group-proposal\x00"


class SenderProof(StrEnum):
    """How a reducer knows which member sent a contribution."""

    CERTIFICATE = "certificate"
    SIGNATURE = "signature"
    NONE = "none"


@dataclass(frozen=True)
class Speaker:
    """Who an `Exchange` call proved to be: its node id (None: not proven), and why it is refused
    (None: admitted as the member its header names)."""

    node_id: str | None
    refusal: AveragingReject | None = None
    by_connection: bool = False
    """Proven by the connection itself (a certificate), not by a signature someone could replay: any
    lie in the header is then the caller's own."""


def header_message(h: pb.ContributionHeader) -> bytes:
    """The bytes a contribution header's signature covers: the header without its signature."""
    unsigned = pb.ContributionHeader()
    unsigned.CopyFrom(h)
    unsigned.ClearField("signature")
    return _HEADER_TAG + unsigned.SerializeToString(deterministic=True)


def chunk_message(spec: GroupSpec, part: int, index: int, data: bytes | memoryview) -> bytes:
    """The bytes a chunk's signature covers: (run, round, group id, part, chunk index, sha256)."""
    fields = [spec.run_id, spec.round, spec.group_id, part, index, hashlib.sha256(data).hexdigest()]
    return _CHUNK_TAG + json.dumps(fields, separators=(",", ":")).encode()


def proposal_message(msg: pb.GroupProposal) -> bytes:
    unsigned = pb.GroupProposal()
    unsigned.CopyFrom(msg)
    unsigned.ClearField("signature")
    return _PROPOSAL_TAG + unsigned.SerializeToString(deterministic=True)


@dataclass(frozen=True)
class AveragingTrust:
    """One node's side of the all-reduce's authentication: what it signs and what it checks."""

    proof: SenderProof
    identity: Identity | None = None

    def __post_init__(self) -> None:
        if self.proof != SenderProof.NONE and self.identity is None:
            raise ValueError("signing and checking the averaging messages needs the node's identity")

    @classmethod
    def for_node(cls, identity: Identity, mutual_tls: bool) -> AveragingTrust:
        return cls(SenderProof.CERTIFICATE if mutual_tls else SenderProof.SIGNATURE, identity)

    @property
    def signs_chunks(self) -> bool:
        return self.proof == SenderProof.SIGNATURE

    # ----- the member side -----

    def sign_header(self, h: pb.ContributionHeader) -> pb.ContributionHeader:
        """`h` with the sender's public key and signature (unchanged unless chunks are signed)."""
        if not self.signs_chunks or self.identity is None:
            return h
        h.public_key = self.identity.public_key
        h.signature = self.identity.sign(header_message(h))
        return h

    def sign_chunks(self, spec: GroupSpec, part: int, chunks: list[memoryview]) -> list[bytes]:
        """One signature per chunk of a part's image (none unless chunks are signed)."""
        if not self.signs_chunks or self.identity is None:
            return []
        identity = self.identity
        return [identity.sign(chunk_message(spec, part, i, c)) for i, c in enumerate(chunks)]

    def sign_proposal(self, msg: pb.GroupProposal) -> pb.GroupProposal:
        if self.identity is not None:
            msg.leader_public_key = self.identity.public_key
            msg.signature = self.identity.sign(proposal_message(msg))
        return msg

    # ----- the checking side -----

    def speaker(self, h: pb.ContributionHeader, context: Any, spec: GroupSpec) -> Speaker:
        """Who sent this header, and whether it may speak as member `h.sender`."""
        if self.proof == SenderProof.NONE:
            return Speaker(None)  # nobody proven: the header's word is taken
        if self.proof == SenderProof.CERTIFICATE:
            node_id = authenticated_node_id(context)
            if node_id is None:
                return Speaker(None, AveragingReject.UNAUTHENTICATED)
            claimed = spec.members[h.sender].node_id if h.sender < len(spec.members) else None
            return Speaker(node_id, None if node_id == claimed else AveragingReject.IMPERSONATION, True)
        else:
            if not verify_signature(h.public_key, h.signature, header_message(h)):
                return Speaker(None, AveragingReject.BAD_SIGNATURE)
            node_id = node_id_from_public_key(h.public_key).hex()
        claimed = spec.members[h.sender].node_id if h.sender < len(spec.members) else None
        return Speaker(node_id, None if node_id == claimed else AveragingReject.IMPERSONATION)

    def chunk_ok(
        self,
        h: pb.ContributionHeader,
        spec: GroupSpec,
        index: int,
        data: bytes | memoryview,
        signature: bytes,
    ) -> bool:
        """Whether chunk `index` of a contribution (its `data` and `signature`) carries its sender's
        signature (always, unless chunks are signed in this swarm)."""
        if not self.signs_chunks:
            return True
        return verify_signature(h.public_key, signature, chunk_message(spec, h.part, index, data))

    def proposal_refusal(
        self, msg: pb.GroupProposal, spec: GroupSpec, context: Any
    ) -> AveragingReject | None:
        """Why a proposed group is refused: not signed by one of its members (with mutual TLS: by
        the caller)."""
        refusal = self.group_refusal(msg, spec)
        if refusal is not None or self.proof == SenderProof.NONE:
            return refusal
        leader = node_id_from_public_key(msg.leader_public_key).hex()
        if self.proof == SenderProof.CERTIFICATE and authenticated_node_id(context) != leader:
            return AveragingReject.IMPERSONATION
        return None

    def proposer(self, msg: pb.GroupProposal) -> str | None:
        """The node that signed a proposal (checked by `proposal_refusal`); None when nothing is
        checked (`SenderProof.NONE`)."""
        if self.proof == SenderProof.NONE:
            return None
        return node_id_from_public_key(msg.leader_public_key).hex()

    def group_refusal(self, msg: pb.GroupProposal, spec: GroupSpec) -> AveragingReject | None:
        """Why a group is refused wherever it came from (a proposal, or a client member's pull): not
        signed by one of its members."""
        if self.proof == SenderProof.NONE:
            return None
        if not verify_signature(msg.leader_public_key, msg.signature, proposal_message(msg)):
            return AveragingReject.BAD_SIGNATURE
        leader = node_id_from_public_key(msg.leader_public_key).hex()
        if spec.find(leader) is None:
            return AveragingReject.IMPERSONATION
        return None


UNCHECKED = AveragingTrust(SenderProof.NONE)
"""Trusts the header's word and signs nothing: in-process tests and benches without identities."""
