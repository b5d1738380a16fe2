from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SnapshotMeta(_message.Message):
    __slots__ = ("snapshot_id", "size_bytes", "outer_step", "inner_step", "kind", "created_at", "codec", "run_id", "node_id")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    size_bytes: int
    outer_step: int
    inner_step: int
    kind: str
    created_at: float
    codec: str
    run_id: str
    node_id: str
    def __init__(self, snapshot_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., kind: _Optional[str] = ..., created_at: _Optional[float] = ..., codec: _Optional[str] = ..., run_id: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotMeta]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotMeta, _Mapping]]] = ...) -> None: ...

class FetchSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id", "offset")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    offset: int
    def __init__(self, snapshot_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FetchSnapshotChunk(_message.Message):
    __slots__ = ("meta", "offset", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: SnapshotMeta
    offset: int
    data: bytes
    def __init__(self, meta: _Optional[_Union[SnapshotMeta, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataCursor(_message.Message):
    __slots__ = ("shard", "epoch", "position")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    shard: int
    epoch: int
    position: int
    def __init__(self, shard: _Optional[int] = ..., epoch: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "run_id", "phase", "uptime_s", "outer_step", "inner_step", "last_loss", "tokens_per_s", "cursor", "snapshots", "peers", "global_digest", "last_group", "last_coverage", "last_allreduce_s", "repairs", "reachability", "snapshot_error", "run_settings")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAST_GROUP_FIELD_NUMBER: _ClassVar[int]
    LAST_COVERAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_ALLREDUCE_S_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ERROR_FIELD_NUMBER: _ClassVar[int]
    RUN_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    phase: str
    uptime_s: float
    outer_step: int
    inner_step: int
    last_loss: float
    tokens_per_s: float
    cursor: DataCursor
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotMeta]
    peers: int
    global_digest: str
    last_group: _containers.RepeatedScalarFieldContainer[str]
    last_coverage: float
    last_allreduce_s: float
    repairs: int
    reachability: str
    snapshot_error: str
    run_settings: str
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., phase: _Optional[str] = ..., uptime_s: _Optional[float] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., last_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., cursor: _Optional[_Union[DataCursor, _Mapping]] = ..., snapshots: _Optional[_Iterable[_Union[SnapshotMeta, _Mapping]]] = ..., peers: _Optional[int] = ..., global_digest: _Optional[str] = ..., last_group: _Optional[_Iterable[str]] = ..., last_coverage: _Optional[float] = ..., last_allreduce_s: _Optional[float] = ..., repairs: _Optional[int] = ..., reachability: _Optional[str] = ..., snapshot_error: _Optional[str] = ..., run_settings: _Optional[str] = ...) -> None: ...
