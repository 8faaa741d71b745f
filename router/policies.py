"""Routing policies: pick a prefill worker and a decode worker for a request.

Plain Python over a snapshot of worker loads (from heartbeats) and the prefix index, so they
are tested without a network. `prefix_aware` prices a prefill worker by the prompt tokens it
would have to compute (the prompt minus the prefix it already holds), plus the prefill tokens
already queued on it, plus the prefix it would duplicate (what the warmest worker holds
beyond its own); it picks a decode worker by load, preferring among the nearly least loaded
the one that holds the longest part of the prompt (least_loaded: by load alone). Its prefill
choices count as cached there at once (`PrefixIndex.expect`), ahead of the worker's events;
the router records its decode choices the same way (`ClusterClient.route`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .prefix_index import PrefixIndex


class NoWorkerError(RuntimeError):
    """No healthy worker of the needed role is registered."""


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    queued_prefill_tokens: int = 0
    running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    healthy: bool = True


@dataclass(frozen=True)
class PrefillChoice:
    worker_id: str
    cached_tokens: int  # prefix tokens the chosen worker already holds (per the index)
    expected_until: float = 0.0  # the prompt's blocks are expected there (PrefixIndex.expect) until then


def _healthy(workers: list[WorkerLoad], role: str) -> list[WorkerLoad]:
    ok = [w for w in workers if w.healthy]
    if not ok:
        raise NoWorkerError(f"no healthy {role} worker is available")
    return ok


KV_PRESSURE = 0.9   # a decode worker with this much of its KV in use is avoided: it would preempt
DECODE_SLACK = 1    # streams a decode worker may run beyond the least loaded one and still win on its cached prefix


def _decode_load(w: WorkerLoad) -> tuple:
    # streams first: each one costs a slot in every step of the batch; KV use decides ties,
    # and only when it is near full does it come first
    return (w.kv_usage >= KV_PRESSURE, w.running, w.kv_usage, w.worker_id)


class RoundRobin:
    name = "round_robin"
    follows_prefixes = False  # True: the router records where prompts went in the prefix index

    def __init__(self):
        self._prefill = itertools.count()
        self._decode = itertools.count()

    def pick_prefill(self, workers, block_hashes, num_tokens, block_size) -> PrefillChoice:
        ok = sorted(_healthy(workers, "prefill"), key=lambda w: w.worker_id)
        return PrefillChoice(ok[next(self._prefill) % len(ok)].worker_id, 0)

    def pick_decode(self, workers, block_hashes=()) -> str:
        ok = sorted(_healthy(workers, "decode"), key=lambda w: w.worker_id)
        return ok[next(self._decode) % len(ok)].worker_id


class LeastLoaded:
    name = "least_loaded"
    follows_prefixes = False

    def pick_prefill(self, workers, block_hashes, num_tokens, block_size) -> PrefillChoice:
        w = min(_healthy(workers, "prefill"), key=lambda w: (w.queued_prefill_tokens, w.running, w.worker_id))
        return PrefillChoice(w.worker_id, 0)

    def pick_decode(self, workers, block_hashes=()) -> str:
        return min(_healthy(workers, "decode"), key=_decode_load).worker_id


class PrefixAware(LeastLoaded):
    name = "prefix_aware"
    follows_prefixes = True

    def __init__(self, index: PrefixIndex):
        self.index = index

    def pick_prefill(self, workers, block_hashes, num_tokens, block_size) -> PrefillChoice:
        ok = _healthy(workers, "prefill")
        held = self.index.match(block_hashes)
        best = max((held.get(w.worker_id, 0) for w in ok), default=0) * block_size

        def cost(w: WorkerLoad) -> tuple:
            cached = held.get(w.worker_id, 0) * block_size
            # tokens to compute now, plus tokens queued ahead, plus a locality penalty: a
            # colder worker recomputes the prefix now *and* caches a second copy of it, which
            # under cache pressure evicts another prefix and costs a miss later. Without it
            # (measured, 2 prefill workers, shared-prefix groups) a busy warm worker sent a
            # quarter of its group's prompts away and the hit rate stayed at 68-71% of 80%.
            return (num_tokens - cached + w.queued_prefill_tokens + (best - cached), w.running, w.worker_id)

        w = min(ok, key=cost)
        # its events come after its prefill: until then, the next prompts with this prefix
        # should find it here (30 s: the default KV hand-off timeout, past which it failed)
        until = self.index.expect(w.worker_id, block_hashes, ttl_s=30.0)
        return PrefillChoice(w.worker_id, int(held.get(w.worker_id, 0) * block_size), until)


    def pick_decode(self, workers, block_hashes=()) -> str:
        """The decode worker holding the longest part of the prompt's prefix, among those within
        DECODE_SLACK streams of the least loaded one and not short of KV: its cached blocks are
        not sent again (or, on an aggregated worker, not computed again), and the prefix is not
        duplicated in a second worker's cache. Load alone decides when none holds any of it."""
        ok = _healthy(workers, "decode")
        least = min(ok, key=_decode_load)
        near = [w for w in ok if w.kv_usage < KV_PRESSURE and w.running <= least.running + DECODE_SLACK] or [least]
        held = self.index.match(block_hashes) if block_hashes else {}
        return min(near, key=lambda w: (-held.get(w.worker_id, 0), _decode_load(w))).worker_id


