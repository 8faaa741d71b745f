"""OpenAI request models and their validation; each request's `sampling_params` is the one
place an API request becomes the engine's `SamplingParams`.

Unknown fields are refused by name (a silently ignored parameter is a wrong answer served
as success), and every field is validated strictly to its declared type: no bool as a number,
no number or object as text, no string as a number (pydantic's strict mode). Out-of-range
values are refused by the engine's own `SamplingParams.validate` so that the router and the
workers agree on what is valid.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import Structured

from .errors import APIError
from .tools import check_tools, forced_tool, structured_from_response_format

MAX_N = 16
MAX_CHOICES = 64  # prompts x n in one completions request (each is a generation in flight)
"""Choices per request at most."""


def _valid_unicode(value: Any) -> Any:
    """Refuse text that is not valid Unicode: JSON's `\\ud800` escape carries a lone UTF-16
    surrogate, which the tokenizer cannot encode (found by fuzzing: it raised a TypeError, a 500)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError("contains a lone surrogate (\\ud800-\\udfff): not valid Unicode text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _valid_unicode(k)
            _valid_unicode(v)
    elif isinstance(value, list):
        for v in value:
            _valid_unicode(v)
    return value


STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    include_timing: bool = False  # pdserve's: where each choice's time went, in the last chunk


class _Common(BaseModel):
    model_config = STRICT
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extensions that vLLM and SGLang also accept
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None  # prefix-cache isolation per tenant (as in vLLM)
    priority: int = 0  # lower is served sooner (vLLM's); the x-pdserve-priority header wins over it
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (+ regex, choice, grammar)

    _unicode_only = field_validator("*")(_valid_unicode)

    def check_supported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if not -2**31 <= self.priority < 2**31:
            raise APIError(400, f"priority must be an integer in [-2**31, 2**31), got {self.priority}", param="priority")
        if self.cache_salt is not None and not self.cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string (omit it to share the cache)", param="cache_salt")

    def token_bias(self) -> dict[int, float]:
        """`logit_bias` with its keys (token ids, as JSON object keys: strings) as ints."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                out[int(key)] = float(value)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids (integers), got {key!r}",
                               param="logit_bias") from None
        return out

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def include_timing(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_timing)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int | None,
                         structured: Structured | None, prompt_logprobs: int | None = None) -> SamplingParams:
        p = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                           min_p=self.min_p, seed=self.seed, repetition_penalty=self.repetition_penalty,
                           presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                           stop=self.stop_list(), stop_token_ids=list(self.stop_token_ids),
                           ignore_eos=self.ignore_eos, logprobs=logprobs, logit_bias=self.token_bias(),
                           cache_salt=self.cache_salt or "", min_tokens=self.min_tokens, structured=structured,
                           prompt_logprobs=prompt_logprobs)
        try:
            p.validate(vocab_size)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from e
        return p


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # a list of strings or of token lists: a batch
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of is not supported (other than best_of == n)", param="best_of")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise APIError(400, f"a request may ask for at most {MAX_CHOICES} choices (prompts x n), got "
                                f"{len(self.prompts())} x {self.n}", param="prompt")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise APIError(400, f"logprobs must be in [0, 5], got {self.logprobs}", param="logprobs")


    def sampling_params(self, vocab_size: int | None = None) -> SamplingParams:
        """What the workers run for each prompt of this request (stop strings stay here)."""
        echo_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, vocab_size,
                                     structured_from_response_format(self.response_format), echo_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids (one prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


def _text_parts(content: Any) -> Any:
    """A message's content parts must be text parts, each `{"type": "text", "text": <string>}`:
    a null, a number, an object or a list as `text` would reach the model as Python's repr."""
    if not isinstance(content, list):
        return content
    for k, part in enumerate(content):
        if part.get("type") != "text":
            raise ValueError(f"content part {k}: type {part.get('type')!r} is not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f'content part {k} must be {{"type": "text", "text": <string>}}, its text is '
                             f"{json_type(part['text']) if 'text' in part else 'missing'}")
    return content


def json_type(value: Any) -> str:
    """JSON's name for a value's type (what the client sent), for error messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # tool_calls, tool_call_id, name: to the template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    _unicode_only = field_validator("content")(_valid_unicode)
    _text_only = field_validator("content")(_text_parts)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # either way: a reply holds at most one call
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")

    def tool_specs(self) -> dict[str, dict]:
        """The tools by name, checked (and `tool_choice` against them)."""
        return check_tools(self.tools, self.tool_choice)

    def sampling_params(self, vocab_size: int | None = None) -> SamplingParams:
        """What the workers run for this conversation: a required tool call is a constraint
        on the output, as is `response_format` (not both)."""
        forced = forced_tool(self.tools, self.tool_choice, self.tool_specs())
        if forced is not None and self.response_format and self.response_format.get("type") != "text":
            raise APIError(400, "response_format cannot be combined with a required tool call (tool_choice)",
                           param="response_format")
        structured = forced or structured_from_response_format(self.response_format)
        try:
            return self._sampling_params(self.max_new_tokens(), self.wanted_logprobs(), vocab_size, structured)
        except APIError as e:  # name the field the client sent, not the engine's
            if e.param == "max_tokens" and self.max_completion_tokens is not None:
                e.param = "max_completion_tokens"
                e.message = e.message.replace("max_tokens", "max_completion_tokens", 1)
            raise

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """`/tokenize` (as vLLM): `prompt`, or `messages` with the chat request's template options."""
    model_config = STRICT
    model: str | None = None  # optional, as in vLLM; checked when given
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True

    _unicode_only = field_validator("prompt")(_valid_unicode)

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if self.messages is not None:
            if not self.messages:  # as the chat endpoint refuses it
                raise APIError(400, "messages must contain at least one message", param="messages")
            check_tools(self.tools, self.tool_choice)


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]
