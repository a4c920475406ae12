from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids", "text", "messages")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: TokenIds
    text: str
    messages: Messages
    def __init__(self, token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "max_tokens", "stop_token_ids", "ignore_eos", "seed", "stop")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "n", "sampling", "mask", "grammar", "return_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    n: int
    sampling: SamplingParams
    mask: str
    grammar: Grammar
    return_text: bool
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mask: _Optional[str] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., return_text: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("arrow_ipc", "num_rows")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    num_rows: int
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., num_rows: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "drafter", "spec_method", "vocab_size", "eos_token_ids", "block_size", "max_model_len", "limits", "policy_version", "kv_blocks_free", "kv_blocks_total", "instance_id", "memory_released", "drafter_stats", "max_weight_streams", "weight_port")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DrafterStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SPEC_METHOD_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RELEASED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_STATS_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    drafter: str
    spec_method: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    max_model_len: int
    limits: _containers.ScalarMap[str, int]
    policy_version: int
    kv_blocks_free: int
    kv_blocks_total: int
    instance_id: str
    memory_released: bool
    drafter_stats: _containers.ScalarMap[str, float]
    max_weight_streams: int
    weight_port: int
    def __init__(self, model: _Optional[str] = ..., drafter: _Optional[str] = ..., spec_method: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., limits: _Optional[_Mapping[str, int]] = ..., policy_version: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., instance_id: _Optional[str] = ..., memory_released: _Optional[bool] = ..., drafter_stats: _Optional[_Mapping[str, float]] = ..., max_weight_streams: _Optional[int] = ..., weight_port: _Optional[int] = ...) -> None: ...

class DrafterWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterWeightsChunk(_message.Message):
    __slots__ = ("config_json", "safetensors", "policy_version", "total_bytes")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    safetensors: bytes
    policy_version: int
    total_bytes: int
    def __init__(self, config_json: _Optional[str] = ..., safetensors: _Optional[bytes] = ..., policy_version: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SafetensorsPart(_message.Message):
    __slots__ = ("file", "data")
    FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file: int
    data: bytes
    def __init__(self, file: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("draft", "safetensors", "tensor", "update_id", "streams")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    draft: bool
    safetensors: SafetensorsPart
    tensor: Tensor
    update_id: str
    streams: int
    def __init__(self, draft: _Optional[bool] = ..., safetensors: _Optional[_Union[SafetensorsPart, _Mapping]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., update_id: _Optional[str] = ..., streams: _Optional[int] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "num_tensors", "num_draft_tensors", "stage_seconds", "pause_seconds", "repeated")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TENSORS_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_tensors: int
    num_draft_tensors: int
    stage_seconds: float
    pause_seconds: float
    repeated: bool
    def __init__(self, policy_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_draft_tensors: _Optional[int] = ..., stage_seconds: _Optional[float] = ..., pause_seconds: _Optional[float] = ..., repeated: _Optional[bool] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "draft")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    draft: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., draft: _Optional[bool] = ...) -> None: ...

class SharedFile(_message.Message):
    __slots__ = ("path", "offset")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaIpcTensor(_message.Message):
    __slots__ = ("device_uuid", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset", "stride")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    stride: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ..., stride: _Optional[_Iterable[int]] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("meta", "file", "cuda")
    META_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    file: SharedFile
    cuda: CudaIpcTensor
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., file: _Optional[_Union[SharedFile, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcTensor, _Mapping]] = ...) -> None: ...

class SharedWeights(_message.Message):
    __slots__ = ("tensors", "update_id")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    update_id: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ..., update_id: _Optional[str] = ...) -> None: ...

class JoinWeightGroupRequest(_message.Message):
    __slots__ = ("group", "init_method", "world_size", "rank", "backend", "timeout_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group: str
    init_method: str
    world_size: int
    rank: int
    backend: str
    timeout_s: float
    def __init__(self, group: _Optional[str] = ..., init_method: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class JoinWeightGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveWeightGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class LeaveWeightGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BroadcastWeights(_message.Message):
    __slots__ = ("group", "tensors", "bucket_bytes", "update_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    bucket_bytes: int
    update_id: str
    def __init__(self, group: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., bucket_bytes: _Optional[int] = ..., update_id: _Optional[str] = ...) -> None: ...

class ReleaseMemoryRequest(_message.Message):
    __slots__ = ("weights", "hold_requests")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HOLD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    weights: bool
    hold_requests: bool
    def __init__(self, weights: _Optional[bool] = ..., hold_requests: _Optional[bool] = ...) -> None: ...

class ResumeMemoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryState(_message.Message):
    __slots__ = ("released", "weights_offloaded", "bytes", "device_free_bytes", "seconds")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    released: bool
    weights_offloaded: bool
    bytes: int
    device_free_bytes: int
    seconds: float
    def __init__(self, released: _Optional[bool] = ..., weights_offloaded: _Optional[bool] = ..., bytes: _Optional[int] = ..., device_free_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
