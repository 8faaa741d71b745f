"""Speculative decoding with a draft model: a second, smaller (or more quantized) model with
the same tokenizer proposes each eligible request's next k tokens, one cheap forward pass per
token over all such requests together, and the target checks them in its own step (the
request's chunk widens by k rows, all of which get logits).

The draft keeps its own paged KV (its own cache and block manager), one sequence per target
request, that shares the request's token list. Before proposing, a sequence catches up on the
tokens it has no KV for, then on the one or two tokens each step emits; after the check its
KV stays valid up to the last kept proposal, the rest is overwritten later. Where the prompt
comes from differs by draft: a draft laid out as the target (its own quantized copy, "self")
starts from a copy of the target's KV of the prompt (on a decode worker, the imported KV: no
draft compute and nothing more on the wire); any other draft computes it (prefix caching
included), in pieces within the step's token budget.

Greedy requests keep a proposal while it equals the target's argmax (output identical to
plain decoding). Sampled requests use rejection sampling (Leviathan et al., 2023): proposal x
drawn from the draft's distribution q is kept with probability min(1, p(x)/q(x)), p being the
target's (both after temperature, top-k, top-p and min-p); the first rejected one is replaced
by a draw from max(0, p - q) renormalized, and when all are kept a bonus token is drawn from
p: every emitted token is distributed as the target's. A sampled request's proposals and
acceptance tests draw from a stream of its own seeded from the request's seed, and each
emitted token takes one draw from the request's stream, as without speculation: a seeded
request gives the same tokens each run (a different sample than without speculation).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.kv.cache import KVCache, bytes_per_block
from pdserve.engine.core.runner import ModelRunner
from pdserve.engine.sampling.sampler import draw, truncate
from pdserve.engine.core.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.engine.sampling.speculative import accepted
from pdserve.engine.model.weights import LoadedModel

SPEC_STREAM_SALT = 0x5EC0DE  # a sampled request's speculation stream: its seed xor this


def probabilities(logits: torch.Tensor, params) -> torch.Tensor:
    """(rows, vocab) probabilities a sampled request draws from (temperature, then truncation)."""
    rows = [truncate(r.float() / params.temperature, params.top_k, params.top_p, params.min_p) for r in logits]
    return torch.softmax(torch.stack(rows), dim=-1)


def pick(probs: torch.Tensor, u: float) -> int:
    """The token at uniform `u` of `probs`' inverse CDF (never one of probability 0)."""
    cdf = probs.double().cumsum(-1)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    if i >= probs.shape[0] or float(probs[i]) <= 0.0:  # rounding at the top end
        i = int(torch.argmax(probs))
    return i


def verify_sampled(proposals: list[int], q: torch.Tensor, p: torch.Tensor,
                   accept_u: list[float]) -> tuple[int, torch.Tensor]:
    """Rejection sampling of `proposals` (drawn from the rows of `q`) against the target's rows
    `p` (one more row than proposals). Returns how many are kept and the distribution the
    token after them is drawn from: the residual max(0, p - q) at the first rejection, else
    the target's next row."""
    for j, x in enumerate(proposals):
        if accept_u[j] * float(q[j, x]) < float(p[j, x]):
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        return j, residual if float(residual.sum()) > 0.0 else p[j]  # p == q up to rounding: p itself
    return len(proposals), p[len(proposals)]


class _Plain:
    prompt_logprobs = None


class _Seq:
    """The draft's view of a target request: its token list, its own KV progress."""

    params = _Plain()
    num_prompt_tokens = 0
    lora = None  # the draft runs its own model, without the target request's adapter

    def __init__(self, req):
        self.req, self.request_id, self.num_computed_tokens = req, req.request_id, 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.req.all_token_ids


