"""The router's view of the cluster: workers, their loads, the prefix index, gRPC clients.

Workers come from the registry (or a static list); `refresh()` polls each one's `Stats` and
marks those that do not answer unhealthy, so routing skips them at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from pdserve.config import RouterConfig, SecurityConfig

URGENT_WINDOW_S = 5.0  # as the workers' urgent_window_s (engine/config.py SchedulerConfig)
from pdserve.common.block_hash import hash_blocks, root_hash
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.convert import params_to_proto
from pdserve.protos.security import (ReplyCheck, TLSConfig, WorkerIdentity, check_reply, open_channel, service_role,
                                     stats_request)

from .adapters import resident_on, served_adapters
from .holding import HeldPrompts, must_hold
from .policies import (NoWorkerError, PrefillChoice, WorkerLoad, make_policy, pick_peer, prefer_adapter,
                       prefill_on_decode, urgent_prefill_on_decode)
from .prefix_index import PrefixIndex
from .tenancy import SessionAffinity

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    role: str        # "prefill" | "decode" | "aggregated"
    address: str     # gRPC service address

    @property
    def identity(self) -> WorkerIdentity:
        """What the worker at `address` must prove to be this record (protos/security.py)."""
        return WorkerIdentity(self.worker_id, service_role(self.role), self.address)


PLACEMENTS = ("prefill_pool", "decode_urgent", "decode_load", "decode")
"""Where a route's prompt is computed: the prefill pool; its decode worker because the request is
more urgent than every stream there and short (policies.urgent_prefill_on_decode), or by load
(the prefill queue is deep, or the decode worker idle: policies.prefill_on_decode); or its
decode worker because there is no prefill pool (aggregated, or all down)."""


@dataclass
class Route:
    decode: WorkerEndpoint
    prefill: WorkerEndpoint | None
    cached_tokens: int
    prefill_tokens: int = 0  # tokens its prefiller (the prefill worker, else the decode one) computes: load until `settle`
    holds_stream: bool = False  # counted in its decode worker's streams until `release`
    block_hashes: list[int] = field(default_factory=list)  # the prompt's
    expected_until: float = 0.0  # its blocks count as held by the prefill worker until then (or `settle`)
    decode_expected_until: float = 0.0  # ... and by the decode worker
    settled: bool = False  # its first token came (or it moved on with tokens already streamed)
    priority: int = 0  # its request's (lower is more urgent)
    peer: WorkerEndpoint | None = None  # holds more of the prompt's prefix than the worker computing it
    peer_blocks: int = 0  # the prompt's leading blocks the peer holds (it may pull them: kv_transfer/peer.py)
    placement: str = "prefill_pool"  # where its prompt is computed and why (PLACEMENTS)


class ClusterClient:
    def __init__(self, *, routing: str = "prefix_aware", block_size: int = 16, namespace: str = "",
                 cluster_token: str = "", tls: TLSConfig | None = None, local_prefill_tokens: int = 0,
                 prefill_queue_limit: int = 0, idle_decode_prefill: bool = False,
                 stats_timeout_s: float = 2.0, slow_grace_s: float = 30.0, session_kv_limit: float = 0.9,
                 urgent_lend_window_s: float = URGENT_WINDOW_S, hold_tokens: int = 0):
        """block_size, namespace: the workers' KV block size and cache namespace (the prefix
        index hashes prompts as they do). tls: mutual TLS to the workers (their services must
        use the same CA). local_prefill_tokens: a decode worker whose own cache holds all of a
        prompt but at most this many tokens prefills the rest itself (no prefill worker, no KV
        transfer); it decides, on its cache as it is when the request arrives; 0: never.
        prefill_queue_limit: once the chosen prefill worker has this many prompt tokens queued,
        a prompt that would wait less on its decode worker is prefilled there
        (`policies.prefill_on_decode`); 0: never. idle_decode_prefill: a decode worker with no
        stream and no prompt of its own prefills the prompt itself. session_kv_limit: a session
        stays on its decode worker while that worker's KV usage is below this.
        urgent_lend_window_s: no less urgent prompt is lent to a decode worker that streamed for
        a more urgent request within this many seconds (0: only while it streams for one).
        hold_tokens: prompts wait in the router while every prefill worker has this many tokens
        queued and no decode worker takes them (router/holding.py); 0: never."""
        self.urgent_lend_window_s = urgent_lend_window_s
        self.local_prefill_tokens = local_prefill_tokens
        self.idle_decode_prefill = idle_decode_prefill
        self.prefill_queue_limit = prefill_queue_limit
        self.hold_tokens = hold_tokens
        self.index = PrefixIndex()
        self.policy = make_policy(routing, self.index)
        self.block_size, self.namespace = block_size, namespace
        self.cluster_token = cluster_token
        self.stats_timeout_s = stats_timeout_s
        self.tls = tls
        self.workers: dict[str, WorkerEndpoint] = {}
        self.stats: dict[str, pb.WorkerStats] = {}
        self.healthy: dict[str, bool] = {}
        self.slow_grace_s = slow_grace_s
        self._slow_since: dict[str, float] = {}  # when a worker's Stats calls began to run past the timeout
        self._channels: dict[str, grpc.aio.Channel] = {}
        # prompt tokens this router sent to each prefill worker that have not come back as a
        # first token: known at once, where the workers' stats arrive a poll later. Without
        # it, prompts arriving between two polls all saw idle workers and went to the first.
        self.pending_prefill: dict[str, int] = {}
        # streams this router has open on each decode worker, for the same reason: a burst of
        # requests between two polls went to one decode worker while the others idled
        self.decode_streams: dict[str, int] = {}
        self.decode_priorities: dict[str, Counter[int]] = {}  # the priorities of those streams
        self.decode_urgent: dict[str, tuple[int, float]] = {}  # the most urgent stream's priority lately, when
        self._streams_at_poll: dict[str, int] = {}  # decode_streams when each worker's stats came
        self.affinity = SessionAffinity(session_kv_limit)
        self.held = HeldPrompts(self._must_hold)  # prompts waiting for a place to be computed
        self.impostors: set[str] = set()  # registered workers that answered without proving the token

    @classmethod
    def from_config(cls, router: RouterConfig, security: SecurityConfig, block_size: int,
                    namespace: str = "") -> ClusterClient:
        return cls(routing=router.routing, block_size=block_size, namespace=namespace,
                   cluster_token=security.cluster_token, tls=security.tls,
                   local_prefill_tokens=router.decode_local_prefill,
                   prefill_queue_limit=router.prefill_queue_limit,
                   idle_decode_prefill=router.idle_decode_prefill, session_kv_limit=router.session_kv_limit,
                   urgent_lend_window_s=router.urgent_lend_window_s, hold_tokens=router.hold_tokens)

    # ---- membership ---------------------------------------------------------------------
    def set_workers(self, workers: list[WorkerEndpoint]) -> None:
        new = {w.worker_id: w for w in workers}
        for wid in set(self.workers) - set(new):
            self.index.remove_worker(wid)
            self.stats.pop(wid, None)
            self.healthy.pop(wid, None)
            self._slow_since.pop(wid, None)
        self.workers = new

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, self.tls)
        return ch

    def _stub(self, w: WorkerEndpoint):
        ch = self._channel(w.address)
        return pb_grpc.PrefillServiceStub(ch) if w.role == "prefill" else pb_grpc.DecodeServiceStub(ch)

    async def refresh(self) -> None:
        """Poll every worker's stats. A worker that cannot be reached is unhealthy at once; one
        that answers too slowly (its engine thread in a long step, a machine loaded by a worker
        starting beside it) only once it has been slow for `slow_grace_s`: its streams are
        still flowing, and taking it out of the pool would refuse requests it can serve. (A
        frozen worker also stops its registry heartbeat, and leaves the pool that way.)"""
        async def one(w: WorkerEndpoint):
            wid = w.worker_id
            try:
                req = stats_request(self.cluster_token, w.identity)
                stats = await self._stub(w).Stats(req, timeout=self.stats_timeout_s)
                check = check_reply(self.cluster_token, req, stats)
                if check is not ReplyCheck.PROVEN:
                    # answers, but is not this record's worker: no cluster token (a forged or
                    # stale registry entry), or another worker's (a record under another id,
                    # role or address, e.g. a relay to a real worker); no traffic, nor the token
                    self._impostor(wid, w.address, check.value)
                    return
                self.stats[wid] = stats
                self.healthy[wid] = True
                self._slow_since.pop(wid, None)
                self._streams_at_poll[wid] = self.decode_streams.get(wid, 0)
            except grpc.aio.AioRpcError as e:
                now = time.monotonic()
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:  # a worker that is not this record's
                    self._impostor(wid, w.address, e.details() or "another worker")
                elif e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._slow_since.pop(wid, None)
                    self.healthy[wid] = False
                elif now - self._slow_since.setdefault(wid, now) >= self.slow_grace_s or not self.healthy.get(wid):
                    self.healthy[wid] = False
        await asyncio.gather(*(one(w) for w in list(self.workers.values())))
        self.held.wake()

    def _impostor(self, wid: str, address: str, why: str) -> None:
        self.healthy[wid] = False
        self.stats.pop(wid, None)
        if wid not in self.impostors:
            log.warning("worker %s at %s did not prove it is that worker (%s): no traffic for it", wid, address, why)
        self.impostors.add(wid)

    def max_model_len(self) -> int:
        """The longest context any healthy worker that decodes serves (0: none has said yet)."""
        return max((s.max_model_len for wid, s in self.stats.items()
                    if s.role != "prefill" and self.healthy.get(wid)), default=0)

    def ready(self) -> bool:
        """True when at least one decode-capable worker answers (and a prefill worker, if the
        cluster has a prefill pool)."""
        roles = {w.role for w in self.workers.values() if self.healthy.get(w.worker_id)}
        has_prefill_pool = any(w.role == "prefill" for w in self.workers.values())
        return bool(roles & {"decode", "aggregated"}) and ("prefill" in roles or not has_prefill_pool)

    def _loads(self, roles: set[str]) -> list[WorkerLoad]:
        out = []
        for w in self.workers.values():
            if w.role not in roles:
                continue
            s = self.stats.get(w.worker_id)
            queued = max(s.queued_prefill_tokens if s else 0, self.pending_prefill.get(w.worker_id, 0))
            running = s.running if s else 0
            if w.role != "prefill":
                # its report is a poll old: of what it counted then, keep what other routers sent,
                # and add this router's streams as they are now (opened and closed since)
                others = (running + (s.waiting if s else 0)) - self._streams_at_poll.get(w.worker_id, 0)
                running = max(others, 0) + self.decode_streams.get(w.worker_id, 0)
            out.append(WorkerLoad(w.worker_id, queued, running, s.kv_usage if s else 0.0,
                                  self.healthy.get(w.worker_id, False)))
        return out

    # ---- routing ------------------------------------------------------------------------
    def saturated(self, kv_limit: float = 0.9) -> bool:
        """Every healthy decode-capable worker has its KV nearly full or requests waiting (a
        sheddable request is refused then)."""
        loads = [self.stats.get(w.worker_id) for w in self.workers.values()
                 if w.role != "prefill" and self.healthy.get(w.worker_id)]
        return bool(loads) and all(s is not None and (s.kv_usage >= kv_limit or s.waiting > 0) for s in loads)

    def adapters(self) -> dict[str, pb.LoRAAdapterInfo]:
        """The LoRA adapters the healthy workers serve, by name."""
        return served_adapters(self.stats, self.healthy)

    def _lora_root(self, cache_salt: str, lora: str) -> int:
        """The block-hash root of a request under adapter `lora` ("": the base), as the
        workers compute it (their reported identity of the adapter)."""
        info = self.adapters().get(lora) if lora else None
        return root_hash(cache_salt, info.identity if info else f"{lora}@?" if lora else "")

    def route(self, prompt: list[int], exclude: frozenset[str] = frozenset(), cache_salt: str = "",
              session: str = "", priority: int = 0, lora: str = "") -> Route:
        """Pick workers for `prompt`; `exclude`: workers that just failed or refused it;
        `cache_salt`: the request's (its blocks are looked up under it, as the workers do);
        `session`: its conversation, kept on one decode worker until that one is saturated;
        `priority`: its request's (a prompt is never lent to a decode worker streaming for more
        urgent requests: their tokens would wait for it); `lora`: its adapter (its blocks hash
        under the adapter's identity, and workers holding the adapter loaded are preferred).
        Raises NoWorkerError if no decode worker is left, or if every prefill worker is
        excluded (refused: its queue is full; prefilling on the decode pool instead would
        defeat the limit)."""
        prefill: PrefillChoice | None = None
        prefill_pool = self._loads({"prefill"})
        holders = resident_on(self.stats, lora) if lora else set()
        decode_pool = prefer_adapter([w for w in self._loads({"decode", "aggregated"}) if w.worker_id not in exclude],
                                     holders)
        candidates = [w for w in prefill_pool if w.worker_id not in exclude]
        if prefill_pool and not candidates:
            raise NoWorkerError("every prefill worker refused the request")
        candidates = prefer_adapter(candidates, holders)
        hashes = hash_blocks(prompt, self.block_size, self.namespace, parent=self._lora_root(cache_salt, lora))
        decode_id = self.affinity.pick(session, decode_pool, lambda: self.policy.pick_decode(decode_pool, hashes))
        # the prompt's blocks land there (KV import or local prefill) before its events say so
        decode_until = self.index.expect(decode_id, hashes, ttl_s=30.0) if self.policy.follows_prefixes else 0.0
        try:
            prefill = self.policy.pick_prefill(candidates, hashes, len(prompt), self.block_size)
        except NoWorkerError:
            pass  # no prefill pool (aggregated) or all down: the decode worker prefills itself
        streams = self.decode_priorities.get(decode_id)
        urgent_there = min(streams or [priority]) < priority or self._urgent_lately(decode_id, priority)
        urgent_here = prefill is not None and urgent_prefill_on_decode(
            priority, streams, max(len(prompt) - prefill.cached_tokens, 0))
        self.decode_streams[decode_id] = self.decode_streams.get(decode_id, 0) + 1
        self.decode_priorities.setdefault(decode_id, Counter())[priority] += 1
        placement = "decode" if prefill is None else "prefill_pool"
        if prefill is not None and not urgent_there and (urgent_here or self._prefill_here(
                prefill, prefill_pool, decode_pool, decode_id, len(prompt))):
            if prefill.expected_until:
                self.index.withdraw(prefill.worker_id, hashes, prefill.expected_until)
            prefill, placement = None, "decode_urgent" if urgent_here else "decode_load"
        if prefill is None:
            self.pending_prefill[decode_id] = self.pending_prefill.get(decode_id, 0) + len(prompt)
            route = Route(self.workers[decode_id], None, 0, len(prompt), holds_stream=True, block_hashes=hashes,
                          decode_expected_until=decode_until, priority=priority, placement=placement,
                          **self._peer(hashes, decode_id))
        else:
            todo = max(len(prompt) - prefill.cached_tokens, 0)
            self.pending_prefill[prefill.worker_id] = self.pending_prefill.get(prefill.worker_id, 0) + todo
            route = Route(self.workers[decode_id], self.workers[prefill.worker_id], prefill.cached_tokens, todo,
                          holds_stream=True, block_hashes=hashes, expected_until=prefill.expected_until,
                          decode_expected_until=decode_until, priority=priority,
                          **self._peer(hashes, prefill.worker_id))
        self.held.wake()  # with this prompt counted: the next held one may fit too
        return route

    def _must_hold(self, todo: int, priority: int) -> bool:
        """Should a prompt of `todo` tokens wait in the router (router/holding.py)? Never one
        more urgent than every stream of some decode worker (its own placement there)."""
        if any(urgent_prefill_on_decode(priority, streams, todo) for streams in self.decode_priorities.values()):
            return False
        now = time.monotonic()
        lendable = [w for w in self._loads({"decode", "aggregated"})  # as `route` would lend (not mutating)
                    if min(self.decode_priorities.get(w.worker_id) or [priority]) >= priority
                    and not ((seen := self.decode_urgent.get(w.worker_id)) and seen[0] < priority
                             and now - seen[1] <= self.urgent_lend_window_s)]
        return must_hold(self._loads({"prefill"}), lendable, todo, self.prefill_queue_limit, self.idle_decode_prefill,
                         self.hold_tokens)

    def _peer(self, hashes: list[int], target: str) -> dict:
        """Route's peer fields: who `target` (the worker computing the prompt) may pull the
        prompt's prefix from, by the prefix index's view of every worker's pool and tiers."""
        healthy = {wid for wid in self.workers if self.healthy.get(wid)}
        choice = pick_peer(self.index.holders(hashes), target, healthy)
        return {"peer": self.workers[choice.worker_id], "peer_blocks": choice.blocks} if choice else {}

    def _urgent_lately(self, decode_id: str, priority: int) -> bool:
        """Whether `decode_id` streamed for a request more urgent than `priority` within
        `urgent_lend_window_s` (noting this one's): a less urgent prompt is not lent to it then,
        so the urgent client's next request (a person's next chat) finds it free."""
        now = time.monotonic()
        seen = self.decode_urgent.get(decode_id)
        if seen is not None and now - seen[1] > self.urgent_lend_window_s:
            seen = None
        if seen is None or priority <= seen[0]:
            self.decode_urgent[decode_id] = (priority, now)
            return False
        return True

    def _prefill_here(self, prefill: PrefillChoice, prefill_pool: list[WorkerLoad], decode_pool: list[WorkerLoad],
                      decode_id: str, prompt_len: int) -> bool:
        """Whether the decode worker should prefill the prompt itself, by load (see __init__;
        `decode_pool`: the loads from before this request was counted)."""
        queued = {w.worker_id: w.queued_prefill_tokens for w in prefill_pool + decode_pool}
        decode = next(w for w in decode_pool if w.worker_id == decode_id)
        idle = self.idle_decode_prefill and decode.running == 0 and decode.queued_prefill_tokens == 0
        return prefill_on_decode(queued.get(prefill.worker_id, 0), queued.get(decode_id, 0),
                                 max(prompt_len - prefill.cached_tokens, 0), self.prefill_queue_limit, idle,
                                 decode.running)

    def settle(self, route: Route | None, prefilled_remotely: bool = True) -> None:
        """The route's prefill is over (its first token came, or it failed): take its tokens
        off the worker's pending load. `prefilled_remotely` False: the prefill worker did not
        compute the prompt (the decode worker took it, or the request failed or moved), so
        the index stops expecting its blocks there. Idempotent."""
        if route is None or route.settled:
            return
        route.settled = True
        route.decode_expected_until = 0.0  # the prompt is on the decode worker now: its events follow
        wid = (route.prefill or route.decode).worker_id
        if route.prefill is not None and not prefilled_remotely and route.expected_until:
            self.index.withdraw(wid, route.block_hashes, route.expected_until)
        route.expected_until = 0.0
        if route.prefill_tokens:
            left = self.pending_prefill.get(wid, 0) - route.prefill_tokens
            route.prefill_tokens = 0
            if left > 0:
                self.pending_prefill[wid] = left
            else:
                self.pending_prefill.pop(wid, None)
        self.held.wake()  # a place to compute a held prompt may have opened

    def release(self, route: Route | None) -> None:
        """The route's stream is over (finished, failed, refused or moved): settle its prefill
        and take it off its decode worker's streams. Idempotent."""
        if route is None:
            return
        if not route.settled and route.decode_expected_until:  # no first token: nothing landed there for it
            self.index.withdraw(route.decode.worker_id, route.block_hashes, route.decode_expected_until)
        self.settle(route, prefilled_remotely=False)  # unless settled already: no first token came
        if not route.holds_stream:
            return
        wid = route.decode.worker_id
        route.holds_stream = False
        left = self.decode_streams.get(wid, 0) - 1
        if left > 0:
            self.decode_streams[wid] = left
        else:
            self.decode_streams.pop(wid, None)
        priorities = self.decode_priorities.get(wid, Counter())
        priorities[route.priority] -= 1
        if priorities[route.priority] <= 0:
            del priorities[route.priority]
        if not priorities:
            self.decode_priorities.pop(wid, None)
        self.held.wake()

    async def generate(self, route: Route, request_id: str, prompt: list[int], params,
                       resume: list[int] | None = None, metadata: tuple = (),
                       lora: str = "") -> AsyncIterator[pb.GenerateResponse]:
        """Stream a request's outputs from its decode worker; closing the iterator early
        cancels the call, which aborts the request on the worker. `resume`: tokens already
        streamed (a migration from a failed worker); `metadata`: the call's (trace context);
        `lora`: the adapter it runs under ("": the base model)."""
        req = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=params_to_proto(params),
                                 prefill_address=route.prefill.address if route.prefill else "",
                                 prefill_worker_id=route.prefill.worker_id if route.prefill else "",
                                 cluster_token=self.cluster_token, resume_token_ids=resume or [],
                                 local_prefill_tokens=self.local_prefill_tokens,
                                 peer_address=route.peer.address if route.peer else "",
                                 peer_worker_id=route.peer.worker_id if route.peer else "", peer_blocks=route.peer_blocks,
                                 lora=lora)
        call = self._stub(route.decode).Generate(req, metadata=metadata or None)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
