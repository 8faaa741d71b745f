"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from pdserve.common.errors import InvalidRequestError
from pdserve.common.structured import Structured
from pdserve.common.tokens import check_token_ids

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # tokens per request, as OpenAI allows
MAX_CACHE_SALT = 1024  # characters
MAX_TENANT = 256  # characters
MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy."""


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# the smallest repetition penalty, as the wire's float32 carries it: 0.01 arrives at a worker
# as 0.0099999998, and must pass there as it did at the router
MIN_REPETITION_PENALTY = _float32(0.01)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 is greedy."""

    max_tokens: int | None = 16
    """New tokens at most; None: up to the context length."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0: off
    min_p: float = 0.0      # 0: off
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    """No EOS, stop token id or stop string ends the output before this many tokens."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids before sampling (OpenAI: -100 bans, +100 forces)."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """Also return each prompt token's logprob (and this many top alternatives); such a
    prompt is always computed in full (no prefix-cache reuse: cached tokens have no logits)."""
    structured: Structured | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar."""
    cache_salt: str = ""
    """Not about sampling, but travels with it to every worker: prompts share prefix-cache
    blocks only with prompts of the same salt (one per tenant; "" is the shared default)."""
    priority: int = 0
    """Travels with it too: lower is served sooner in every worker's queue, and a waiting
    request preempts running ones of a higher value when the batch or the KV is full (vLLM's
    `priority` field)."""
    tenant: str = ""
    """Who the request is for: requests of one priority share the batch among tenants, the
    least-served tenant's first (the router sets it from the API key or a header)."""

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        def bad(param, msg):
            raise InvalidRequestError(f"{param} {msg}", param=param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens < 2**31):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            bad("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:  # tiny penalties overflow the logits
            bad("repetition_penalty", f"must be in [0.01, 10], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens < 2**31:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"allows at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):  # NaN fails too
            bad("logit_bias", "values must be in [-100, 100]")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            bad("cache_salt", f"must be a string of at most {MAX_CACHE_SALT} characters")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or not -2**31 <= self.priority < 2**31:
            bad("priority", f"must be an integer in [-2**31, 2**31), got {self.priority!r}")
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT:
            bad("tenant", f"must be a string of at most {MAX_TENANT} characters")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "entries must be non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.structured is not None:
            self.structured.validate()
        limit = vocab_size if vocab_size is not None else 2**31
        check_token_ids(self.stop_token_ids, limit, "stop_token_ids")
        check_token_ids(self.logit_bias, limit, "logit_bias")

    @property
    def greedy(self) -> bool:
        # below 1e-5 dividing the logits by the temperature overflows float32 (inf, then NaN
        # probabilities); such a temperature means "greedy" anyway
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Logits are adjusted per request before sampling (penalties, logit bias)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias) or self.min_tokens > 0)
