"""The prefill service: compute a prompt's KV, sample the first token, push the blocks.

`Prefill` runs the prompt through this worker's engine as a one-token request whose blocks
are held after it finishes, exports them, pushes them into the decode worker's destination
blocks, then frees its own copy (the full blocks stay in its prefix cache for later hits).
A pipeline-parallel engine does not export: each of its ranks pushes its own layers (and
heads) from its own process (`_ship`, engine/parallel/pp_handoff.py), once the pass is through.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import grpc

from pdserve.engine.kv import formats as kv_format
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.parallel.pp import PPKVCache
from pdserve.common.errors import InvalidRequestError, KVTransferError
from pdserve.kv_transfer import stages
from pdserve.kv_transfer.base import KVSender
from pdserve.kv_transfer.ucx_transport import SCHEME as UCX_SCHEME
from pdserve.kv_transfer.peer import PeerPuller, PullCounters, serve_pulls
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.kv_transfer.config import TransferConfig
from pdserve.protos.convert import logprob_to_proto, params_from_proto
from pdserve.protos.security import SecurityConfig, add_port
from pdserve.protos.servicer import WorkerServicer
from pdserve.protos.status import refuse_invalid, refuse_when_full
from pdserve.protos.tracing import OFF, Tracer
from pdserve.kv_transfer.adapters import AdapterServicer


class PrefillServicer(AdapterServicer, WorkerServicer, pb_grpc.PrefillServiceServicer):
    role = "prefill"

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillReply:
        w = self.w
        await self.check_token(request.cluster_token, context)
        if w.draining or (w.max_queue and w.inflight >= w.max_queue):
            w.refused += 1
            await refuse_when_full(context, w.worker_id, "prefill worker", w.max_queue,
                                   "draining" if w.draining else "")
        span = w.tracer.start("prefill", w.tracer.extract(context.invocation_metadata()), kind="server",
                              attributes={"pdserve.request_id": request.request_id, "pdserve.worker_id": w.worker_id,
                                          "pdserve.prompt_tokens": len(request.prompt_token_ids)})
        w.inflight += 1
        try:
            return await self._prefill(request, context, span)
        except BaseException as e:
            span.record_error(repr(e))
            raise
        finally:
            w.inflight -= 1
            span.end()

    async def _prefill(self, request: pb.PrefillRequest, context, span) -> pb.PrefillReply:
        w = self.w
        t_start = time.perf_counter()
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        asked = params_from_proto(request.params)
        # one token here; below min_tokens it must not be EOS or a stop token id (masked, so kept)
        params = dataclasses.replace(asked, max_tokens=1, min_tokens=min(asked.min_tokens, 1),
                                     stop_token_ids=asked.stop_token_ids if asked.min_tokens else [])
        lora = request.lora or None  # its adapter: the KV pushed is computed under it, and says so
        try:
            identity = await w.engine.run(lambda e: e.loras.identity(lora)) if lora else ""
        except InvalidRequestError as e:  # an adapter unknown here
            await refuse_invalid(context, e)
        if asked.prompt_logprobs is None:  # a peer's blocks of the prompt's prefix, if the router named one
            await w.peer.pull(rid, prompt, asked.cache_salt, request.peer_address, request.peer_blocks, request.lora)
        t_pulled = time.perf_counter()
        bs = w.engine.engine.blocks.block_size
        # the decode worker holds the prompt's first skip_tokens (its cached prefix): send the
        # KV from the block holding the first token it awaits, in this worker's block size
        first_block = min(max(request.skip_tokens, 0), max(len(prompt) - 1, 0)) // bs

        async def push(kv, layer_start: int = 0, first_token: int = 0):
            t = time.perf_counter()
            if w.wire_format is not None:  # off the event loop: torch releases the GIL
                kv = await asyncio.to_thread(kv_format.convert, kv, w.wire_format)
            await w.sender.push(request.kv_address, rid, kv, dest_block_ids=list(request.dest_block_ids),
                                num_tokens=len(prompt), first_token=first_token, token_offset=first_block * bs,
                                layer_start=layer_start, model_fingerprint=w.fingerprint, lora_identity=identity,
                                timeout_s=request.timeout_s or 30.0)
            t_end, nbytes = time.perf_counter(), kv.numel() * kv.element_size()
            w.kv_seconds += t_end - t
            w.kv_bytes += nbytes
            w.tracer.record("kv.push", span, t, t_end, {"pdserve.kv_bytes": nbytes, "pdserve.layer_start": layer_start,
                                                        "pdserve.kv_address": request.kv_address})
        pushes: list[asyncio.Future] = []
        loop = asyncio.get_running_loop()

        def on_layers(start: int, end: int, kv) -> None:  # on the engine thread, mid-forward
            loop.call_soon_threadsafe(lambda: pushes.append(asyncio.ensure_future(push(kv, start))))
        shipped: KVTransferError | None = None
        # by parts, each rank from its own process (over gRPC: to a UCX address rank 0 pushes the whole)
        staged = w.staged and UCX_SCHEME not in request.kv_address
        try:
            if w.layer_group and not staged:  # each group of layers leaves while the next ones compute
                await w.engine.stream_kv_layers(rid, on_layers, w.layer_group, first_block)
            first = None
            try:  # held from the moment the request finishes, even if cancelled before the loop ends
                try:
                    async for out in _generate(w.engine, rid, prompt, params, lora):
                        if out.error:
                            raise InvalidRequestError(out.error, param="response_format",
                                                      code="grammar_budget_exceeded")
                        first = out
                except InvalidRequestError as e:
                    await refuse_invalid(context, e)
                t_computed = time.perf_counter()
                if staged:  # while its blocks are held
                    shipped = await self._ship(request, rid, first.new_token_ids[0], first_block * bs, identity, span)
                elif not w.layer_group:
                    _, kv = await w.engine.export_kv(rid)
            finally:  # also when the client goes while the engine thread is in a step
                await w.engine.release_kv(rid)
            try:
                if shipped is not None:
                    raise shipped
                if w.layer_group and not staged:
                    for result in await asyncio.gather(*pushes, return_exceptions=True):
                        if isinstance(result, BaseException):
                            raise result
                elif not staged:
                    await push(kv[:, :, first_block:].contiguous() if first_block else kv, 0, first.new_token_ids[0])
            except KVTransferError as e:
                w.transfer_failures += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:  # a failed or cancelled prefill leaves no push and no stream registration behind
            for t in pushes:
                t.cancel()
            if w.layer_group and not staged:
                await w.engine.stop_kv_stream(rid)
        w.stream_pushes += len(pushes)
        w.prefills += 1
        w.peer.observe_prefill(len(prompt) - first.num_cached_tokens, t_computed - t_pulled - first.queue_s)
        timing = pb.HandoffTiming(prefill_queue_s=first.queue_s, kv_push_s=time.perf_counter() - t_computed,
                                  prefill_compute_s=max(t_computed - t_start - first.queue_s, 0.0))
        w.tracer.record("prefill.queue", span, t_start, t_start + first.queue_s)
        w.tracer.record("prefill.compute", span, t_start + first.queue_s, t_computed,
                        {"pdserve.cached_tokens": first.num_cached_tokens,
                         "pdserve.computed_tokens": len(prompt) - first.num_cached_tokens})
        reply = pb.PrefillReply(first_token=first.new_token_ids[0], num_cached_tokens=first.num_cached_tokens,
                                timing=timing)
        if first.logprobs:
            reply.logprob.CopyFrom(logprob_to_proto(first.logprobs[0]))
        reply.prompt_logprobs.extend(logprob_to_proto(lp) for lp in first.prompt_logprobs or [])
        return reply

    async def _ship(self, request, rid: str, first_token: int, token_offset: int, identity: str,
                    span) -> KVTransferError | None:
        """A pipeline's hand-off: each of its ranks pushes its own part of the held request's
        blocks from the one holding token `token_offset` on; the failure, if one failed."""
        w = self.w
        meta = stages.ship_meta(
            target=request.kv_address, request_id=rid, dest_block_ids=list(request.dest_block_ids),
            num_tokens=len(request.prompt_token_ids), first_token=first_token, token_offset=token_offset,
            model_fingerprint=w.fingerprint, lora_identity=identity, timeout_s=request.timeout_s or 30.0,
            sender_id=w.worker_id, cluster_token=w.cluster_token, tls=w.tls,
            wire=w.wire_format.name if w.wire_format is not None else "")
        first_block, t = token_offset // w.engine.engine.blocks.block_size, time.perf_counter()
        try:
            nbytes = await w.engine.run(lambda e: e.kv_cache.ship(e.blocks.block_table(rid)[first_block:], meta,
                                                                  stages), request_id=rid)
        except KVTransferError as e:
            return e
        t_end = time.perf_counter()
        w.kv_seconds += t_end - t
        w.kv_bytes += nbytes
        w.tracer.record("kv.push", span, t, t_end,
                        {"pdserve.kv_bytes": nbytes, "pdserve.kv_address": request.kv_address})
        return None


async def _generate(engine: AsyncEngine, rid: str, prompt: list[int], params, lora: str | None):
    """`AsyncEngine.generate(..., hold_kv=True)` under adapter `lora`: a request that is left
    early (or refused) is aborted, its blocks and adapter given back."""
    q = engine.open_stream(rid)
    streaming = False
    try:
        await engine.add_request(rid, prompt, params, hold_kv=True, lora=lora)
        streaming = True
        async for out in engine.stream(rid, q):
            yield out
    finally:
        if not streaming:
            engine.abort_soon(rid)
        engine.close_stream(rid)


class PrefillWorker:
    """One prefill engine behind a gRPC `PrefillService`."""

    _ids = itertools.count()

    def __init__(self, engine: AsyncEngine, sender: KVSender, worker_id: str | None = None, max_queue: int = 0,
                 transfer: TransferConfig = TransferConfig(), security: SecurityConfig = SecurityConfig(),
                 tracer: Tracer = OFF):
        """transfer.layer_group > 0: stream each prompt's KV to the decode worker every that
        many layers, as they are computed (transfer overlaps compute; in a tensor-parallel
        group each push gathers the ranks' heads); 0: after the whole prompt.
        transfer.wire_dtype: "auto" sends the blocks as the cache holds them, another converts
        them for the transfer only.
        max_queue > 0: at most this many prompts queued or prefilling here; more are
        refused with RESOURCE_EXHAUSTED (the router tries another worker, then answers 429).
        security: the cluster token every call must carry and the internal TLS.
        tracer: where this worker's spans go (its owner shuts it down)."""
        self.engine = engine
        self.tracer = tracer
        self.max_queue = max_queue
        self.inflight = self.refused = 0
        self.draining = False  # set when the pool shrinks: refuse new prompts, finish the rest
        self.tls, self.cluster_token = security.tls, security.cluster_token
        self.layer_group = transfer.layer_group
        self.staged = isinstance(engine.engine.kv_cache, PPKVCache)  # each rank pushes its own part
        wire = transfer.wire_dtype
        self.wire_format = None if wire == "auto" else kv_format.FORMATS[kv_format.CHOICES[wire]]
        self.stream_pushes = 0  # layer-range pushes sent (layer-wise streaming)
        self.kv_bytes, self.kv_seconds = 0, 0.0  # pushed, and time spent pushing
        self.sender = sender
        self.worker_id = worker_id or f"prefill-{next(self._ids)}"
        self.fingerprint = engine.engine.loaded.fingerprint
        self.prefills = 0
        self.transfer_failures = 0
        self._server: grpc.aio.Server | None = None
        self.address = ""
        self.pulls = PullCounters()  # prefix blocks pulled from peers, and served to them
        self.peer = PeerPuller(engine, self.worker_id, transfer, security, self.pulls)

    def forget(self, request_id: str) -> None:
        """Nothing of an aborted request is kept outside the engine here."""

    def counters(self) -> dict:
        """This worker's counters in its Stats."""
        return dict(remote_prefills=self.prefills, transfer_failures=self.transfer_failures, refused=self.refused,
                    queue_limit=self.max_queue, kv_bytes=self.kv_bytes, kv_seconds=self.kv_seconds,
                    **self.pulls.stats())

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.engine.start()
        self._server = grpc.aio.server()
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self), self._server)
        serve_pulls(self._server, self, self.pulls)
        port = add_port(self._server, f"{host}:{port}", self.tls)
        await self._server.start()
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(1.0)
            self._server = None
        await self.sender.close()
        await self.peer.close()
        self.engine.stop()
