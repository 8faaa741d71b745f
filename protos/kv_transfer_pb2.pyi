from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHeader(_message.Message):
    __slots__ = ("request_id", "sender_id", "model_fingerprint", "dtype", "layout", "layer_start", "layer_end", "dest_block_ids", "num_tokens", "payload_bytes", "checksum", "first_token", "cluster_token", "token_offset", "kv_scales", "block_hashes", "lora_identity", "head_start", "head_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sender_id: str
    model_fingerprint: str
    dtype: str
    layout: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    payload_bytes: int
    checksum: bytes
    first_token: int
    cluster_token: str
    token_offset: int
    kv_scales: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    lora_identity: str
    head_start: int
    head_end: int
    def __init__(self, request_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., layout: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., checksum: _Optional[bytes] = ..., first_token: _Optional[int] = ..., cluster_token: _Optional[str] = ..., token_offset: _Optional[int] = ..., kv_scales: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., lora_identity: _Optional[str] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVPushReply(_message.Message):
    __slots__ = ("ok", "error", "bytes_received")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    bytes_received: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class KVPullRequest(_message.Message):
    __slots__ = ("request_id", "puller_id", "cluster_token", "model_fingerprint", "block_hashes", "dest_block_ids", "token_offset", "block_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PULLER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    puller_id: str
    cluster_token: str
    model_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_offset: int
    block_size: int
    def __init__(self, request_id: _Optional[str] = ..., puller_id: _Optional[str] = ..., cluster_token: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., token_offset: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...
