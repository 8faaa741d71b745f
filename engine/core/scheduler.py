"""Continuous-batching scheduler with chunked prefill, prefix reuse and preemption.

Each step has a token budget. Running requests go first (a decoding request needs one
token, a partly prefilled one its next chunk); then waiting requests are admitted in the
waiting queue's order (priority, then the least-served tenant, then arrival: waiting.py)
while budget, sequence slots and blocks last. A request's progress is one
counter, `num_computed_tokens`, catching up with `num_tokens` (prompt + generated): the
scheduler never distinguishes "prefill" from "decode" beyond how many tokens that takes.

When a running request needs a block and none is free, the least urgent running request
(the highest priority value, the latest to arrive among those) is preempted: its blocks
are freed and it goes back to the front of the queue with its progress reset (recompute; its
prefix blocks usually come straight back from the cache). A waiting request that cannot get a
seat or blocks preempts running requests of a lower priority the same way (vLLM's priority
policy never does: a high-priority request would wait for the batch to drain). A step that
stopped at a layer's end for a more urgent arrival is undone (`undo`): it counts for nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.core.block_manager import BlockManager, PrefixMatch
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.step_cost import StepCost, StepTimes
from pdserve.engine.core.urgency import Allowance, UrgencyWindow
from pdserve.engine.core.waiting import WaitingQueue


SMALL_STEP = 64  # tokens: the steps an urgent decode shares, whose cost the budget is sized by


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    completes: bool = False
    """After this chunk every token has KV, so the step samples the next token (fixed when
    scheduled: the request's progress counter moves once the step has run)."""

    @classmethod
    def of(cls, req: Request, n: int) -> "ScheduledChunk":
        return cls(req, n, req.num_computed_tokens + n == req.num_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    contended: bool = False
    """A more urgent request runs in this step while less urgent ones are here."""
    window: bool = False
    """A window step: only less urgent work, within the urgent window (`window_step_s`)."""
    context_tokens: int = 0
    """Keys the step's attention reads: each chunk's tokens up to its end (set by `schedule`)."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        blocks.admit_tokens = config.max_num_batched_tokens  # copy a prefix back for one chunk's start
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.requests: dict[str, Request] = {}
        self.in_flight: set[str] = set()  # in a pipeline's micro-batch: neither scheduled nor preempted
        self.stopped_steps = 0  # steps stopped at a layer's end for a more urgent arrival (`undo`)
        self.urgency = UrgencyWindow(config.urgent_window_s)
        self._allow = Allowance()  # this step's room for less urgent work
        self.cost = StepCost()
        self.times = StepTimes()
        """Every step's seconds, contended steps apart (each worker's /metrics)."""
        self.computed = {"prompt": 0, "decode": 0}
        """Tokens the steps have computed: chunks of more than one token (prompts) and single
        ones (decodes), as they run (each worker's /metrics)."""
        self.preemptions = {"memory": 0, "priority": 0, "stopped": 0}
        """Running requests preempted: for blocks a running request needed, or for a waiting
        request of a higher priority."""

    # ---- queue management -------------------------------------------------------------
    def _arrive(self, req: Request) -> None:
        tenants = {r.tenant for r in self.requests.values()}
        if req.tenant not in tenants:
            self.waiting.arrive(req.tenant, tenants)
            self.waiting.forget_idle(tenants)
        self.requests[req.request_id] = req

    def add(self, req: Request) -> None:
        self._arrive(req)
        self.waiting.append(req)

    def add_remote(self, req: Request) -> bool:
        """Admit `req` with blocks for its whole prompt, to be filled by a KV import. Returns
        False (nothing allocated) if the blocks are not free now, if the batch has no seat left
        (max_num_seqs, counting the requests whose KV is on its way), or if it would take the
        blocks or the seat of a request that waits here, as urgent and here first (preempted
        ones too: a stream of new arrivals must not starve them). Cached blocks of the prompt's
        prefix are shared (by reference count), not imported again: `num_cached_tokens` says
        how many tokens they hold."""
        # not counted in the hit rate: the prompt is computed (and counted) where it is
        # prefilled; what this finds is KV that is not sent again
        prefix = self.blocks.match_prefix(req.all_token_ids, count=False, root=req.cache_root, whole=True)
        if not self._leaves_room_for_waiting(req, prefix):
            return False
        # a seat in the batch is kept for it from now: it joins when its KV lands
        if not self._room_for(req, req.num_prompt_tokens, prefix, preempt=True):
            return False
        self.blocks.allocate(req.request_id, req.num_prompt_tokens, prefix)
        req.num_cached_tokens = prefix.num_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._arrive(req)
        self.remote[req.request_id] = req
        return True

    def _leaves_room_for_waiting(self, req: Request, prefix: PrefixMatch) -> bool:
        """Whether admitting `req` now leaves a seat and blocks for every waiting request as
        urgent as it (each counted at its whole length, cached prefix or not). A prompt that
        merely waits for its turn in the token budget then does not hold up the KV hand-offs
        behind it, as long as they do not take what it will need."""
        ahead = [r for r in self.waiting if r.priority <= req.priority]
        if not ahead:
            return True
        if self.seats_taken() + len(ahead) + 1 > self.config.max_num_seqs:
            return False
        need = sum(self.blocks.blocks_needed(r.request_id, r.num_tokens) for r in ahead)
        return need + self.blocks.blocks_needed(req.request_id, req.num_prompt_tokens, prefix) \
            <= self.blocks.num_free_blocks

    def _room_for(self, req: Request, num_tokens: int, prefix: PrefixMatch, preempt: bool,
                  out: SchedulerOutput | None = None) -> bool:
        """Whether `req` gets a seat and blocks for `num_tokens` now; with `preempt`, running
        requests of a lower priority are preempted until it does (or none is left)."""
        while True:
            if (self.seats_taken() < self.config.max_num_seqs
                    and self.blocks.blocks_needed(req.request_id, num_tokens, prefix) <= self.blocks.num_free_blocks):
                return True
            victim = self._victim(len(self.running), below=req.priority) if preempt else None
            if victim is None:
                return False
            self.running.remove(victim)
            self._preempt(victim, "priority")
            if out is not None:
                out.preempted.append(victim)

    def _victim(self, end: int, start: int = 0, below: int | None = None) -> Request | None:
        """The running request (of running[start:end]) to preempt: the least urgent, the latest
        to arrive among those (its place in `running` moves as requests take turns, so a row
        that just decoded is not picked for it; the newest has the least to compute again);
        `below`: only one less urgent than that priority."""
        best = None
        for r in self.running[start:end]:
            if r.request_id not in self.in_flight and (best is None or (r.priority, r.arrival_time) >= (
                    best.priority, best.arrival_time)):
                best = r
        if best is None or (below is not None and best.priority <= below):
            return None
        return best

    def most_urgent(self) -> int | None:
        """The most urgent priority among the requests that need this engine's compute (running
        and waiting; not those whose KV is on its way); None: none."""
        head = self.waiting.head()
        return min([r.priority for r in self.running] + ([head.priority] if head is not None else []),
                   default=None)

    def seats_taken(self) -> int:
        """Places in the batch (max_num_seqs) held: running requests and those whose KV is on
        its way."""
        return len(self.running) + len(self.remote)

    def remote_kv_ready(self, req: Request) -> None:
        """The prompt's KV has landed: the request joins the batch and, once the first token
        sampled by the prefill side is appended, decodes from its next step."""
        del self.remote[req.request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        self.blocks.cache_full_blocks(req.request_id, req.all_token_ids, req.num_prompt_tokens, req.cache_root)
        req.status = RequestStatus.DECODING
        self.running.append(req)

    def finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Move `req` to a finished state and free its blocks at once (unless the caller
        keeps them for a KV export and frees them later)."""
        assert status.finished
        if req.request_id not in self.requests:
            return
        if req in self.running:
            self.running.remove(req)
        elif req.request_id in self.remote:
            del self.remote[req.request_id]
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        del self.requests[req.request_id]
        req.status = status
        if free_blocks:
            self.blocks.free(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step ---------------------------------------------------------------------
    def _chunk_size(self, remaining: int, budget: int, req: Request | None = None) -> int:
        """The tokens of `req`'s next chunk this step: 0 for a prompt chunk while a more urgent
        request is here (its steps stay its own plus a few decodes); in a window step (one was
        here or at a peer within `urgent_window_s`) what the step's allowance leaves."""
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        if req is None or n <= 1:
            return n
        if req.priority > self.urgency.now:
            return 0
        if self._allow.window and req.priority > self._allow.above:
            return self._window_chunk(n, req.num_tokens - remaining)
        return n

    def _window_chunk(self, n: int, start: int) -> int:
        """A less urgent prompt chunk of at most `n` tokens from position `start`, in a window
        step: within the step's `yield_chunk` tokens and, past its first row or chunk, the
        seconds it has left; 0 when none fit."""
        allow = self._allow
        n = min(n, allow.tokens)
        if n > 0 and allow.taken and allow.seconds is not None:
            n = min(n, self.cost.chunk_tokens(allow.seconds, start))
        if n <= 0 or not allow.fits(self.cost.chunk_seconds(n, start)):
            return 0
        allow.tokens -= n
        return n

    def observe_step(self, seconds: float, out: SchedulerOutput) -> None:
        """A step has run: its time teaches the cost model (steps of decodes and short chunks,
        the size of the steps the budget sizes) and goes into the histogram."""
        if out.num_tokens <= SMALL_STEP:
            self.cost.observe(seconds, out.num_tokens, out.context_tokens, len(out.chunks) == out.num_tokens)
        for c in out.chunks:
            self.computed["prompt" if c.num_new_tokens > 1 else "decode"] += c.num_new_tokens
        self.times.add(seconds, out.contended, out.window)

    def can_stop(self, out: SchedulerOutput) -> bool:
        """Whether the step `out` may stop at a layer's end and count for nothing (`undo`):
        whoever else holds a block it writes (a prefix matched in this schedule) is running."""
        return all(self.requests.get(rid) in self.running and rid not in self.in_flight for rid in self._sharers(out))

    def undo(self, out: SchedulerOutput) -> None:
        """The step `out` stopped at a layer's end (`can_stop`): it counts for nothing. Its requests
        keep their places and the tokens computed before it; one that took a block it wrote as
        a computed prefix is preempted; the blocks it registered leave the prefix cache."""
        sharers = self._sharers(out)
        for c in out.chunks:
            self.blocks.uncache_from(c.request.request_id, c.request.num_computed_tokens)
            self.waiting.charge(c.request.tenant, -c.num_new_tokens)
        for req in [self.requests[rid] for rid in sharers]:
            self.running.remove(req)
            self._preempt(req, "stopped")
        self.stopped_steps += 1

    def _sharers(self, out: SchedulerOutput) -> set[str]:
        return {rid for c in out.chunks for rid in self.blocks.sharers(c.request.request_id, c.request.num_computed_tokens, c.num_new_tokens)}

    def note_urgency_elsewhere(self, priority: int, until: float | None = None) -> None:
        """A peer on this host steps for requests of `priority` now, or did within its urgent
        window (open `until`, monotonic): while it is more urgent than the work here, this
        worker's steps are window steps (so it stands aside for the peer within a short step
        when its next urgent request comes)."""
        self.urgency.note_elsewhere(priority, until)

    def own_window(self) -> tuple[int, float] | None:
        """The most urgent priority this worker's own requests had within the urgent window,
        and when that window closes (monotonic); None when none was here within it."""
        return self.urgency.own_window()

    def _size_step(self, budget: int) -> bool:
        """This step's room for less urgent work (`_allow`); True if the step is contended (a
        more urgent request runs beside less urgent ones here): then at most `yield_decodes`
        less urgent decodes join it, within the seconds the cost model says they add (none
        beside an urgent prompt). With no such request here but one within the urgent window,
        the step is a window step: at most `window_step_s` long by the cost model, and at most
        `yield_chunk` prompt tokens. Within only a peer's window, its prompt chunks take at most
        `peer_chunk` tokens (the step pauses for the peer at a layer's end)."""
        now, own, peer = self.urgency.now, self.urgency.own_window(), self.urgency.peer()
        urgent = [r for r in self.running if r.priority == now]
        head = self.waiting.head()
        others = any(r.priority > now for r in self.running) or any(
            r.priority > now for r in self.remote.values()) or any(r.priority > now for r in self.waiting)
        if others and (urgent or (head is not None and head.priority == now)):
            own = sum(min(r.num_tokens - r.num_computed_tokens, budget) for r in urgent)
            context = sum(r.num_tokens for r in urgent)
            if head is not None and head.priority == now:
                own += min(head.num_tokens - head.num_computed_tokens, budget)
                context += head.num_tokens
            # an urgent prompt's step is its time to first token: no less urgent row joins it
            prompt = own > len(urgent)
            seconds = 0.0 if prompt else self.cost.allowance(max(own, 1), context, self.config.urgent_step_budget)
            self._allow = Allowance(now, self.config.yield_decodes or budget, seconds)
            return True
        if own is not None and own[0] < now:
            fit = self.cost.fit()
            seconds = None if fit is None or not self.config.window_step_s else max(self.config.window_step_s - fit[0], 0.0)
            self._allow = Allowance(own[0], budget, seconds, self.config.yield_chunk or budget, window=True)
        elif peer is not None and peer < now:
            self._allow = Allowance(peer, budget, None, self.config.peer_chunk or budget, window=True)
        else:
            self._allow = Allowance()
        return False

    def _preempt(self, req: Request, cause: str) -> None:
        self.preemptions[cause] += 1
        self.blocks.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        head = self.waiting.head()
        self.urgency.note([r.priority for r in self.running] + ([head.priority] if head is not None else []))
        out.contended = self._size_step(budget)
        out.window = self._allow.window
        self._make_room_for_priority(out, budget)
        i, short_of_blocks, yielded = 0, False, []
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = 0 if req.request_id in self.in_flight else self._chunk_size(
                req.num_tokens - req.num_computed_tokens, budget, req)
            if n == 0 or self._yields_decode(req, n):
                i += 1
                continue
            scheduled = True
            while not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
                short_of_blocks = True
                victim = self._victim(len(self.running), start=i)  # not one scheduled already
                self.running.remove(victim)
                self._preempt(victim, "memory")
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._commit(out, req, n)
            if self._allow.above is not None and req.priority > self._allow.above:
                yielded.append(req)
            budget -= n
            i += 1
        for req in yielded:  # less urgent ones that ran go last: the others take their turn next step
            if req in self.running:
                self.running.remove(req)
                self.running.append(req)
        if not short_of_blocks:
            self._admit_waiting(out, budget)
        assert out.num_tokens <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        out.context_tokens = sum(c.request.num_computed_tokens + c.num_new_tokens for c in out.chunks)
        return out

    def _yields_decode(self, req: Request, n: int) -> bool:
        """Whether `req`, a less urgent request about to decode (one token), sits this step out:
        the step's allowance (`_size_step`) has no room for its row, whose attention reads its
        whole context (the less urgent ones that ran go last next time, so all take turns)."""
        allow = self._allow
        if allow.above is None or req.priority <= allow.above or n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return False
        return not allow.fits(self.cost.row_seconds(req.num_tokens, small=not allow.window))

    def _make_room_for_priority(self, out: SchedulerOutput, budget: int) -> None:
        """Before the batch is scheduled: the next waiting request preempts running requests of
        a lower priority while it has no seat or not the blocks for its first chunk."""
        req = self.waiting.head()
        if req is None or not self.running or req.priority >= max(r.priority for r in self.running):
            return
        prefix = self._prefix_of(req)
        n = self._chunk_size(req.num_tokens - prefix.num_tokens, budget)
        self._room_for(req, prefix.num_tokens + n, prefix, preempt=True, out=out)

    def _prefix_of(self, req: Request) -> PrefixMatch:
        """The cached prefix a waiting request starts from (none when it returns prompt
        logprobs: cached tokens have no logits). Not counted in the hit rate here: the request
        is counted once, when admitted (`_admit_waiting`)."""
        if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
            return self.blocks.match_prefix(req.all_token_ids, count=False, root=req.cache_root)
        return PrefixMatch()

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and self.seats_taken() < self.config.max_num_seqs:
            req = self.waiting.head()
            prefix = self._prefix_of(req)  # looked up at every step it waits: counted once, below
            n = self._chunk_size(req.num_tokens - prefix.num_tokens, budget, req)
            if n == 0:
                break  # less urgent than one here: it waits (and so does everything behind it)
            if not self.blocks.allocate(req.request_id, prefix.num_tokens + n, prefix):
                break  # arrival order is kept: nothing behind it jumps the queue
            if req.num_cached_tokens < 0 and req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
                req.num_cached_tokens = prefix.num_tokens  # its first admission (not a recompute)
                self.blocks.count_prefix(len(req.all_token_ids), prefix.num_tokens)
            self.waiting.remove(req)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.num_computed_tokens = prefix.num_tokens
            self.running.append(req)
            self._commit(out, req, n)
            budget -= n

    def _commit(self, out: SchedulerOutput, req: Request, n: int) -> None:
        chunk = ScheduledChunk.of(req, n)
        self.waiting.charge(req.tenant, n)
        req.status = RequestStatus.DECODING if n == 1 and chunk.completes and req.output_token_ids else RequestStatus.PREFILLING
        # the KV of these tokens is computed in this step, before anyone can look them up
        self.blocks.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens + n, req.cache_root)
        out.chunks.append(chunk)
