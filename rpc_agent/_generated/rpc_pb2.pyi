from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    HELLO: _ClassVar[Kind]
    CALL: _ClassVar[Kind]
    REMOTE_CALL: _ClassVar[Kind]
    RESPONSE: _ClassVar[Kind]
    ERROR: _ClassVar[Kind]
KIND_UNSPECIFIED: Kind
HELLO: Kind
CALL: Kind
REMOTE_CALL: Kind
RESPONSE: Kind
ERROR: Kind

class BufferDescriptor(_message.Message):
    __slots__ = ("nbytes", "inline_data", "on_data_channel", "transfer_id")
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    ON_DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    inline_data: bytes
    on_data_channel: bool
    transfer_id: int
    def __init__(self, nbytes: _Optional[int] = ..., inline_data: _Optional[bytes] = ..., on_data_channel: _Optional[bool] = ..., transfer_id: _Optional[int] = ...) -> None: ...

class GloballyUniqueId(_message.Message):
    __slots__ = ("created_on", "local_id")
    CREATED_ON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ID_FIELD_NUMBER: _ClassVar[int]
    created_on: int
    local_id: int
    def __init__(self, created_on: _Optional[int] = ..., local_id: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("kind", "request_id", "context_id", "function", "payload", "buffers", "payload_ref", "rref_id", "fork_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_REF_FIELD_NUMBER: _ClassVar[int]
    RREF_ID_FIELD_NUMBER: _ClassVar[int]
    FORK_ID_FIELD_NUMBER: _ClassVar[int]
    kind: Kind
    request_id: int
    context_id: int
    function: str
    payload: bytes
    buffers: _containers.RepeatedCompositeFieldContainer[BufferDescriptor]
    payload_ref: BufferDescriptor
    rref_id: GloballyUniqueId
    fork_id: GloballyUniqueId
    def __init__(self, kind: _Optional[_Union[Kind, str]] = ..., request_id: _Optional[int] = ..., context_id: _Optional[int] = ..., function: _Optional[str] = ..., payload: _Optional[bytes] = ..., buffers: _Optional[_Iterable[_Union[BufferDescriptor, _Mapping]]] = ..., payload_ref: _Optional[_Union[BufferDescriptor, _Mapping]] = ..., rref_id: _Optional[_Union[GloballyUniqueId, _Mapping]] = ..., fork_id: _Optional[_Union[GloballyUniqueId, _Mapping]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    def __init__(self, frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("name", "id", "to_id", "timestamp", "nonce", "proof", "server_nonce", "encrypt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TO_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SERVER_NONCE_FIELD_NUMBER: _ClassVar[int]
    ENCRYPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    to_id: int
    timestamp: float
    nonce: bytes
    proof: bytes
    server_nonce: bytes
    encrypt: bool
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., to_id: _Optional[int] = ..., timestamp: _Optional[float] = ..., nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., server_nonce: _Optional[bytes] = ..., encrypt: _Optional[bool] = ...) -> None: ...
