"""A request inside the engine: its tokens, one progress counter, and an explicit stage."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.common.block_hash import root_hash
from pdserve.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"                              # queued, no blocks
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, KV arriving from a prefill worker
    PREFILLING = "prefilling"                        # running, prompt not fully computed
    DECODING = "decoding"                            # running, one token per step
    PREEMPTED = "preempted"                          # blocks taken back; will recompute
    FINISHED_STOPPED = "finished_stopped"            # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"              # max_tokens or context length
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"                # a budget passed (RequestOutput.error says which)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when its first chunk was scheduled (queue time = this - arrival)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output; `num_computed_tokens` counts how many of these have KV in the cache
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet looked up)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    stop_reason: int | str | None = None
    grammar: object | None = None  # structured.GrammarState of a constrained request
    # logprobs of prompt tokens 1.. (token 0 has none), filled as the prompt is computed
    prompt_logprobs: list | None = None
    # the LoRA adapter it runs under (engine/model/lora.LoRAAdapter, held from admission to
    # finish: engine/core/lora_registry.py); None: the base model
    lora: object | None = None

    def __post_init__(self):
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        # its blocks' hash chain starts here: under its salt and its adapter
        self.cache_root = root_hash(self.params.cache_salt, self.lora.identity if self.lora is not None else "")

    @property
    def priority(self) -> int:
        """Lower is served sooner (the request's `priority`, vLLM's convention)."""
        return self.params.priority

    @property
    def tenant(self) -> str:
        return self.params.tenant

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
