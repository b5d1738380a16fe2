from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DialBackRequest(_message.Message):
    __slots__ = ("port", "node_id")
    PORT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    port: int
    node_id: str
    def __init__(self, port: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("reachable", "observed_host", "reason")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    observed_host: str
    reason: str
    def __init__(self, reachable: _Optional[bool] = ..., observed_host: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
