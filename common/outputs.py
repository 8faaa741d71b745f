"""What an engine hands back: per-token logprobs, a request's step output, the engine's stats.
Plain values (no torch), so the router, the wire conversions and the workers share them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_text: str = ""                  # only when the engine has a tokenizer
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first output: prompt tokens 1..
    queue_s: float = 0.0                # on the first output: from add_request to its first scheduling
    error: str = ""                     # finish_reason "error": why (a budget it passed)


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of one engine's blocks, queues and counters (taken on its thread)."""
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    kv_usage: float
    running: int
    waiting: int
    queued_prefill_tokens: int
    """Prompt tokens admitted but not yet computed (waiting requests and running prefills)."""
    prefix_queries: int
    prefix_hits: int
    max_model_len: int
    kv_cache_dtype: str
    speculation: str = ""
    """"draft", "prompt-lookup" or "" (off)."""
    spec_proposed: int = 0
    spec_accepted: int = 0
    preempted_memory: int = 0
    """Running requests preempted for blocks another running request needed."""
    preempted_priority: int = 0
    """Running requests preempted for a waiting request of a higher priority."""
    kv_host_bytes: int = 0
    """KV bytes kept in the host tier now (engine/kv/tiers.py), and below: the disk tier's,
    prompt tokens copied back from each tier, blocks stored into each, disk entries refused."""
    kv_disk_bytes: int = 0
    kv_host_hits: int = 0
    kv_disk_hits: int = 0
    kv_host_stored: int = 0
    kv_disk_stored: int = 0
    kv_disk_refused: int = 0
