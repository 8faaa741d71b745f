"""The decode service: admit a request, get its prompt KV, decode it in the batch, stream.

`Generate` allocates the request's blocks, asks the prefill worker the router chose to fill
them (the KV arrives through this worker's KV transfer server and is checked against a
lease), imports it with the first token, and streams token ids as the batch produces them.
With no prefill worker, a short prompt, or a failed transfer under the `recompute` policy,
the prompt is prefilled here instead. Every exit path releases the request's blocks.
A pipeline-parallel engine receives by parts: each of its ranks serves its own layers (and
heads) at an address of its own, which its KV address lists (kv_transfer/stages.py), holds
the request's lease, and writes what it received when rank 0 imports its part.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from functools import partial

import grpc

from pdserve.common.aio import stop_tasks
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.parallel.pp import PPKVCache
from pdserve.common.errors import InvalidRequestError, KVTransferError
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer import stages
from pdserve.kv_transfer.grpc_transport import GrpcKVServer
from pdserve.kv_transfer.peer import PeerPuller, PullCounters, serve_pulls
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.kv_transfer.config import TransferConfig
from pdserve.protos.convert import logprob_from_proto, output_to_proto, params_from_proto
from pdserve.protos.security import SecurityConfig, add_port, open_channel
from pdserve.protos.servicer import WorkerServicer
from pdserve.protos.status import refuse_invalid, refuse_when_full, refused_by
from pdserve.protos.tracing import NO_SPAN, OFF, Tracer
from pdserve.kv_transfer.adapters import AdapterServicer

TAKEN_HERE = "taken here"  # _destination_blocks: added for a local prefill of its few uncached tokens
BLOCKS_RETRY_S = 0.05  # a hand-off waiting for blocks asks again this often (blocks come back as requests finish)
BLOCKS_RETRY_URGENT_S = 0.2  # ... while the engine steps for work more urgent than it


def blocks_retry_s(stepping_for: int, priority: int) -> float:
    """How long a hand-off of `priority` waiting for blocks sleeps before it asks again, while the
    engine steps for work of priority `stepping_for`: each ask is a command on the engine thread,
    run between two steps, and 20-40 waiting hand-offs of a flood asked ~800 times a second,
    between an urgent stream's steps too (at 48 streams, 16,778 asks in 5 phases)."""
    return BLOCKS_RETRY_URGENT_S if stepping_for < priority else BLOCKS_RETRY_S


class PrefillWorkerFull(Exception):
    """The chosen prefill worker refused the prompt: its queue is full. The request is
    refused in turn (naming that worker), so the router can pick another or answer 429."""

    def __init__(self, worker_id: str):
        super().__init__(f"prefill worker {worker_id} is at its queue limit")
        self.worker_id = worker_id


