"""KV transfer over UCX (ucxx): the same header, checks, leases and failure handling as the
gRPC transport, on a transport that uses RDMA / NVLink / shared memory where the hardware has
them and TCP elsewhere. Install with `pip install pdserve[ucx]` (PyPI `ucxx-cu12`, which also
runs CPU-only).

Frames on an endpoint: a 16-byte head (kind, length) then `length` bytes. A push is
HEADER (a `KVHeader`), answered at once with a REPLY (the receiver checks the header against
its lease before any payload memory is taken, so a refused push sends no data), then DATA
frames received straight into the payload buffer, then END, answered with the final REPLY
(size and checksum checked). One endpoint per decode worker, one push at a time on it.

UCX needs `UCX_TLS` to include `tcp` for its listener's connection handshake; `tcp,sm,self`
is set when the environment says nothing. There is no TLS on UCX: use it on a trusted fabric
(the cluster token is still checked on every push).
"""
from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import torch

from pdserve.common.aio import stop_tasks
from pdserve.common.errors import KVTransferError
from pdserve.protos import kv_transfer_pb2 as pb

from .base import HeaderSender
from .receiver import KVReceiver, PushAssembler

HEADER, DATA, END, REPLY = 1, 2, 3, 4
MAX_FRAME = 64 << 20    # larger frames are a protocol violation: the endpoint is dropped
MAX_HEADER = 1 << 20
SCHEME = "ucx://"


def _ucxx():
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx
    except ImportError as e:
        raise KVTransferError("the UCX transport needs ucxx: pip install 'pdserve[ucx]'") from e
    return ucxx


async def _send(ep, kind: int, payload=b"") -> None:
    data = np.frombuffer(payload, dtype=np.uint8) if len(payload) else None
    await ep.send(np.array([kind, 0 if data is None else data.nbytes], dtype=np.uint64))
    if data is not None:
        await ep.send(data)


async def _recv_head(ep) -> tuple[int, int]:
    head = np.empty(2, dtype=np.uint64)
    await ep.recv(head)
    return int(head[0]), int(head[1])


async def _recv_bytes(ep, n: int, into: memoryview | None = None) -> bytes | None:
    buf = np.frombuffer(into, dtype=np.uint8) if into is not None else np.empty(n, dtype=np.uint8)
    await ep.recv(buf)
    return None if into is not None else buf.tobytes()


async def _reply(ep, error: str = "", received: int = 0) -> None:
    await _send(ep, REPLY, pb.KVPushReply(ok=not error, error=error, bytes_received=received).SerializeToString())


class UcxKVServer:
    """Receives pushes for one decode worker's receiver on a UCX listener."""

    def __init__(self, receiver: KVReceiver, host: str = "127.0.0.1", port: int = 0, on_arrival=None):
        self.receiver, self.host, self.port, self.on_arrival = receiver, host, port, on_arrival
        self._listener = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{SCHEME}{self.host}:{self.port}"

    async def start(self) -> str:
        self._listener = _ucxx().create_listener(self._serve, port=self.port or None)
        self.port = self._listener.port
        return self.address

    async def _serve(self, ep) -> None:
        self._handlers.add(asyncio.current_task())
        try:
            while True:
                await self._one_push(ep)
        except Exception:  # noqa: BLE001 - peer closed, or broke the protocol: drop the endpoint
            pass
        finally:
            self._handlers.discard(asyncio.current_task())
            await ep.close()

    async def _one_push(self, ep) -> None:
        kind, n = await _recv_head(ep)
        if kind != HEADER or n > MAX_HEADER:
            raise ConnectionError(f"UCX KV push must start with a header frame (got kind {kind})")
        push = PushAssembler(self.receiver)
        try:
            push.start(pb.KVHeader.FromString(await _recv_bytes(ep, n)))
        except KVTransferError as e:
            await _reply(ep, str(e))
            return
        await _reply(ep)
        error = ""
        while True:
            kind, n = await _recv_head(ep)
            if kind == END:
                break
            if kind != DATA or n > MAX_FRAME:
                raise ConnectionError(f"bad UCX KV frame (kind {kind}, {n} bytes)")
            try:
                slot = None if error else push.slot(n)
            except KVTransferError as e:
                error, slot = str(e), None
            await _recv_bytes(ep, n, slot)  # a refused frame is still read (and dropped): the stream stays in step
        if not error:
            try:
                push.finish()
            except KVTransferError as e:
                error = str(e)
        await _reply(ep, error, push.received)
        if not error and self.on_arrival is not None:
            self.on_arrival()

    async def stop(self, grace: float = 1.0) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await stop_tasks(*self._handlers)


