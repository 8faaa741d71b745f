"""Peer prefix pulls: a worker pulls the KV of a prompt's prefix from another worker holding it.

In: the router's hint in a request (`GenerateRequest.peer_address`/`peer_blocks`, passed on
to a prefill worker in `PrefillRequest`): a peer whose pool or tiers hold more of the prompt's
leading blocks than this worker. Out: those blocks cached in this worker's pool before the
request is scheduled, so it starts from them as from any prefix hit.

The puller (`PeerPuller.pull`) reserves the blocks the KV lands in (engine/kv/peer.py),
decides from its running estimates whether the pull beats computing (pull_decision.py), and
calls `KVTransfer.Pull` on the peer's service address with the blocks' content hashes, which
it computed from its own prompt and cache salt. The peer (`PeerKVServicer`, served beside
each worker's service) answers with the leading blocks it holds as a KV push: a `KVHeader`
carrying the hashes it sent, its cluster token and the payload's CRC, then 1 MiB chunks. The
answer goes through the hand-off's own checks (`KVReceiver`: token, model, layout, sizes,
checksum) plus the hashes; anything that fails or outlasts `peer_timeout_s` releases the
blocks uncached and the request computes its prefix, as without a peer.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from functools import partial
from operator import methodcaller

import grpc

from pdserve.common.block_hash import root_hash
from pdserve.common.errors import InvalidRequestError, KVTransferError
from pdserve.engine.kv.peer import PULL_OWNER, PullSlot, export_by_hash, install_pull, reserve_pull
from pdserve.protos import kv_transfer_pb2 as pb
from pdserve.protos import kv_transfer_pb2_grpc as pb_grpc
from pdserve.protos.security import SecurityConfig, open_channel

from .config import TransferConfig
from .grpc_transport import CHANNEL_OPTIONS
from .pull_decision import RunningRate, pull_or_compute
from .receiver import KVReceiver, PushAssembler
from .wire import iter_chunks, make_header, tensor_bytes

log = logging.getLogger("pdserve.kv_transfer")


@dataclass
class PullCounters:
    """A worker's pulls, as the puller and as the peer (its Stats' `peer_*` fields)."""

    pulls: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    failures: int = 0
    misses: int = 0  # the peer no longer held the blocks (the router's view lags its KV events)
    skipped: int = 0
    blocks_served: int = 0
    bytes_served: int = 0

    def stats(self) -> dict[str, int]:
        return dict(peer_pulls=self.pulls, peer_blocks_pulled=self.blocks_pulled, peer_bytes_pulled=self.bytes_pulled,
                    peer_pull_failures=self.failures, peer_pull_skipped=self.skipped,
                    peer_blocks_served=self.blocks_served, peer_bytes_served=self.bytes_served,
                    peer_pull_misses=self.misses)


class PeerKVServicer(pb_grpc.KVTransferServicer):
    """`KVTransfer.Pull` on a worker's service port: the leading blocks of the hashes asked for
    that its engine holds (pool or tiers), to a caller with the cluster token running the same
    model. (`Push` is served on a decode worker's own KV port, not here.)"""

    def __init__(self, engine, worker_id: str, cluster_token: str, counters: PullCounters):
        self.engine, self.worker_id, self.cluster_token, self.counters = engine, worker_id, cluster_token, counters

    async def Pull(self, request: pb.KVPullRequest, context):
        if not hmac.compare_digest(request.cluster_token.encode(), self.cluster_token.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
        e = self.engine.engine
        fingerprint, bs = e.loaded.fingerprint, e.blocks.block_size
        if request.model_fingerprint != fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another model's KV")
        hashes = list(request.block_hashes)
        if (not hashes or len(request.dest_block_ids) != len(hashes) or request.block_size != bs
                or request.token_offset < 0 or request.token_offset % bs):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a pull names blocks, their destinations "
                                f"(as many) and a first token at a block boundary (block size {bs})")
        found, kv = await self.engine.run(partial(export_by_hash, hashes=hashes))
        if not found:
            await context.abort(grpc.StatusCode.NOT_FOUND, "none of the blocks is held here")
        payload = tensor_bytes(kv)
        header = make_header(request.request_id, kv, sender_id=self.worker_id, model_fingerprint=fingerprint,
                             dest_block_ids=list(request.dest_block_ids[:len(found)]), first_token=0,
                             num_tokens=request.token_offset + len(found) * bs, payload=payload,
                             cluster_token=self.cluster_token, token_offset=request.token_offset)
        header.block_hashes.extend(found)
        async for chunk in self.chunks(header, payload):
            yield chunk
        self.counters.blocks_served += len(found)
        self.counters.bytes_served += len(payload)

    async def chunks(self, header: pb.KVHeader, payload: memoryview):
        """The answer's messages (a test's peer alters them to inject faults)."""
        for chunk in iter_chunks(header, payload):
            yield chunk


def serve_pulls(server: grpc.aio.Server, worker, counters: PullCounters) -> None:
    """Add `KVTransfer.Pull` for `worker` (its engine, id and cluster token) to its gRPC server."""
    pb_grpc.add_KVTransferServicer_to_server(
        PeerKVServicer(worker.engine, worker.worker_id, worker.cluster_token, counters), server)


class PeerPuller:
    """A worker's puller: its estimates, its own receiver (leases apart from the hand-off's),
    one channel per peer."""

    def __init__(self, engine, worker_id: str, transfer: TransferConfig, security: SecurityConfig,
                 counters: PullCounters):
        eng = engine.engine
        self.engine, self.worker_id, self.transfer, self.counters = engine, worker_id, transfer, counters
        self.tls, self.cluster_token = security.tls, security.cluster_token
        self.fingerprint, self.block_size = eng.loaded.fingerprint, eng.blocks.block_size
        self.block_bytes = eng.kv_cache.bytes_per_block
        self.receiver = KVReceiver(self.fingerprint, eng.kv_cache.layout, eng.kv_cache.format.name, self.cluster_token)
        self.transfer_rate = RunningRate(transfer.peer_gbps * 1e9)  # bytes/s, end to end
        self.prefill_rate = RunningRate(transfer.peer_prefill_tokens_per_s)  # computed prompt tokens/s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill here computed `tokens` prompt tokens in `seconds`. One of fewer than two
        blocks' tokens is left out: its time is the step's overhead, not a rate."""
        if tokens >= 2 * self.block_size:
            self.prefill_rate.observe(tokens, seconds)

    async def pull(self, request_id: str, prompt: list[int], cache_salt: str, peer_address: str,
                   peer_blocks: int, lora: str = "") -> int:
        """Pull the prompt's leading `peer_blocks` blocks that are not cached here from the peer
        at `peer_address` into this worker's prefix cache, if that is expected to be faster
        than computing them; returns the blocks installed (0: the prompt computes them). A
        failure is counted and logged, never raised; a cancel leaves no block taken. `lora`:
        the request's adapter ("": the base model): the hashes chain from its identity here,
        as they do on the peer, so only blocks computed under the same adapter match."""
        if self.transfer.peer_pull == "off" or not peer_address or peer_blocks <= 0:
            return 0
        installed = 0
        try:
            root = await self.engine.run(methodcaller("cache_root", cache_salt, lora or None)) if lora \
                else root_hash(cache_salt)
        except InvalidRequestError:  # an adapter unknown here: the request itself is refused
            return 0
        try:
            slot = await self.engine.run(partial(reserve_pull, request_id=request_id, prompt=prompt, root=root,
                                                 peer_blocks=peer_blocks))
            if slot is None or not self._worth_it(len(slot.hashes)):
                return 0
            t0 = time.perf_counter()
            kv = await self._fetch(request_id, slot, peer_address)
            nbytes = kv.numel() * kv.element_size()
            self.transfer_rate.observe(nbytes, time.perf_counter() - t0)
            installed = await self.engine.run_always(partial(install_pull, slot=slot, kv=kv, prompt=prompt, root=root))
        except (KVTransferError, grpc.aio.AioRpcError, TimeoutError) as e:
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.NOT_FOUND:
                self.counters.misses += 1
                return 0
            self.counters.failures += 1
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e) or repr(e)
            log.warning("peer pull of %s from %s failed, computing it instead: %s", request_id, peer_address, why)
            return 0
        finally:
            self.receiver.cancel(request_id)
            if not installed:  # ordered after the reserve; a no-op when nothing was taken
                self.engine.call(partial(_release, owner=PULL_OWNER + request_id))
        self.counters.pulls += 1
        self.counters.blocks_pulled += installed
        self.counters.bytes_pulled += nbytes
        return installed

    def _worth_it(self, blocks: int) -> bool:
        if self.transfer.peer_pull == "always":
            return True
        choice = pull_or_compute(blocks, self.block_bytes, self.block_size, self.transfer_rate.value,
                                 self.prefill_rate.value)
        if not choice.pull:
            self.counters.skipped += 1
        return choice.pull

    async def _fetch(self, request_id: str, slot: PullSlot, peer_address: str):
        """The peer's answer, checked like a hand-off's push (and its hashes); raises
        KVTransferError, AioRpcError or TimeoutError."""
        first, n, bs = slot.first_block * self.block_size, len(slot.hashes), self.block_size
        self.receiver.expect(request_id, list(slot.dest_block_ids), first + n * bs, self.transfer.peer_timeout_s,
                             first_token_index=first, block_hashes=list(slot.hashes))
        request = pb.KVPullRequest(request_id=request_id, puller_id=self.worker_id, cluster_token=self.cluster_token,
                                   model_fingerprint=self.fingerprint, block_hashes=slot.hashes,
                                   dest_block_ids=slot.dest_block_ids, token_offset=first, block_size=bs)
        push = PushAssembler(self.receiver)
        async with asyncio.timeout(self.transfer.peer_timeout_s):
            async for chunk in self._stub(peer_address).Pull(request, timeout=self.transfer.peer_timeout_s):
                if chunk.WhichOneof("kind") == "header":
                    self._narrow(request_id, slot, chunk.header)
                    push.start(chunk.header)
                else:
                    push.data(chunk.data)
        push.finish()
        arrival = self.receiver.take(request_id)
        if arrival is None:
            raise KVTransferError(f"peer at {peer_address} answered the pull of {request_id!r} without its blocks")
        return arrival.kv

    def _narrow(self, request_id: str, slot: PullSlot, header: pb.KVHeader) -> None:
        """The peer holds only the first k of the blocks asked for (evicted since the router
        heard of them): lease those k alone. Anything else is left to the lease's checks."""
        k = len(header.block_hashes)
        if 0 < k < len(slot.hashes) and tuple(header.block_hashes) == slot.hashes[:k]:
            first = slot.first_block * self.block_size
            self.receiver.expect(request_id, list(slot.dest_block_ids[:k]), first + k * self.block_size,
                                 self.transfer.peer_timeout_s, first_token_index=first,
                                 block_hashes=list(slot.hashes[:k]))

    def _stub(self, address: str) -> pb_grpc.KVTransferStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, self.tls, CHANNEL_OPTIONS)
        return pb_grpc.KVTransferStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


def _release(e, owner: str) -> None:
    e.blocks.free(owner)