class DecodeServicer(AdapterServicer, WorkerServicer, pb_grpc.DecodeServiceServicer):
    role = "decode"

    async def Generate(self, request: pb.GenerateRequest, context):
        w = self.w
        await self.check_token(request.cluster_token, context)
        if w.draining or (w.max_queue and w.queued >= w.max_queue):
            w.refused += 1
            await refuse_when_full(context, w.worker_id, "decode worker", w.max_queue, "draining" if w.draining else "")
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        params = params_from_proto(request.params)
        q = w.engine.open_stream(rid)
        w.queued += 1  # until its first token: waiting for KV or for a place in the batch
        queued, finished = True, False
        span = w.tracer.start("decode", w.tracer.extract(context.invocation_metadata()), kind="server",
                              attributes={"pdserve.request_id": rid, "pdserve.worker_id": w.worker_id,
                                          "pdserve.prompt_tokens": len(prompt)})
        t_admit, t_first, tokens = time.perf_counter(), 0.0, 0
        try:
            remote = await w.admit(request, prompt, params, context, span)
            t_added = time.perf_counter()
            kv_bytes, timing = w.request_kv_bytes.pop(rid, 0), w.request_timing.pop(rid, None)
            async for out in w.engine.stream(rid, q):
                if out.error:  # a budget it passed (its grammar's mask time): ended, with the reason
                    raise InvalidRequestError(out.error, param="response_format", code="grammar_budget_exceeded")
                if queued:
                    w.queued, queued = w.queued - 1, False
                    t_first = time.perf_counter()
                    if not remote:
                        w.trace_local_prefill(span, t_admit, t_first, out)
                        w.peer.observe_prefill(out.num_prompt_tokens - out.num_cached_tokens,
                                               t_first - t_added - out.queue_s)
                finished = out.finished
                tokens += len(out.new_token_ids)
                yield output_to_proto(out, prefilled_remotely=remote, kv_bytes=kv_bytes, timing=timing)
                kv_bytes, timing = 0, None  # the first response carries them
            span.set_attributes({"pdserve.prefilled_remotely": remote, "pdserve.completion_tokens": tokens,
                                 "pdserve.finish_reason": out.finish_reason or ""} if tokens else {})
        except InvalidRequestError as e:
            span.record_error(str(e))
            await refuse_invalid(context, e)
        except PrefillWorkerFull as e:
            span.record_error(str(e))
            await refuse_when_full(context, e.worker_id, "prefill worker")
        except BaseException as e:
            span.record_error(repr(e))
            raise
        finally:
            if t_first:
                w.tracer.record("decode.generation", span, t_first, time.perf_counter(),
                                {"pdserve.completion_tokens": tokens})
            span.end()
            w.request_kv_bytes.pop(rid, None)
            if queued:
                w.queued -= 1
            w.engine.close_stream(rid)
            if not finished:
                # whatever point it left at (a cancel while admit() had the engine thread add
                # it or take its blocks included): the abort runs after those commands, in
                # order, so nothing it took outlives the call; a no-op if nothing was taken
                w.drop_lease(rid)
                w.engine.abort_soon(rid)


