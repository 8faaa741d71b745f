"""Turns the logits of the rows that finished a step into next tokens.

Greedy rows (temperature 0) take the argmax in one batched op (on the CPU one C call,
native/argmax.py, torch.argmax's result). Other rows are sampled by
the inverse CDF with one uniform draw each from their request's own `torch.Generator`, so a
seeded request draws the same tokens whether it runs alone or in any batch. On the CPU the
draws of a step run in one C call (native/sampling.c: max, exponentials and the walk to the
drawn token in three passes per row); elsewhere, or without the native build, in torch. Logprobs are those of the model's raw distribution (before temperature and
truncation), as OpenAI reports them.
"""
from __future__ import annotations

import torch

from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import argmax as native_argmax
from pdserve.engine.core.request import Request
from pdserve.common.outputs import TokenLogprobs
from pdserve.engine.sampling.grammar import disallowed_rows


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition penalty over prompt + output (HF semantics: shrink positive logits, grow
    negative ones); presence and frequency penalties over the output and the logit bias
    (OpenAI semantics); below `min_tokens`, EOS and the stop token ids are masked."""
    p = req.params
    dev = logits.device  # CUDA logits on a GPU worker: index and operand tensors go there too

    def ids(tokens) -> torch.Tensor:
        return torch.tensor(list(tokens), dtype=torch.long, device=dev)
    if p.repetition_penalty != 1.0:
        seen = ids(sorted(set(req.all_token_ids)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(ids(req.output_token_ids), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        logits[ids(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=dev)
    if len(req.output_token_ids) < p.min_tokens:
        enders = list(p.stop_token_ids) + ([req.eos_token_id] if req.eos_token_id is not None else [])
        if enders:
            logits[ids(enders)] = float("-inf")
    return logits


def truncate(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus, or below min_p * max prob."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    if p.has_penalties:
        logits = apply_penalties(logits.clone(), req)
    if p.greedy:
        return int(torch.argmax(logits))
    logits = truncate(logits / p.temperature, p.top_k, p.top_p, p.min_p)
    cdf = torch.softmax(logits, dim=-1).cumsum(-1)
    # inverse-CDF sampling: one uniform draw per token from the request's own stream (its
    # seed alone decides its tokens, whatever is batched with it). A race of exponentials
    # drew one number per vocabulary entry: 1.2 ms a row here, a fifth of a 32-stream step.
    u = float(draw(req))
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True))
    if i >= cdf.shape[0] or float(cdf[i]) <= (float(cdf[i - 1]) if i else 0.0):  # rounding at the top end
        i = int(torch.argmax(logits))
    return i


def _truncates(p) -> bool:
    return bool(p.top_k) or p.top_p < 1.0 or p.min_p > 0.0


def _sample_native(logits: torch.Tensor, reqs: list[Request], pending: list[int], tokens: list) -> None:
    """`sample_row` for the rows `pending` of CPU logits, the draws in one C call
    (native.sample_rows): rows without penalties or truncation are read in place at 1/T;
    the others are transformed as `sample_row` does first."""
    direct: list[int] = []
    prepared: list[tuple[int, torch.Tensor]] = []
    for i in pending:
        p, row = reqs[i].params, logits[i]
        if p.has_penalties:
            row = apply_penalties(row.clone(), reqs[i])
        if p.greedy:
            tokens[i] = int(torch.argmax(row))
        elif p.has_penalties or _truncates(p):
            prepared.append((i, truncate(row / p.temperature, p.top_k, p.top_p, p.min_p)))
        else:
            direct.append(i)
    if direct:
        picked = native.sample_rows(logits, direct, [1.0 / reqs[i].params.temperature for i in direct],
                                    [float(draw(reqs[i])) for i in direct])
        for i, t in zip(direct, picked):
            tokens[i] = t
    if prepared:
        rows = torch.stack([r for _, r in prepared])
        picked = native.sample_rows(rows, list(range(len(prepared))), [1.0] * len(prepared),
                                    [float(draw(reqs[i])) for i, _ in prepared])
        for (i, _), t in zip(prepared, picked):
            tokens[i] = t


_native_ok: bool | None = None


def _native_sampling() -> bool:
    """Whether the C sampler loads here (looked up once per process)."""
    global _native_ok
    if _native_ok is None:
        _native_ok = native.available()
    return _native_ok


def draw(req: Request) -> torch.Tensor:
    """The request's next uniform draw in [0, 1): the one random number each sampled token
    takes from its stream (a resumed or remotely started request skips its earlier ones)."""
    return torch.rand(1, generator=req.generator)


def sample(logits: torch.Tensor, reqs: list[Request],
           masks: dict | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: (N, vocab) fp32, one row per request in `reqs`. masks: the constrained
    requests' disallowed rows by request id, computed ahead (else here)."""
    raw = logits = logits.float()
    constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if constrained:  # grammar masks apply to sampling; logprobs stay those of the model
        if masks is not None and all(reqs[i].request_id in masks for i in constrained):
            masked = torch.stack([masks[reqs[i].request_id] for i in constrained])
        else:
            masked = disallowed_rows([reqs[i].grammar for i in constrained])
        # an empty mask (a broken grammar state) would make a whole row -inf: leave it be
        masked &= ~masked.all(dim=1, keepdim=True)
        if len(constrained) < len(reqs):  # one in-place fill over the batch beats gather + scatter
            full = torch.zeros(logits.shape, dtype=torch.bool)
            full[torch.tensor(constrained)] = masked
            masked = full
        if any(r.params.logprobs is not None for r in reqs):
            logits = logits.clone()  # `raw` keeps the model's distribution for the logprobs
        with torch.inference_mode():  # the runner's logits are inference tensors
            logits.masked_fill_(masked, float("-inf"))
    tokens: list[int | None] = [None] * len(reqs)
    simple = [i for i, r in enumerate(reqs) if r.params.greedy and not r.params.has_penalties]
    if simple:
        if logits.is_cpu and logits.stride(-1) == 1 and _native_sampling():
            picked = native_argmax.rows(logits, simple)  # in place, no copy of the rows
        else:
            rows = logits if len(simple) == len(reqs) else logits[simple]  # skip a (N, vocab) copy
            picked = torch.argmax(rows, dim=-1).tolist()
        for i, t in zip(simple, picked):
            tokens[i] = t
    pending = [i for i in range(len(reqs)) if tokens[i] is None]
    if pending and logits.is_cpu and _native_sampling():
        _sample_native(logits, reqs, pending, tokens)
    else:
        for i in pending:
            tokens[i] = sample_row(logits[i], reqs[i])
    logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        for row, i in enumerate(want):
            n = reqs[i].params.logprobs
            top = torch.topk(lp[row], n) if n else None
            logprobs[i] = TokenLogprobs(
                tokens[i], float(lp[row, tokens[i]]),
                list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
    return tokens, logprobs  # type: ignore[return-value]