class UcxKVSender(HeaderSender):
    """Pushes KV blocks to decode workers over UCX; one endpoint per target, reused."""

    def __init__(self, sender_id: str, cluster_token: str = "", chunk_bytes: int = 16 << 20):
        self.sender_id, self.cluster_token, self.chunk_bytes = sender_id, cluster_token, chunk_bytes
        self._eps: dict[str, tuple[object, asyncio.Lock]] = {}

    async def _endpoint(self, target: str):
        if target not in self._eps:
            host, _, port = target.removeprefix(SCHEME).rpartition(":")
            ep = await _ucxx().create_endpoint(host, int(port))
            self._eps[target] = (ep, asyncio.Lock())
        return self._eps[target]

    async def push(self, target: str, request_id: str, kv: torch.Tensor, *, dest_block_ids: list[int],
                   num_tokens: int, first_token: int, model_fingerprint: str, timeout_s: float,
                   layer_start: int = 0, token_offset: int = 0, lora_identity: str = "",
                   head_start: int = 0, head_end: int = 0) -> None:
        header, payload = self.framed(request_id, kv, dest_block_ids=dest_block_ids, num_tokens=num_tokens,
                                      first_token=first_token, model_fingerprint=model_fingerprint,
                                      layer_start=layer_start, token_offset=token_offset,
                                      lora_identity=lora_identity, head_start=head_start, head_end=head_end)
        # the payload goes out as views of the tensor's memory: no copy on the way to UCX
        pieces = (payload[off:off + self.chunk_bytes] for off in range(0, len(payload), self.chunk_bytes))
        await self._guarded(target, self._push(target, header, pieces), timeout_s)

    async def push_chunks(self, target: str, chunks, timeout_s: float) -> None:
        """Send prepared `KVChunk`s, a header then data (tests use this to inject faults)."""
        async def frames():
            it = chunks.__aiter__() if hasattr(chunks, "__aiter__") else None
            while True:
                try:
                    yield await anext(it) if it is not None else next(chunks)
                except (StopIteration, StopAsyncIteration):
                    return

        async def run():
            header, data = None, []
            async for chunk in frames():
                if chunk.WhichOneof("kind") == "header" and header is None:
                    header = chunk.header
                    continue
                data.append(chunk.data if chunk.WhichOneof("kind") == "data" else b"")
            if header is None:
                raise KVTransferError("KV push must start with a header")
            await self._push(target, header, iter(data))
        await self._guarded(target, run(), timeout_s)

    async def _guarded(self, target: str, push, timeout_s: float) -> None:
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: it can drop a cancel on 3.11
                await push
        except KVTransferError:
            raise
        except asyncio.TimeoutError as e:
            await self._drop(target)  # the endpoint is mid-push: it cannot be reused
            raise KVTransferError(f"KV push to {target} timed out after {timeout_s:g}s") from e
        except Exception as e:  # noqa: BLE001 - any UCX failure is a failed hand-off
            await self._drop(target)
            if time.monotonic() - start >= timeout_s:
                raise KVTransferError(f"KV push to {target} timed out after {timeout_s:g}s") from e
            raise KVTransferError(f"KV push to {target} failed: {type(e).__name__}: {e}") from e

    async def _push(self, target: str, header: pb.KVHeader, pieces) -> None:
        ep, lock = await self._endpoint(target)
        async with lock:
            await _send(ep, HEADER, header.SerializeToString())
            await self._check_reply(ep, target)  # refused: no data is sent
            for piece in pieces:
                await _send(ep, DATA, piece)
            await _send(ep, END)
            await self._check_reply(ep, target)

    @staticmethod
    async def _check_reply(ep, target: str) -> None:
        kind, n = await _recv_head(ep)
        if kind != REPLY or n > MAX_HEADER:
            raise ConnectionError(f"unexpected frame from {target} (kind {kind})")
        reply = pb.KVPushReply.FromString(await _recv_bytes(ep, n))
        if not reply.ok:
            raise KVTransferError(reply.error)

    async def _drop(self, target: str) -> None:
        entry = self._eps.pop(target, None)
        if entry is not None:
            try:
                await entry[0].close()
            except Exception:  # noqa: BLE001 - already broken
                pass

    async def close(self) -> None:
        for target in list(self._eps):
            await self._drop(target)