class DecodeWorker:
    """One decode engine behind a gRPC `DecodeService` plus its KV transfer endpoint."""

    _ids = itertools.count()

    def __init__(self, engine: AsyncEngine, worker_id: str | None = None, max_queue: int = 0,
                 transfer: TransferConfig = TransferConfig(), security: SecurityConfig = SecurityConfig(),
                 tracer: Tracer = OFF):
        """max_queue > 0: at most this many requests here waiting for their first token
        (for KV or for a place in the batch); more are refused with RESOURCE_EXHAUSTED.
        transfer: what KV it receives over (transport), what a failed hand-off does (policy),
        how long it waits for KV (timeout_s), which prompts it prefills itself
        (local_prefill_threshold), and whether KV pushed in another format than this cache's
        is converted as it lands or refused (kv_dtype_mismatch).
        security: the cluster token every call must carry and the internal TLS.
        tracer: where this worker's spans go (its owner shuts it down)."""
        self.engine = engine
        self.tracer = tracer
        self.worker_id = worker_id or f"decode-{next(self._ids)}"
        self.transfer = transfer
        self.tls, self.cluster_token = security.tls, security.cluster_token
        eng = engine.engine
        self.staged = isinstance(eng.kv_cache, PPKVCache)  # each rank receives its own part (rank 0's: here)
        self.receiver = KVReceiver(eng.loaded.fingerprint, eng.kv_cache.layout, eng.kv_cache.format.name,
                                   self.cluster_token, convert=transfer.kv_dtype_mismatch == "convert",
                                   part=eng.kv_cache.own if self.staged else None)
        self.remote_prefills = self.local_prefills = self.transfer_failures = 0
        self.blocks_received = 0  # KV blocks imported (a cached prefix is not sent again)
        self.tail_prefills = 0  # of local_prefills: at most the router's limit of their tokens not cached here
        self.kv_bytes_received = 0
        self.request_kv_bytes: dict[str, int] = {}  # KV bytes of a request's hand-off, until its first response
        self.request_timing: dict[str, pb.HandoffTiming] = {}  # and where its time went
        self.max_queue, self.queued, self.refused = max_queue, 0, 0
        self.draining = False  # set when the pool shrinks: refuse new requests, finish the rest
        self._kv_server: GrpcKVServer | None = None
        self._server: grpc.aio.Server | None = None
        self._prefill_stubs: dict[str, pb_grpc.PrefillServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._reaper: asyncio.Task | None = None
        self.address = self.kv_address = ""
        self.pulls = PullCounters()  # prefix blocks pulled from peers, and served to them
        self.peer = PeerPuller(engine, self.worker_id, transfer, security, self.pulls)

    def forget(self, request_id: str) -> None:
        """Drop an aborted request's KV lease (its blocks go with the engine's abort)."""
        self.drop_lease(request_id)

    def drop_lease(self, request_id: str) -> None:
        """Cancel the request's KV lease here and, in a pipeline, on its other ranks (queued on
        the engine thread, not waited for: a late push to them is then refused at once)."""
        self.receiver.cancel(request_id)
        if self.staged:
            self.engine.call(lambda e: e.kv_cache.drop_kv(request_id), request_id=request_id)

    def counters(self) -> dict:
        """This worker's counters in its Stats."""
        return dict(remote_prefills=self.remote_prefills, local_prefills=self.local_prefills,
                    transfer_failures=self.transfer_failures, refused=self.refused, queue_limit=self.max_queue,
                    kv_bytes=self.kv_bytes_received, **self.pulls.stats())

    # ---- admission ------------------------------------------------------------------------
    async def admit(self, request: pb.GenerateRequest, prompt: list[int], params: SamplingParams, context,
                    span=NO_SPAN) -> bool:
        """Start the request (`params`: its parameters as read here); returns True if its
        prompt was prefilled remotely. A migrated request (`resume_token_ids`: tokens it
        already produced) is recomputed here, and so is a prompt of which at most
        `local_prefill_tokens` are not in this worker's cache. It runs under the adapter
        `request.lora` names ("": the base model), here and on the prefill worker."""
        rid, resume, local_tail = request.request_id, list(request.resume_token_ids), request.local_prefill_tokens
        prefill_address = request.prefill_address
        # a prompt's logprobs come back from the prefill worker with its KV
        if prefill_address and len(prompt) > self.transfer.local_prefill_threshold and not resume:
            try:
                done = await self._remote_prefill(request, prompt, params, local_tail, span)
                if done is True:
                    return True
                if done is False:  # taken here: few of its tokens are not cached here
                    self.local_prefills += 1
                    self.tail_prefills += 1
                    return False
            except KVTransferError as e:
                span.record_error(f"KV hand-off failed: {e}")
                self.transfer_failures += 1
                if self.transfer.policy == "fail":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV hand-off failed: {e}")
        self.local_prefills += 1
        if params.prompt_logprobs is None:  # cached tokens have no logits: such a prompt computes them all
            await self.peer.pull(rid, prompt, params.cache_salt, request.peer_address, request.peer_blocks,
                                 request.lora)
        await self.engine.add_request(rid, prompt, params, resume=resume, lora=request.lora or None)
        return False

    async def _destination_blocks(self, rid, prompt, params, local_tail: int = 0, lora: str | None = None):
        """Blocks for the prompt's KV, waiting (up to the transfer timeout) while the batch
        holds them all: under KV pressure a request queues for blocks here rather than having
        its prompt computed on this decode worker, where it would stall every stream.
        TAKEN_HERE: at most `local_tail` of the prompt's tokens are not in the cache, and the
        request was added for a local prefill instead (in the same engine call, so the
        cached prefix cannot be evicted in between)."""
        deadline = time.monotonic() + self.transfer.timeout_s
        self.engine.note_arrival(params.priority)  # a long step of less urgent work stops for it
        while True:
            dest = await self.engine.run(partial(self._take_blocks, rid=rid, prompt=prompt, params=params,
                                                 local_tail=local_tail, lora=lora), params.priority, rid)
            if dest is not None or time.monotonic() >= deadline:
                return dest
            await asyncio.sleep(blocks_retry_s(self.engine.stop_word.threshold, params.priority))

    @staticmethod
    def _take_blocks(e, rid: str, prompt: list[int], params: SamplingParams, local_tail: int, lora: str | None):
        """On the engine thread: the destination blocks, None if none are free, or TAKEN_HERE
        (the prefix looked up under the request's adapter, as its blocks are hashed; copied back
        from a KV tier only when blocks for the whole prompt are free)."""
        if local_tail and len(prompt) - e.blocks.match_prefix(
                prompt, count=False, root=e.cache_root(params.cache_salt, lora), whole=True).num_tokens <= local_tail:
            e.add_request(rid, prompt, params, lora=lora)
            return TAKEN_HERE
        return e.add_remote_request(rid, prompt, params, lora=lora)

    async def _remote_prefill(self, request: pb.GenerateRequest, prompt: list[int], params: SamplingParams,
                              local_tail: int = 0, span=NO_SPAN) -> bool | None:
        """True: prefilled remotely; False: taken here, few tokens uncached (see
        `_destination_blocks`); None: no blocks free in time (the caller prefills it here,
        queued). Raises KVTransferError on failure after releasing the destination blocks.
        The prefill worker gets the request's parameters as the router sent them."""
        rid, prefill_address, lora = request.request_id, request.prefill_address, request.lora or None
        t_wait = time.perf_counter()
        dest = await self._destination_blocks(rid, prompt, params, local_tail, lora)
        t_dest = time.perf_counter()
        blocks_wait_s = t_dest - t_wait
        self.tracer.record("decode.blocks_wait", span, t_wait, t_dest,
                           {"pdserve.blocks": len(dest) if isinstance(dest, list) else 0})
        if dest is TAKEN_HERE:
            return False
        if dest is None:
            return None
        bs = self.engine.engine.blocks.block_size
        skip = (-(-len(prompt) // bs) - len(dest)) * bs  # tokens of the cached prefix, shared here
        # held by the request from here, so its identity cannot change before the KV lands
        identity = await self.engine.run(lambda e: e.loras.identity(lora)) if lora else ""
        # the lease and the call last the prompt's whole stay on the prefill worker (its queue
        # included): a hand-off given up while queued there would be computed twice
        self.receiver.expect(rid, dest, len(prompt), self.transfer.prefill_timeout_s, first_token_index=skip,
                             lora_identity=identity)
        if self.staged:  # the other ranks' leases of their parts
            timeout = self.transfer.prefill_timeout_s
            await self.engine.run(lambda e: e.kv_cache.expect_kv(rid, dest, len(prompt), timeout, skip, identity),
                                  request_id=rid)
        call = self.tracer.start("prefill.call", span, kind="client",
                                 attributes={"pdserve.prefill_worker": request.prefill_worker_id,
                                             "pdserve.cached_tokens": skip})
        try:
            try:
                reply = await self._prefill_stub(prefill_address).Prefill(pb.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, params=request.params,
                    kv_address=self.kv_address, dest_block_ids=dest, timeout_s=self.transfer.timeout_s,
                    skip_tokens=skip, cluster_token=self.cluster_token, peer_address=request.peer_address,
                    peer_blocks=request.peer_blocks, lora=request.lora),
                    timeout=self.transfer.prefill_timeout_s, metadata=self.tracer.metadata(call))
            finally:
                call.end()
            arrival = self.receiver.take(rid)
            if arrival is None:
                raise KVTransferError(f"prefill worker at {prefill_address} answered but no KV arrived for {rid!r}")
            lp = logprob_from_proto(reply.logprob) if reply.HasField("logprob") else None
            prompt_lps = [logprob_from_proto(p) for p in reply.prompt_logprobs] \
                if params.prompt_logprobs is not None else None
            t_land = time.perf_counter()
            await self.engine.import_kv(rid, arrival.kv, reply.first_token, lp, prompt_lps, params.priority)
            self.tracer.record("kv.import", span, t_land, time.perf_counter(),
                               {"pdserve.kv_bytes": arrival.kv.numel() * arrival.kv.element_size(),
                                "pdserve.blocks": len(dest)})
        except grpc.aio.AioRpcError as e:
            await self._release(rid)
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise PrefillWorkerFull(refused_by(e)) from e  # back-pressure, not a fault: no recompute
            raise KVTransferError(f"prefill at {prefill_address} failed: {e.code().name}: {e.details()}") from e
        except BaseException:
            await self._release(rid)
            raise
        nbytes = arrival.kv.numel() * arrival.kv.element_size()
        if self.staged:  # rank 0's part of the hand-off: counted as the whole model's KV it is part of
            (ls, hs), layout = self.receiver.part, self.receiver.layout
            nbytes = nbytes * layout[0] * layout[3] // (len(ls) * len(hs))
        self.remote_prefills += 1
        self.blocks_received += len(dest)
        self.kv_bytes_received += nbytes
        self.request_kv_bytes[rid] = nbytes  # for its first response (the router's histograms)
        self.request_timing[rid] = pb.HandoffTiming(
            blocks_wait_s=blocks_wait_s, prefill_queue_s=reply.timing.prefill_queue_s,
            prefill_compute_s=reply.timing.prefill_compute_s, kv_push_s=reply.timing.kv_push_s)
        return True

    def trace_local_prefill(self, span, t_admit: float, t_first: float, first) -> None:
        """The spans of a prompt prefilled here: its wait for a place in the batch, then its compute."""
        t_scheduled = min(t_admit + first.queue_s, t_first)
        self.tracer.record("decode.queue", span, t_admit, t_scheduled)
        self.tracer.record("decode.local_prefill", span, t_scheduled, t_first,
                           {"pdserve.cached_tokens": first.num_cached_tokens})

    async def _release(self, rid: str) -> None:
        self.drop_lease(rid)
        await self.engine.abort_always(rid)

    def _prefill_stub(self, address: str) -> pb_grpc.PrefillServiceStub:
        stub = self._prefill_stubs.get(address)
        if stub is None:
            ch = open_channel(address, self.tls)
            self._channels.append(ch)
            stub = self._prefill_stubs[address] = pb_grpc.PrefillServiceStub(ch)
        return stub

    async def _reap_expired_leases(self, interval_s: float = 1.0) -> None:
        """Safety net: a lease past its deadline frees its blocks even if the request's own
        handler is stuck (its RPC timeout normally gets there first)."""
        while True:
            await asyncio.sleep(interval_s)
            for rid in self.receiver.expired():
                self.transfer_failures += 1
                await self.engine.abort_always(rid)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0, kv_port: int = 0) -> str:
        self.engine.start()
        self._reaper = asyncio.ensure_future(self._reap_expired_leases())
        if self.transfer.transport == "ucx":
            from pdserve.kv_transfer.ucx_transport import UcxKVServer
            self._kv_server = UcxKVServer(self.receiver, host, kv_port)
        else:
            self._kv_server = GrpcKVServer(self.receiver, host, kv_port, tls=self.tls)
        self.kv_address = await self._kv_server.start()
        if self.staged:
            meta = stages.serve_meta(host, self.engine.engine.loaded.fingerprint, self.cluster_token, self.tls,
                                     self.transfer.kv_dtype_mismatch == "convert")
            ranks = await self.engine.run(lambda e: e.kv_cache.serve_kv(meta, stages))
            self.kv_address = stages.stage_address([(*self.receiver.part, self.kv_address)] +
                                                   [(ls, hs, f"{host}:{port}") for ls, hs, port in ranks], host)
        self._server = grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self), self._server)
        serve_pulls(self._server, self, self.pulls)
        port = add_port(self._server, f"{host}:{port}", self.tls)
        await self._server.start()
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        await stop_tasks(self._reaper)
        for server in (self._server, self._kv_server):
            if server is not None:
                await server.stop(1.0)
        self._server = self._kv_server = None
        for ch in self._channels:
            await ch.close()
        await self.peer.close()
        self.engine.stop()
