from swarmnode.proto.v1 import snapshot_pb2 as _snapshot_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AwaitGroupRequest(_message.Message):
    __slots__ = ("run_id", "round", "node_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    node_id: str
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("node_id", "address", "weight", "cursor", "global_digest", "client")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    weight: float
    cursor: _snapshot_pb2.DataCursor
    global_digest: str
    client: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., weight: _Optional[float] = ..., cursor: _Optional[_Union[_snapshot_pb2.DataCursor, _Mapping]] = ..., global_digest: _Optional[str] = ..., client: _Optional[bool] = ...) -> None: ...

class GroupProposal(_message.Message):
    __slots__ = ("run_id", "round", "group_id", "members", "wire_dtype", "timeout_s", "leader_public_key", "signature", "member_offers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEADER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_OFFERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    group_id: str
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    wire_dtype: str
    timeout_s: float
    leader_public_key: bytes
    signature: bytes
    member_offers: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., group_id: _Optional[str] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., wire_dtype: _Optional[str] = ..., timeout_s: _Optional[float] = ..., leader_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., member_offers: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ProposalReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ContributionHeader(_message.Message):
    __slots__ = ("group_id", "run_id", "round", "sender", "node_id", "part", "weight", "wire_dtype", "total_elements", "part_elements", "public_key", "signature")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    PART_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    run_id: str
    round: int
    sender: int
    node_id: str
    part: int
    weight: float
    wire_dtype: str
    total_elements: int
    part_elements: int
    public_key: bytes
    signature: bytes
    def __init__(self, group_id: _Optional[str] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[int] = ..., node_id: _Optional[str] = ..., part: _Optional[int] = ..., weight: _Optional[float] = ..., wire_dtype: _Optional[str] = ..., total_elements: _Optional[int] = ..., part_elements: _Optional[int] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Contribution(_message.Message):
    __slots__ = ("header", "offset", "data", "signature", "bulk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    header: ContributionHeader
    offset: int
    data: bytes
    signature: bytes
    bulk: bool
    def __init__(self, header: _Optional[_Union[ContributionHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., bulk: _Optional[bool] = ...) -> None: ...

class AveragedHeader(_message.Message):
    __slots__ = ("contributors", "part_elements", "wire_dtype", "included", "bulk", "excluded")
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PART_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    contributors: int
    part_elements: int
    wire_dtype: str
    included: _containers.RepeatedScalarFieldContainer[int]
    bulk: bool
    excluded: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, contributors: _Optional[int] = ..., part_elements: _Optional[int] = ..., wire_dtype: _Optional[str] = ..., included: _Optional[_Iterable[int]] = ..., bulk: _Optional[bool] = ..., excluded: _Optional[_Iterable[int]] = ...) -> None: ...

class AveragedPart(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: AveragedHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[AveragedHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
