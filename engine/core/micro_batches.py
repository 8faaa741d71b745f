"""Micro-batches in a pipeline's flight (issue 47): rank 0 of a pipeline of N stages (each one
rank, or a tensor-parallel group under PP x TP) keeps up to N steps in the pipe, so that its
stage computes one micro-batch while the later stages compute the ones before it.

Each micro-batch is a scheduler step of its own over the requests not in flight (the
scheduler skips `Scheduler.in_flight` and never preempts them), with its own blocks. When
nothing is in flight the scheduled step is split into up to N micro-batches by tokens, in
row order; later, each engine step schedules one more micro-batch from the requests that
landed (and new ones), launches it (the step is posted to the stages, rank 0 runs its layers
and posts the residual stream on: runner.launch), and then lands the oldest once N are in
flight (or when nothing new could be scheduled): its logits, sampling and outputs, exactly
as a one-step engine's. Every stage processes micro-batches in launch order; rank 0 has a
receive posted for each one's result, so no stage waits on rank 0 to send it. A prompt's
chunk that does not complete it samples nothing: its request counts the chunk at launch and
stays schedulable, so the prompt's next chunk follows it into the pipe (its KV is written on
every stage first, as the stages keep the order).

What a micro-batch does not carry runs the one-step way once the pipe is drained: a step
of one chunk that samples and nothing in flight (one stream decoding: nothing to overlap),
prompt logprobs, layer streams or speculation. A KV export or import lands the micro-batches in flight first (`settle`), their
outputs returned by the next step. A request aborted while in the pipe is dropped when its
micro-batch lands. RankFailed empties the pipe (the blocks are freed by the engine's abort).
"""
from __future__ import annotations

import time
from collections import deque

from pdserve.common.outputs import RequestOutput
from pdserve.engine.parallel.group import RankFailed
from pdserve.engine.sampling.sampler import sample


def split(chunks: list, parts: int) -> list[list]:
    """`chunks` in up to `parts` runs of about equal tokens, in order, none empty."""
    total = sum(c.num_new_tokens for c in chunks)
    out, cur, done = [], [], 0
    for c in chunks:
        cur.append(c)
        done += c.num_new_tokens
        if done * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


class MicroBatches:
    """An engine's micro-batches in its pipeline's flight (`engine.micro_batches`)."""

    @classmethod
    def of(cls, engine) -> "MicroBatches | None":
        """An engine's micro-batches: a pipeline's of 2 stages or more (its stages of one rank
        or PP x TP groups alike: each stage's ranks take the steps in launch order, and stage 0's
        post their sends on, pp.Stage.leave), but a mixture of experts's
        (its expert matmuls' sums depend on which rows share the batch: a micro-batch would
        change the last bits of the logprobs)."""
        tp = engine.tp
        if tp is None or not tp.pipeline or tp.stages < 2 or engine.model_config.num_experts:
            return None
        return cls(engine)

    def __init__(self, engine):
        self.engine, self.depth = engine, engine.tp.stages  # one micro-batch in flight a stage
        self.flight: deque = deque()  # (chunks, the runner's launch, grammar masks)
        self.stash: list[RequestOutput] = []  # outputs of micro-batches landed by `settle`
        self.launched = 0  # micro-batches launched
        self.most = 0  # the most micro-batches in flight at once
        engine.kv_cache.settle = self.settle

    def _carries(self, sched) -> bool:
        e = self.engine
        return not e._speculates(sched) and not any(
            c.request.params.prompt_logprobs is not None or c.request.request_id in e._layer_streams
            for c in sched.chunks)

    def step(self) -> list[RequestOutput]:
        """One engine step: launch a micro-batch if one can be scheduled, land the oldest. The
        scheduler's step times (its cost model, the histogram) get the launch's: rank 0's
        stage, not the micro-batch's way through the pipe."""
        e = self.engine
        out, self.stash = self.stash, []
        sched = e.scheduler.schedule()
        e.last_step_progress = bool(self.flight) or sched.num_tokens > 0 or bool(sched.preempted)
        alone = not self.flight and len(sched.chunks) == 1 and sched.chunks[0].completes
        if sched.chunks and (not self._carries(sched) or alone):
            return out + self.drain() + e._run(sched)
        if sched.chunks:
            t0 = time.perf_counter()
            for part in ([sched.chunks] if self.flight else split(sched.chunks, self.depth)):
                self._launch(part)
            e.scheduler.observe_step(time.perf_counter() - t0, sched)
        if self.flight and (len(self.flight) >= self.depth or not sched.chunks):
            out += self._land()
        return out

    def _launch(self, chunks) -> None:
        e = self.engine
        masks = e._start_masks(chunks)
        e.scheduler.in_flight.update(c.request.request_id for c in chunks if c.completes)
        try:
            self.flight.append((chunks, e.runner.launch(chunks), masks))
            self.launched, self.most = self.launched + 1, max(self.most, len(self.flight))
        except RankFailed:
            self.clear()
            raise
        for c in chunks:  # a prompt's next chunk may follow this one into the pipe: it samples nothing
            if not c.completes:
                c.request.num_computed_tokens += c.num_new_tokens

    def _land(self) -> list[RequestOutput]:
        e = self.engine
        chunks, launched, masks = self.flight.popleft()
        try:
            completed, logits = e.runner.land(launched)
        except RankFailed:
            self.clear()
            raise
        for c in chunks:
            if not c.completes:
                continue  # counted at launch
            e.scheduler.in_flight.discard(c.request.request_id)
            if not c.request.status.finished:  # aborted while in the pipe: its blocks are gone
                c.request.num_computed_tokens += c.num_new_tokens
        rows = [i for i, c in enumerate(completed) if not c.request.status.finished]
        reqs = [completed[i].request for i in rows]
        if not reqs:
            return []
        live = logits if len(rows) == len(completed) else logits[rows]  # skip a (rows, vocab) copy
        tokens, logprobs = sample(live, reqs, masks.result() if masks else None)
        return [e._on_token(r, t, lp) for r, t, lp in zip(reqs, tokens, logprobs)]

    def drain(self) -> list[RequestOutput]:
        """Land every micro-batch in flight."""
        out = []
        while self.flight:
            out += self._land()
        return out

    def settle(self) -> None:
        """Before another message to the stages that answers under tag 0 (a KV export or
        import): the pipe drained, its outputs kept for the next step."""
        self.stash += self.drain()

    def clear(self) -> None:
        """The pipe is broken (a stage died): forget what was in it (its posted receives are
        kept alive with the group: gloo still holds their buffers)."""
        self.flight.clear()
        self.engine.scheduler.in_flight.clear()
        stage = self.engine.runner.model.pp
        stage.broken += stage.landing
        stage.landing.clear()

    def close(self) -> None:
        """Engine shutdown: land what is in flight (its outputs go nowhere)."""
        try:
            self.drain()
        except RankFailed:
            self.clear()
