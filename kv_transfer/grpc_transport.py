"""KV transfer over gRPC (grpc.aio): a client-streaming `Push` of a header and 1 MiB chunks.

The server refuses a push as early as it can: a header that matches no lease is rejected
before any data is read, and a stream that carries more bytes than the header announced is
cut off.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import torch

from pdserve.common.errors import KVTransferError
from pdserve.protos import kv_transfer_pb2 as pb
from pdserve.protos import kv_transfer_pb2_grpc as pb_grpc
from pdserve.protos.security import TLSConfig, add_port, open_channel

from .base import HeaderSender
from .receiver import KVReceiver, PushAssembler
from .wire import CHUNK_BYTES, iter_chunks

# senders may send messages up to 64 MiB; the server takes at most 8 data chunks' worth per
# message: gRPC buffers a whole message before the servicer sees its header (and checks the
# cluster token there), so this bounds what an unauthenticated peer can make it hold
MAX_MESSAGE_BYTES = 64 << 20
MAX_RECEIVE_BYTES = 8 * CHUNK_BYTES
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: KVReceiver, on_arrival):
        self.receiver = receiver
        self.on_arrival = on_arrival

    async def Push(self, request_iterator, context):
        push = PushAssembler(self.receiver)
        try:
            async for chunk in request_iterator:
                push.chunk(chunk)
            push.finish()
        except KVTransferError as e:
            return pb.KVPushReply(ok=False, error=str(e), bytes_received=push.received)
        if self.on_arrival is not None:
            self.on_arrival()
        return pb.KVPushReply(ok=True, bytes_received=push.received)


class GrpcKVServer:
    """Serves `KVTransfer` for one decode worker's receiver."""

    def __init__(self, receiver: KVReceiver, host: str = "127.0.0.1", port: int = 0, on_arrival=None,
                 tls: TLSConfig | None = None):
        self.receiver = receiver
        self.tls = tls
        self.host, self.port = host, port
        self.on_arrival = on_arrival
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Start serving; returns the bound address."""
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self.receiver, self.on_arrival), self._server)
        self.port = add_port(self._server, f"{self.host}:{self.port}", self.tls)
        await self._server.start()
        return self.address

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None


class GrpcKVSender(HeaderSender):
    """Pushes KV blocks to decode workers; one channel per target, reused."""

    def __init__(self, sender_id: str, cluster_token: str = "", chunk_bytes: int = CHUNK_BYTES,
                 tls: TLSConfig | None = None):
        self.sender_id = sender_id
        self.tls = tls
        self.cluster_token = cluster_token
        self.chunk_bytes = chunk_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, target: str) -> pb_grpc.KVTransferStub:
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = open_channel(target, self.tls, CHANNEL_OPTIONS)
        return pb_grpc.KVTransferStub(ch)

    async def push(self, target: str, request_id: str, kv: torch.Tensor, *, dest_block_ids: list[int],
                   num_tokens: int, first_token: int, model_fingerprint: str, timeout_s: float,
                   layer_start: int = 0, token_offset: int = 0, lora_identity: str = "",
                   head_start: int = 0, head_end: int = 0) -> None:
        header, payload = self.framed(request_id, kv, dest_block_ids=dest_block_ids, num_tokens=num_tokens,
                                      first_token=first_token, model_fingerprint=model_fingerprint,
                                      layer_start=layer_start, token_offset=token_offset,
                                      lora_identity=lora_identity, head_start=head_start, head_end=head_end)
        await self.push_chunks(target, iter_chunks(header, payload, self.chunk_bytes), timeout_s)

    async def push_chunks(self, target: str, chunks, timeout_s: float) -> None:
        """Send prepared chunks (tests use this to inject faults)."""
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s + 1.0):  # not wait_for: it can drop a cancel on 3.11
                reply = await self._stub(target).Push(chunks, timeout=timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            if time.monotonic() - start >= timeout_s:
                # with a streaming request the deadline can surface as DEADLINE_EXCEEDED or INTERNAL
                raise KVTransferError(f"KV push to {target} timed out after {timeout_s:g}s") from e
            raise KVTransferError(f"KV push to {target} failed: {e.code().name}: {e.details()}") from e
        if not reply.ok:
            raise KVTransferError(reply.error)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