def prefer_adapter(workers: list[WorkerLoad], holders: set[str]) -> list[WorkerLoad]:
    """The workers to route a LoRA adapter's request among: the healthy ones that hold its
    weights loaded (`holders`) and are not short of KV, when there are any (another worker would
    load the weights first, and may drop another adapter for them); all of them otherwise, and
    for a base-model request (no holders)."""
    loaded = [w for w in workers if w.healthy and w.worker_id in holders and w.kv_usage < KV_PRESSURE]
    return loaded or workers


DECODE_PREFILL_SLOWDOWN = 3
"""How many times longer a prompt takes on a decode worker full of streams (FULL_DECODE_STREAMS)
than on a prefill worker: its prefill chunks share the core with its streams' decode steps.
Measured on the 2-core CPU of bench/NOTES.md (prompt-heavy, 32 streams, 64 prompts after 4 of
warm-up): 1 sent it 31 of the 68, and its queue of them held off its KV imports while the
prefill worker waited (59.4 tok/s, TTFT p50 5.2 s); 3 sent it 18 (69.2 tok/s, TTFT p50 7.3 s);
one prompt at a time, 12-15 (69-70 tok/s, TTFT p50 8.8-10.4 s)."""
FULL_DECODE_STREAMS = 32


def decode_prefill_slowdown(streams: int) -> float:
    """How many times longer a prompt takes on a decode worker with `streams` streams than on
    a prefill worker: from 1 with none (its steps are the prompt's chunks, and the prompt skips
    the KV hand-off) to DECODE_PREFILL_SLOWDOWN at FULL_DECODE_STREAMS and beyond, in a line.
    A few streams add a few rows to each chunk's step: on 2 cores a burst of 8 ~2,000-token
    prompts kept the decode worker's core idle for most of the run at a fixed 3 (one prompt
    of 8 went there)."""
    share = min(max(streams, 0), FULL_DECODE_STREAMS) / FULL_DECODE_STREAMS
    return 1 + (DECODE_PREFILL_SLOWDOWN - 1) * share


def prefill_on_decode(prefill_backlog: int, decode_backlog: int, todo: int, limit: int,
                      decode_idle: bool = False, decode_streams: int = FULL_DECODE_STREAMS) -> bool:
    """Conditional disaggregation by load: should the decode worker prefill this prompt itself?

    `prefill_backlog`: prompt tokens queued on the chosen prefill worker ahead of this one;
    `decode_backlog`: prompt tokens the decode worker is already prefilling itself; `todo`:
    this prompt's uncached tokens; `decode_streams`: the streams the decode worker holds (those
    still waiting for their prompts too: they decode there next). Yes when the prefill worker's
    queue has reached `limit` tokens and the prompt would still be done sooner on the decode
    worker, which prefills at 1 / decode_prefill_slowdown(decode_streams) of the speed: a
    saturated prefill pool then lends work to the decode pool's spare compute (what Dynamo's
    disaggregated router does with its prefill-queue limit) instead of TTFT growing with the
    queue. 0: never.
    Yes too when `decode_idle` (the caller's policy: the decode worker has no stream and no
    prompt of its own): no stream's inter-token latency pays for the prefill there, and the
    prompt skips the KV hand-off."""
    return decode_idle or (limit > 0 and prefill_backlog >= limit
                           and decode_prefill_slowdown(decode_streams) * (decode_backlog + todo) < prefill_backlog + todo)


URGENT_LOCAL_PREFILL = 512
"""Prompt tokens (one chunk of the default step budget) up to which a request more urgent than
every stream on its decode worker is prefilled there (`urgent_prefill_on_decode`)."""


def urgent_prefill_on_decode(priority: int, decode_priorities, todo: int) -> bool:
    """Should the decode worker prefill this prompt itself because the request is urgent there?

    Yes when `priority` is more urgent than every stream the decode worker has
    (`decode_priorities`: theirs; none: no) and the prompt's `todo` uncached tokens are at most
    URGENT_LOCAL_PREFILL. There every step of less urgent work stops at a layer's end for it and
    the prompt skips the KV hand-off; on a prefill worker busy with a less urgent prompt the step
    in flight may be one that streams that prompt's KV out, which does not stop (a 512-token
    chunk: 0.1-0.5 s): beside a 24- or 48-stream flood, such prompts were an urgent client's
    slowest first tokens (0.6-1.1 s against ~40 ms)."""
    return bool(decode_priorities) and priority < min(decode_priorities) and todo <= URGENT_LOCAL_PREFILL


@dataclass(frozen=True)
class PeerChoice:
    """A peer the worker computing a prompt may pull its prefix's blocks from."""

    worker_id: str
    blocks: int  # the prompt's leading blocks it holds


def pick_peer(holders: dict[str, tuple[int, float]], target: str, healthy: set[str],
              min_gain: int = 1) -> PeerChoice | None:
    """The peer for a prompt that `target` computes: of the healthy workers holding at least
    `min_gain` more of its leading blocks than `target` (`holders`: blocks and their tier
    worth, from `PrefixIndex.holders`), the one whose blocks are worth most (a pool beats a
    host tier beats a disk tier), then the most blocks, then the id; None: no one has more."""
    mine = holders.get(target, (0, 0.0))[0]
    best = None
    for wid, (n, worth) in sorted(holders.items()):
        if wid != target and wid in healthy and n >= mine + min_gain and (best is None or (worth, n) > best[1]):
            best = (wid, (worth, n))
    return PeerChoice(best[0], best[1][1]) if best else None


def make_policy(name: str, index: PrefixIndex):
    if name == "prefix_aware":
        return PrefixAware(index)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown routing policy {name!r}: use prefix_aware, round_robin or least_loaded")
