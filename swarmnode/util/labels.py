"""The small fixed vocabularies that label metrics, ledger entries and receipts, declared once: the
modules that own each concept use these enums, and the metrics pre-register every value."""

from __future__ import annotations

from enum import StrEnum


class SnapshotKind(StrEnum):
    """Hot snapshots are speculative and frequent, cold ones fsynced after an outer step."""

    HOT = "hot"
    COLD = "cold"


class RecoverySource(StrEnum):
    """Where a start's state came from."""

    LOCAL = "local"
    PEER = "peer"
    FRESH = "fresh"


class CursorSource(StrEnum):
    """Where a restored node's data cursor came from."""

    OWN_SNAPSHOT = "own_snapshot"
    ANNOUNCEMENT = "announcement"
    ROUND_METADATA = "round_metadata"
    TAKEOVER = "takeover"
    """Another node's committed cursor on the shard this node claimed (swarm/shards.py)."""
    FRESH = "fresh"


class FetchFailure(StrEnum):
    """Why a snapshot fetch (or a recovery candidate) from a peer was given up."""

    UNREACHABLE = "unreachable"
    REFUSED = "refused"
    HASH_MISMATCH = "hash_mismatch"
    TRUNCATED = "truncated"
    TOO_LARGE = "too_large"
    TIMEOUT = "timeout"
    INVALID = "invalid"
    INTERNAL = "internal"
    """Not the peer's fault: a bug here, logged with its traceback."""


class DHTReject(StrEnum):
    """Why a DHT entry or datagram was refused."""

    BAD_SIGNATURE = "bad_signature"
    OVERSIZED = "oversized"
    EXPIRED = "expired"
    TTL_TOO_LONG = "ttl_too_long"
    MALFORMED = "malformed"
    QUOTA = "quota"
    THROTTLED = "throttled"
    """A request from a sender that is not a verified contact, over its source's rate."""
    UNAUTHENTICATED = "unauthenticated"
    """A datagram of a token swarm without a valid tag."""


class Reachability(StrEnum):
    """Whether peers can open connections to a node (docs/design.md "Behind NAT")."""

    REACHABLE = "reachable"
    CLIENT = "client"
    """Not reachable: it dials out only; never a reducer, a leader, a routing contact or a source."""


class ProbeResult(StrEnum):
    """What one dial-back probe (asked or served) came to."""

    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"
    UNANSWERED = "unanswered"
    """Asked: the prober did not answer."""
    THROTTLED = "throttled"
    """Served: over the caller's rate or too many at once; nothing dialled."""
    INVALID = "invalid"


class SnapshotFailure(StrEnum):
    DISK_FULL = "disk_full"
    IO_ERROR = "io_error"


class RoundFailure(StrEnum):
    """Why a round fell short."""

    NO_PARTNERS = "no_partners"
    DIGEST_MISMATCH = "digest_mismatch"
    LOW_COVERAGE = "low_coverage"
    PARTIAL = "partial"
    ERROR = "error"


class AveragingReject(StrEnum):
    """Why an averaging call (a proposal or a contribution) was refused."""

    INVALID = "invalid"
    """A header or chunk that does not fit the group."""
    DUPLICATE = "duplicate"
    EXPIRED = "expired"
    OVER = "over"
    UNAUTHENTICATED = "unauthenticated"
    """With mutual TLS: the caller's certificate names no node."""
    BAD_SIGNATURE = "bad_signature"
    """A header, chunk or proposal whose signature does not verify."""
    IMPERSONATION = "impersonation"
    """The caller is not the member it claims to be (or the proposal's leader is no member)."""
    CHUNK_ORDER = "chunk_order"
    """A chunk that repeats, skips or overruns the part's bytes."""
    NOT_LEADER = "not_leader"
    """A proposal from a node that matchmaking's rule does not make the round's leader."""
    NOT_OFFERED = "not_offered"
    """A proposal naming a member without a signed offer for the round that says just that."""
    OVER_WEIGHT = "over_weight"
    BAD_SPARSE = "bad_sparse"
    """A top-k contribution whose image does not validate: its size, an index beyond its chunk or
    repeated, a NaN, infinite or negative scale (`core/sparse.py`)."""
    """An offer or contribution whose token weight is over what the run allows a round."""
    NO_SHOW = "no_show"
    """A member that was in a group and delivered nothing: left out of the next groups for a while."""


class Exclusion(StrEnum):
    """Why a reducer left a member's contribution out of its part's average (robust aggregation)."""

    NORM = "norm"
    """Its norm is over --max-norm-ratio times the part's median contribution norm."""
    NONFINITE = "nonfinite"
    """It holds NaN or Inf."""
    OPPOSED = "opposed"
    """It points against the part's coordinate-wise median (a minority's, dense wires only)."""