class DraftSpeculator:
    """Extends eligible decode chunks with up to `k` tokens proposed by the draft model."""

    kind = "draft"

    def __init__(self, k: int, draft: LoadedModel, target_blocks: BlockManager, target_kv: KVCache,
                 cache_config, device, max_model_len: int, token_budget: int):
        self.k, self.target_blocks, self.target_kv, self.draft = k, target_blocks, target_kv, draft
        num_blocks, fmt = target_kv.num_blocks, target_kv.format
        self.token_budget = token_budget
        self.max_model_len = min(max_model_len, draft.config.max_position_embeddings, num_blocks * cache_config.block_size)
        memory = num_blocks * bytes_per_block(draft.config, cache_config.block_size, fmt)
        self.kv_cache = KVCache(draft.config, replace(cache_config, kv_cache_memory=memory), fmt, device)
        self.blocks = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                   f"{cache_config.cache_namespace}/draft:{draft.fingerprint}")
        self.runner = ModelRunner(draft.model, self.kv_cache, self.blocks)
        # a draft laid out as the target (its own quantized copy) starts from the target's KV of
        # the prompt, copied, instead of computing its own
        self.seed_from_target = self.kv_cache.layout == target_kv.layout
        self.seeded_tokens = 0
        self._seqs: dict[str, _Seq] = {}
        self._q: dict[str, list[torch.Tensor]] = {}
        self._streams: dict[str, torch.Generator] = {}
        self.proposed = self.accepted = 0

    @staticmethod
    def eligible(req) -> bool:
        p = req.params  # penalties, logprobs and constraints would need every position's own state
        # a request under a LoRA adapter: the draft has no adapter, its guesses are the base's
        return (not p.has_penalties and p.logprobs is None and p.prompt_logprobs is None and req.grammar is None
                and req.lora is None)

    def release(self, request_id: str) -> None:
        """The target request is gone: free its draft KV."""
        if self._seqs.pop(request_id, None) is not None:
            self.blocks.free(request_id)
        self._q.pop(request_id, None)
        self._streams.pop(request_id, None)

    def _seq(self, req) -> _Seq:
        seq = self._seqs.get(req.request_id)
        if seq is None:
            seq = self._seqs[req.request_id] = _Seq(req)
            if self.seed_from_target:
                self._seed(seq)
            else:
                prefix = self.blocks.match_prefix(req.all_token_ids[:-1], root=req.cache_root)
                if self.blocks.allocate(req.request_id, prefix.num_tokens, prefix) and prefix.num_tokens:
                    seq.num_computed_tokens = prefix.num_tokens
        return seq

    def _seed(self, seq: _Seq) -> None:
        """Copy the target's KV of the tokens it has computed. (No draft prefix cache then: a
        cached draft block could hold the draft's own KV of those tokens, and a sampled
        request's proposals would depend on what the cache held.)"""
        have = seq.req.num_computed_tokens  # a decoding request: all but its newest token
        if not self.blocks.allocate(seq.request_id, have) or have == 0:
            return
        src = self.target_blocks.block_table(seq.request_id)[:-(-have // self.blocks.block_size)]
        dst = self.blocks.block_table(seq.request_id)[:len(src)]
        self.kv_cache.kv[:, :, torch.tensor(dst)] = self.target_kv.kv[:, :, torch.tensor(src)]
        seq.num_computed_tokens = have
        self.seeded_tokens += have

    def extend(self, sched: SchedulerOutput, held: set[str]) -> dict[str, list[int]]:
        """Propose for eligible requests, append the proposals to their tokens (provisionally:
        `settle` takes back the rejected ones) and widen their chunks; returns id -> proposals."""
        room, draft_room = self.token_budget - sched.num_tokens, self.token_budget
        plan: list[tuple[int, object, _Seq, int]] = []
        catch_up: list[ScheduledChunk] = []
        for i, c in enumerate(sched.chunks):
            req = c.request
            # a prompt's last token (after a prefix hit) samples as without speculation: a seeded
            # request's first token must not depend on what the cache held
            if (room <= 0 or c.num_new_tokens != 1 or not req.output_token_ids or req.request_id in held
                    or not self.eligible(req)):
                continue
            left = min(self.k, req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens, room)
            if left <= 0:
                continue
            seq = self._seq(req)
            lag = req.num_tokens - seq.num_computed_tokens
            if lag > draft_room:  # a long catch-up (an imported prompt): in pieces, no proposal yet
                if draft_room > 0 and self.blocks.allocate(seq.request_id, seq.num_computed_tokens + draft_room):
                    catch_up.append(ScheduledChunk(seq, draft_room, False))
                draft_room = 0
                continue
            if not self.blocks.allocate(seq.request_id, req.num_tokens + left - 1):
                continue
            catch_up.append(ScheduledChunk(seq, lag, True))
            plan.append((i, req, seq, left))
            draft_room -= lag
            room -= left
        if not catch_up:
            return {}
        proposals = self._propose(catch_up, {seq.request_id: left for _, _, seq, left in plan})
        guesses: dict[str, list[int]] = {}
        for i, req, seq, left in plan:
            g = proposals[req.request_id]
            if not self.target_blocks.allocate(req.request_id, req.num_tokens):
                del req.all_token_ids[-len(g):]  # no room for their KV: decode normally
                seq.num_computed_tokens = min(seq.num_computed_tokens, req.num_tokens)
                self._q.pop(req.request_id, None)
                continue
            sched.chunks[i] = ScheduledChunk(req, 1 + len(g), True)
            guesses[req.request_id] = g
        return guesses

    @torch.inference_mode()
    def _propose(self, chunks: list[ScheduledChunk], wanted: dict[str, int]) -> dict[str, list[int]]:
        """Run the draft: the catch-up chunks, then one token per pass until each sequence
        has its `wanted` proposals (appended to its request's tokens as they come)."""
        out: dict[str, list[int]] = {rid: [] for rid in wanted}
        first = True
        while chunks:
            completed, logits = self.runner.execute(chunks)
            for c in chunks:
                c.request.num_computed_tokens += c.num_new_tokens
                if first and not self.seed_from_target:  # verified tokens only (proposals may be taken back)
                    seq = c.request
                    real = seq.req.num_tokens
                    self.blocks.cache_full_blocks(seq.request_id, seq.all_token_ids, real, seq.req.cache_root)
            first = False
            chunks = []
            for c, row in zip(completed, logits):
                seq = c.request
                tok = self._draw(seq.req, row)
                seq.req.all_token_ids.append(tok)
                out[seq.request_id].append(tok)
                if len(out[seq.request_id]) < wanted[seq.request_id]:
                    chunks.append(ScheduledChunk(seq, 1, True))
        return out

    def _draw(self, req, logits: torch.Tensor) -> int:
        p = req.params
        if p.greedy:
            return int(torch.argmax(logits))
        q = probabilities(logits[None], p)[0]
        self._q.setdefault(req.request_id, []).append(q)
        return pick(q, float(torch.rand(1, generator=self._stream(req))))

    def _stream(self, req) -> torch.Generator:
        gen = self._streams.get(req.request_id)
        if gen is None:
            gen = self._streams[req.request_id] = torch.Generator()
            gen.manual_seed(req.generator.initial_seed() ^ SPEC_STREAM_SALT)
        return gen

    def settle(self, req, guesses: list[int], logits: torch.Tensor) -> list[int]:
        """Given the target's logits of the widened chunk's rows, take back the provisional
        tokens and return the tokens to emit: the kept proposals, then one of the target's."""
        real = req.num_tokens - len(guesses)
        if req.params.greedy:
            targets = torch.argmax(logits, dim=-1).tolist()
            j = accepted(guesses, targets)
            last = targets[j]
        else:
            q = torch.stack(self._q.pop(req.request_id))
            accept_u = torch.rand(len(guesses), generator=self._stream(req)).tolist()
            j, dist = verify_sampled(guesses, q, probabilities(logits, req.params), accept_u)
            for _ in range(j):  # one draw of the request's stream per emitted token, as the sampler takes
                draw(req)
            last = pick(dist, float(draw(req)))
        del req.all_token_ids[real:]
        req.num_computed_tokens = real + j  # target KV is valid through the last kept proposal
        seq = self._seqs.get(req.request_id)
        if seq is not None:
            seq.num_computed_tokens = min(seq.num_computed_tokens, real + j)
        self.proposed += len(guesses)
        self.accepted += j
        return guesses[:j] + [last]


def load_draft(config, target: LoadedModel, tokenizer=None) -> LoadedModel:
    """The draft model `config.speculative_model` names, checked against the target: the same
    tokenizer (compared before any weight is read) and the same vocabulary size."""
    from pdserve.common.errors import DraftModelError
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.model.weights import load_model, resolve_model_path

    own = config.speculative_model == "self"
    if own and not target.path.exists():
        raise DraftModelError(f"--speculative-model self: the target ({target.path}) has no file to load a "
                              "quantized copy from; give the draft's path")
    path = target.path if own else resolve_model_path(config.speculative_model)
    if not own and tokenizer is not None:
        theirs = Tokenizer.from_model_path(path)
        if not tokenizer.same_vocabulary(theirs):
            raise DraftModelError(f"the draft model {path} has another tokenizer than the target "
                                  f"({theirs.vocab_size} vs {tokenizer.vocab_size} tokens, or the same count "
                                  "mapped differently): a draft must share the target's tokenizer")
    draft = load_model(path, getattr(torch, config.dtype), config.device, config.max_model_len,
                       config.packed_weights, config.speculative_quantization or ("int8" if own else config.quantization))
    if draft.config.vocab_size != target.config.vocab_size:
        raise DraftModelError(f"the draft model {path} has a vocabulary of {draft.config.vocab_size} tokens, "
                              f"the target {target.config.vocab_size}: they must be equal")
    return draft
