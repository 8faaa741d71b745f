"""Conversions between the engine's types and the wire's messages, each in one function per
direction, so that every process agrees on one mapping: sampling parameters, token
logprobs, request outputs, and a worker's stats and cached blocks."""
from __future__ import annotations

import dataclasses

from pdserve.common.outputs import EngineStats, RequestOutput, TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import Structured

from . import worker_pb2 as pb


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    """The parameters a worker needs. Stop strings stay behind: the router applies them on
    the text it detokenizes; workers see token-level stops only."""
    msg = pb.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty, stop_token_ids=p.stop_token_ids,
                            ignore_eos=p.ignore_eos, logit_bias=p.logit_bias, cache_salt=p.cache_salt,
                            min_tokens=p.min_tokens, priority=p.priority, tenant=p.tenant)
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
        cache_salt=msg.cache_salt, min_tokens=msg.min_tokens, priority=msg.priority, tenant=msg.tenant,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        structured=Structured(msg.structured_kind, msg.structured_spec) if msg.structured_kind else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                           top_logprobs=[v for _, v in lp.top])


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, list(zip(msg.top_ids, msg.top_logprobs)))


def output_to_proto(out: RequestOutput, prefilled_remotely: bool = False, kv_bytes: int = 0,
                    timing: pb.HandoffTiming | None = None) -> pb.GenerateResponse:
    return pb.GenerateResponse(kv_bytes=kv_bytes, timing=timing,
        token_ids=out.new_token_ids, logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
        finished=out.finished, finish_reason=out.finish_reason or "",
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        prefilled_remotely=prefilled_remotely,
        prompt_logprobs=[logprob_to_proto(lp) for lp in out.prompt_logprobs or ()])


def worker_stats(stats: EngineStats, worker_id: str, role: str, **counters) -> pb.WorkerStats:
    """The wire's stats: the engine's snapshot (less what the wire does not carry) and the worker's counters."""
    fields = dataclasses.asdict(stats)
    del fields["cached_blocks"]
    return pb.WorkerStats(worker_id=worker_id, role=role, **fields, **counters)


def block_snapshot(hashes: list[int], seq: int) -> pb.BlockSnapshot:
    """The cached blocks' hashes and the KV-event number they agree with."""
    return pb.BlockSnapshot(block_hashes=hashes, seq=seq)
