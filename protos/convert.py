"""Conversions between the protobuf messages and the engine's Python types (both ways, so
that every process agrees on one mapping)."""
from __future__ import annotations

import hmac

import grpc

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import Structured

from . import worker_pb2 as pb


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty, stop_token_ids=p.stop_token_ids,
                            ignore_eos=p.ignore_eos, logit_bias=p.logit_bias, cache_salt=p.cache_salt,
                            min_tokens=p.min_tokens)
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        msg.structured_kind, msg.structured_spec = p.structured.kind, p.structured.spec
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Stop strings never travel to workers: the router applies them on text."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None, temperature=msg.temperature,
        top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None, repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos, logit_bias=dict(msg.logit_bias),
        cache_salt=msg.cache_salt, min_tokens=msg.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        structured=Structured(msg.structured_kind, msg.structured_spec) if msg.structured_kind else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                           top_logprobs=[v for _, v in lp.top])


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, list(zip(msg.top_ids, msg.top_logprobs)))


def output_to_proto(out: RequestOutput, prefilled_remotely: bool = False) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        token_ids=out.new_token_ids, logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
        finished=out.finished, finish_reason=out.finish_reason or "",
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        prefilled_remotely=prefilled_remotely,
        prompt_logprobs=[logprob_to_proto(lp) for lp in out.prompt_logprobs or ()])


def worker_stats(engine: LLMEngine, worker_id: str, role: str, **counters) -> pb.WorkerStats:
    """Run on the engine thread: a consistent snapshot of blocks, queues and counters."""
    sched, blocks = engine.scheduler, engine.blocks
    queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting) + \
        sum(r.num_tokens - r.num_computed_tokens for r in sched.running if r.num_computed_tokens < r.num_tokens - 1)
    return pb.WorkerStats(worker_id=worker_id, role=role, num_blocks=blocks.num_blocks,
                          free_blocks=blocks.num_free_blocks, running=len(sched.running), waiting=len(sched.waiting),
                          queued_prefill_tokens=queued, kv_usage=blocks.usage, prefix_queries=blocks.prefix_queries,
                          prefix_hits=blocks.prefix_hits, **counters)


def block_snapshot(engine: LLMEngine) -> pb.BlockSnapshot:
    """Run on the engine thread, so the hashes and the event number agree."""
    hashes, seq = engine.blocks.snapshot()
    return pb.BlockSnapshot(block_hashes=hashes, seq=seq)


async def check_cluster_token(expected: str, given: str, context) -> None:
    """Abort the RPC unless `given` is the cluster token (constant-time compare)."""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")


REFUSED_BY = "pdserve-refused-by"
INVALID_PARAM, INVALID_CODE = "pdserve-param", "pdserve-code"
"""Trailing-metadata key naming the worker that refused a request because its queue is full."""


async def refuse_when_full(context, worker_id: str, what: str, limit: int = 0, state: str = "") -> None:
    """Abort the RPC with RESOURCE_EXHAUSTED, naming the refusing worker so the router can
    try another one of its pool (or answer 429 when the whole pool is full). `state`: why,
    if not the queue limit (e.g. "draining")."""
    why = state or "at its queue limit" + (f" ({limit} requests)" if limit else "")
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what} {worker_id} is {why}",
                        trailing_metadata=((REFUSED_BY, worker_id),))


async def refuse_invalid(context, e: InvalidRequestError) -> None:
    """Abort the RPC with INVALID_ARGUMENT, carrying the error's field and code, so the
    router's 400 names them as if it had found the error itself."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                        trailing_metadata=((INVALID_PARAM, e.param or ""), (INVALID_CODE, e.code or "")))


def invalid_details(e: grpc.aio.AioRpcError) -> tuple[str | None, str | None]:
    """(param, code) sent by `refuse_invalid`; None where absent."""
    meta = dict(e.trailing_metadata() or ())
    return meta.get(INVALID_PARAM) or None, meta.get(INVALID_CODE) or None


def refused_by(e: grpc.aio.AioRpcError) -> str:
    """The worker named by `refuse_when_full`, or "" if the error does not name one."""
    for key, value in e.trailing_metadata() or ():
        if key == REFUSED_BY:
            return value
    return ""
