from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRangeManifestRequest(_message.Message):
    __slots__ = ("outer_step",)
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    outer_step: int
    def __init__(self, outer_step: _Optional[int] = ...) -> None: ...

class RangeList(_message.Message):
    __slots__ = ("total_bytes", "range_bytes", "hashes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    range_bytes: int
    hashes: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., range_bytes: _Optional[int] = ..., hashes: _Optional[bytes] = ...) -> None: ...

class RangeManifest(_message.Message):
    __slots__ = ("outer_step", "snapshot_id", "shared", "node", "metadata_json", "public_key", "signature")
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    outer_step: int
    snapshot_id: str
    shared: RangeList
    node: RangeList
    metadata_json: str
    public_key: bytes
    signature: bytes
    def __init__(self, outer_step: _Optional[int] = ..., snapshot_id: _Optional[str] = ..., shared: _Optional[_Union[RangeList, _Mapping]] = ..., node: _Optional[_Union[RangeList, _Mapping]] = ..., metadata_json: _Optional[str] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class FetchRangeRequest(_message.Message):
    __slots__ = ("root", "index")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    root: str
    index: int
    def __init__(self, root: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class FetchRangeReply(_message.Message):
    __slots__ = ("data", "encoding")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    encoding: str
    def __init__(self, data: _Optional[bytes] = ..., encoding: _Optional[str] = ...) -> None: ...
