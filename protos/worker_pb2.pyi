from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids", "ignore_eos", "logprobs", "structured_kind", "structured_spec", "prompt_logprobs", "logit_bias", "cache_salt", "min_tokens", "priority", "tenant")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_SPEC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured_kind: str
    structured_spec: str
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    cache_salt: str
    min_tokens: int
    priority: int
    tenant: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_kind: _Optional[str] = ..., structured_spec: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., cache_salt: _Optional[str] = ..., min_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "prefill_address", "prefill_worker_id", "cluster_token", "resume_token_ids", "local_prefill_tokens", "peer_address", "peer_worker_id", "peer_blocks", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    prefill_address: str
    prefill_worker_id: str
    cluster_token: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    local_prefill_tokens: int
    peer_address: str
    peer_worker_id: str
    peer_blocks: int
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., cluster_token: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., local_prefill_tokens: _Optional[int] = ..., peer_address: _Optional[str] = ..., peer_worker_id: _Optional[str] = ..., peer_blocks: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "stop_reason", "num_prompt_tokens", "num_cached_tokens", "prefilled_remotely", "prompt_logprobs", "kv_bytes", "timing")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_REMOTELY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finished: bool
    finish_reason: str
    stop_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    prefilled_remotely: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    kv_bytes: int
    timing: HandoffTiming
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prefilled_remotely: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., kv_bytes: _Optional[int] = ..., timing: _Optional[_Union[HandoffTiming, _Mapping]] = ...) -> None: ...

class HandoffTiming(_message.Message):
    __slots__ = ("blocks_wait_s", "prefill_queue_s", "prefill_compute_s", "kv_push_s")
    BLOCKS_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_S_FIELD_NUMBER: _ClassVar[int]
    blocks_wait_s: float
    prefill_queue_s: float
    prefill_compute_s: float
    kv_push_s: float
    def __init__(self, blocks_wait_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_compute_s: _Optional[float] = ..., kv_push_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "cluster_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cluster_token: str
    def __init__(self, request_id: _Optional[str] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("nonce", "proof", "worker_id", "role", "address")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    proof: bytes
    worker_id: str
    role: str
    address: str
    def __init__(self, nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_blocks", "free_blocks", "running", "waiting", "queued_prefill_tokens", "kv_usage", "prefix_queries", "prefix_hits", "remote_prefills", "local_prefills", "transfer_failures", "refused", "queue_limit", "kv_bytes", "kv_seconds", "max_model_len", "proof", "kv_cache_dtype", "speculation", "spec_proposed", "spec_accepted", "preempted_memory", "preempted_priority", "address", "kv_host_bytes", "kv_disk_bytes", "kv_host_hits", "kv_disk_hits", "kv_host_stored", "kv_disk_stored", "kv_disk_refused", "peer_pulls", "peer_blocks_pulled", "peer_bytes_pulled", "peer_pull_failures", "peer_pull_skipped", "peer_blocks_served", "peer_bytes_served", "peer_pull_misses", "loras", "max_loras", "metrics_port")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PEER_PULLS_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    PEER_BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    PEER_BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_MISSES_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_blocks: int
    free_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    remote_prefills: int
    local_prefills: int
    transfer_failures: int
    refused: int
    queue_limit: int
    kv_bytes: int
    kv_seconds: float
    max_model_len: int
    proof: bytes
    kv_cache_dtype: str
    speculation: str
    spec_proposed: int
    spec_accepted: int
    preempted_memory: int
    preempted_priority: int
    address: str
    kv_host_bytes: int
    kv_disk_bytes: int
    kv_host_hits: int
    kv_disk_hits: int
    kv_host_stored: int
    kv_disk_stored: int
    kv_disk_refused: int
    peer_pulls: int
    peer_blocks_pulled: int
    peer_bytes_pulled: int
    peer_pull_failures: int
    peer_pull_skipped: int
    peer_blocks_served: int
    peer_bytes_served: int
    peer_pull_misses: int
    loras: _containers.RepeatedCompositeFieldContainer[LoRAAdapterInfo]
    max_loras: int
    metrics_port: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., remote_prefills: _Optional[int] = ..., local_prefills: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., refused: _Optional[int] = ..., queue_limit: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_seconds: _Optional[float] = ..., max_model_len: _Optional[int] = ..., proof: _Optional[bytes] = ..., kv_cache_dtype: _Optional[str] = ..., speculation: _Optional[str] = ..., spec_proposed: _Optional[int] = ..., spec_accepted: _Optional[int] = ..., preempted_memory: _Optional[int] = ..., preempted_priority: _Optional[int] = ..., address: _Optional[str] = ..., kv_host_bytes: _Optional[int] = ..., kv_disk_bytes: _Optional[int] = ..., kv_host_hits: _Optional[int] = ..., kv_disk_hits: _Optional[int] = ..., kv_host_stored: _Optional[int] = ..., kv_disk_stored: _Optional[int] = ..., kv_disk_refused: _Optional[int] = ..., peer_pulls: _Optional[int] = ..., peer_blocks_pulled: _Optional[int] = ..., peer_bytes_pulled: _Optional[int] = ..., peer_pull_failures: _Optional[int] = ..., peer_pull_skipped: _Optional[int] = ..., peer_blocks_served: _Optional[int] = ..., peer_bytes_served: _Optional[int] = ..., peer_pull_misses: _Optional[int] = ..., loras: _Optional[_Iterable[_Union[LoRAAdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., metrics_port: _Optional[int] = ...) -> None: ...

class LoRAAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "identity", "resident", "users")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    identity: str
    resident: bool
    users: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., identity: _Optional[str] = ..., resident: _Optional[bool] = ..., users: _Optional[int] = ...) -> None: ...

class LoRARequest(_message.Message):
    __slots__ = ("cluster_token", "lora_name", "lora_path")
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    cluster_token: str
    lora_name: str
    lora_path: str
    def __init__(self, cluster_token: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoRAReply(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoRAAdapterInfo
    def __init__(self, adapter: _Optional[_Union[LoRAAdapterInfo, _Mapping]] = ...) -> None: ...

class BlockSnapshot(_message.Message):
    __slots__ = ("block_hashes", "seq", "proof", "worker_id", "role", "address")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    proof: bytes
    worker_id: str
    role: str
    address: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., proof: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_address", "dest_block_ids", "timeout_s", "cluster_token", "skip_tokens", "peer_address", "peer_blocks", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    kv_address: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    cluster_token: str
    skip_tokens: int
    peer_address: str
    peer_blocks: int
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_address: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ..., cluster_token: _Optional[str] = ..., skip_tokens: _Optional[int] = ..., peer_address: _Optional[str] = ..., peer_blocks: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "logprob", "num_cached_tokens", "finished", "finish_reason", "timing", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: TokenLogprob
    num_cached_tokens: int
    finished: bool
    finish_reason: str
    timing: HandoffTiming
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., timing: _Optional[_Union[HandoffTiming, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
