"""KV hand-off between groups of different shapes, each rank sending or receiving its own part.

A rank of a pipeline group (engine/parallel/pp.py) holds a rectangle of the whole model's KV:
its stage's layers and, under PP x TP, its KV heads of them. A decode pipeline's KV address
names every rank's rectangle and where that rank receives (`stage_address`):

    stages:10.0.0.5|0-3/0-2@7001;3-5/0-2@7002

(a port alone is on the host before the `|`; a whole address, e.g. a UCX one, also goes;
short enough for a registry record of 1,024 characters up to some 60 ranks)

and a sender, whatever its shape, sends each rank the piece of its own rectangle that rank
owns (`pieces`): a single engine or a TP group's rank 0 its whole KV cut by the address; a
prefill pipeline's ranks each their own layers and heads (`ship_part`, from their own
processes). No rank gathers the whole model's KV; a plain `host:port` address owns it all.

The decode pipeline's other ranks each serve `KVTransfer.Push` on a gRPC server of their
own (`StageEndpoint`) with a `StageReceiver`: the hand-off's checks and leases (rank 0 tells
them the lease, `expect`) for its rectangle alone; a push that comes before its lease waits
for it. The engine's ranks load this module by name (the engine may not import this layer).
"""
from __future__ import annotations

import json
import threading
from collections import deque
from concurrent import futures

import grpc
import torch

from pdserve.common.errors import KVTransferError
from pdserve.engine.kv import formats as kv_format
from pdserve.protos import kv_transfer_pb2 as pb
from pdserve.protos import kv_transfer_pb2_grpc as pb_grpc
from pdserve.protos.security import TLSConfig, add_port

from .grpc_transport import CHANNEL_OPTIONS, SERVER_OPTIONS
from .receiver import KVReceiver, PushAssembler
from .ucx_transport import SCHEME as UCX_SCHEME
from .wire import iter_chunks, make_header, tensor_bytes

SCHEME = "stages:"
LEASE_WAIT_S = 30.0  # how long a stage's push waits for its lease (rank 0 tells it between steps)


def stage_address(parts: list[tuple[range, range, str]], host: str) -> str:
    """The KV address of a group on `host` whose ranks receive (layers, KV heads, address) each."""
    def short(a: str) -> str:
        return a[len(host) + 1:] if a.startswith(host + ":") and a[len(host) + 1:].isdigit() else a
    return f"{SCHEME}{host}|" + ";".join(f"{ls.start}-{ls.stop}/{hs.start}-{hs.stop}@{short(a)}" for ls, hs, a in parts)


def targets(address: str, layers: int, heads: int) -> list[tuple[range, range, str]]:
    """(layers, KV heads, address) of each receiver `address` names (a plain one: all of them)."""
    if not address.startswith(SCHEME):
        return [(range(layers), range(heads), address)]
    host, _, parts = address[len(SCHEME):].partition("|")
    out = []
    for part in parts.split(";"):
        rect, _, addr = part.partition("@")
        (l0, l1), (h0, h1) = (tuple(int(x) for x in side.split("-")) for side in rect.split("/"))
        out.append((range(l0, l1), range(h0, h1), f"{host}:{addr}" if addr.isdigit() else addr))
    return out


def pieces(kv: torch.Tensor, layers: range, heads: range, address: str, shape: tuple[int, int]):
    """(address, piece, layer_start, head_start, head_end) for each receiver of `address` whose
    rectangle meets `kv`'s (layers `layers`, KV heads `heads` of the whole model's `shape` =
    (layers, heads)); head_start, head_end 0, 0: the piece holds every head."""
    for ls, hs, addr in targets(address, *shape):
        lo, hi = max(ls.start, layers.start), min(ls.stop, layers.stop)
        h0, h1 = max(hs.start, heads.start), min(hs.stop, heads.stop)
        if lo >= hi or h0 >= h1:
            continue
        piece = kv[lo - layers.start:hi - layers.start, :, :, :, h0 - heads.start:h1 - heads.start]
        whole = (h0, h1) == (0, shape[1])
        yield addr, piece.contiguous(), lo, 0 if whole else h0, 0 if whole else h1


# ---- a prefill pipeline's rank: its own part, pushed from its own process -----------------
_channels: dict[tuple[str, TLSConfig], grpc.Channel] = {}


def _channel(target: str, tls: TLSConfig) -> grpc.Channel:
    ch = _channels.get((target, tls))
    if ch is None:
        options = list(CHANNEL_OPTIONS)
        if tls.enabled:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            ch = grpc.secure_channel(target, tls.channel_credentials(), options=options)
        else:
            ch = grpc.insecure_channel(target, options=options)
        _channels[target, tls] = ch
    return ch


def ship_meta(tls: TLSConfig | None = None, **kw) -> str:
    """What a prefill pipeline's ranks need to push a request's KV (`ship_part`), as the JSON
    rank 0 sends them: target, request_id, dest_block_ids, num_tokens, first_token,
    token_offset, model_fingerprint, lora_identity, timeout_s, sender_id, cluster_token, tls
    (to present), wire (a KV format name to convert to; "": as the cache holds it)."""
    tls = tls or TLSConfig()
    return json.dumps(kw | {"tls": [tls.cert_file, tls.key_file, tls.ca_file, tls.server_name]})


def ship_part(kv: torch.Tensor, layers: range, heads: range, shape: tuple[int, int], meta: str) -> int:
    """Push this rank's KV `kv` (the whole model's layers `layers`, KV heads `heads`) to the
    receivers of meta's target that own parts of it, over gRPC; the bytes sent. Raises
    KVTransferError."""
    m = json.loads(meta)
    if m["wire"]:
        kv = kv_format.convert(kv, kv_format.FORMATS[m["wire"]])
    tls, sent = TLSConfig(*m["tls"]), 0
    for addr, piece, lo, h0, h1 in pieces(kv, layers, heads, m["target"], shape):
        if addr.startswith(UCX_SCHEME):
            raise KVTransferError(f"a pipeline stage pushes its KV over gRPC, not to {addr}")
        payload = tensor_bytes(piece)
        header = make_header(m["request_id"], piece, sender_id=m["sender_id"], model_fingerprint=m["model_fingerprint"],
                             dest_block_ids=m["dest_block_ids"], num_tokens=m["num_tokens"],
                             first_token=m["first_token"], payload=payload, layer_start=lo,
                             cluster_token=m["cluster_token"], token_offset=m["token_offset"],
                             lora_identity=m["lora_identity"], head_start=h0, head_end=h1)
        try:
            reply = pb_grpc.KVTransferStub(_channel(addr, tls)).Push(iter_chunks(header, payload),
                                                                      timeout=m["timeout_s"])
        except grpc.RpcError as e:
            raise KVTransferError(f"KV push to {addr} failed: {e.code().name}: {e.details()}") from e
        if not reply.ok:
            raise KVTransferError(reply.error)
        sent += len(payload)
    return sent


# ---- a decode pipeline's rank: its own receiver and server --------------------------------
class StageReceiver(KVReceiver):
    """A KVReceiver shared by a gRPC server's threads and the rank's main loop: a push waits
    (up to LEASE_WAIT_S) for its lease, and an arrival is taken by its destination blocks
    (`take_blocks`: rank 0's import names the blocks; a block is one live request's, so a new
    lease drops any older one on its blocks). A push for a lease dropped here fails at once."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.cond = threading.Condition(threading.RLock())
        self.dests: dict[str, list[int]] = {}
        self.dropped: deque[str] = deque(maxlen=1024)  # leases cancelled here: a late push is refused at once

    def expect(self, request_id: str, dest_block_ids: list[int], *args, **kw):
        with self.cond:
            for rid, blocks in list(self.dests.items()):
                if rid == request_id or set(blocks) & set(dest_block_ids):
                    self.cancel(rid)
            self.expired()
            lease = super().expect(request_id, dest_block_ids, *args, **kw)
            if request_id in self.dropped:
                self.dropped.remove(request_id)
            self.dests[request_id] = list(dest_block_ids)
            self.cond.notify_all()
            return lease

    def cancel(self, request_id: str) -> None:
        with self.cond:
            super().cancel(request_id)
            self.dests.pop(request_id, None)
            self.dropped.append(request_id)
            self.cond.notify_all()

    def check_header(self, h: pb.KVHeader):
        with self.cond:
            self.cond.wait_for(lambda: h.request_id in self._leases or h.request_id in self.dropped,
                               timeout=LEASE_WAIT_S)
            return super().check_header(h)

    def accept(self, h: pb.KVHeader, payload) -> None:
        with self.cond:  # checked and landed under the lock: a lease cancelled in between is not landed in
            super().accept(h, payload)
            self.cond.notify_all()

    def accept_tensor(self, h: pb.KVHeader, kv: torch.Tensor) -> None:
        with self.cond:
            super().accept_tensor(h, kv)
            self.cond.notify_all()

    def take_blocks(self, block_ids: list[int], timeout_s: float):
        """The arrival whose destination blocks are `block_ids` (None: none came in time)."""
        with self.cond:
            rid = next((r for r, b in self.dests.items() if b == list(block_ids)), None)
            if rid is None or not self.cond.wait_for(lambda: any(a.request_id == rid for a in self._ready),
                                                     timeout=timeout_s):
                return None
            self.dests.pop(rid)
            return self.take(rid)


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: StageReceiver):
        self.receiver = receiver

    def Push(self, request_iterator, context):
        push = PushAssembler(self.receiver)
        try:
            for chunk in request_iterator:
                push.chunk(chunk)
            push.finish()
        except KVTransferError as e:
            return pb.KVPushReply(ok=False, error=str(e), bytes_received=push.received)
        return pb.KVPushReply(ok=True, bytes_received=push.received)


def serve_meta(host: str, fingerprint: str, cluster_token: str, tls: TLSConfig | None, convert: bool) -> str:
    """What a decode pipeline's ranks need to serve their pushes (`StageEndpoint`), as JSON."""
    tls = tls or TLSConfig()
    return json.dumps({"host": host, "fingerprint": fingerprint, "cluster_token": cluster_token, "convert": convert,
                       "tls": [tls.cert_file, tls.key_file, tls.ca_file, tls.server_name]})


class StageEndpoint:
    """A decode pipeline rank's receiver of its rectangle (layers, heads of the whole model's
    `layout`) behind a gRPC server on meta's host; `port` once started."""

    def __init__(self, meta: str, layout: tuple[int, ...], dtype: str, part: tuple[range, range]):
        m = json.loads(meta)
        self.receiver = StageReceiver(m["fingerprint"], layout, dtype, m["cluster_token"], convert=m["convert"],
                                      part=part)
        self.server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="pdserve-stage-kv"),
                                  options=SERVER_OPTIONS)
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self.receiver), self.server)
        self.port = add_port(self.server, f"{m['host']}:0", TLSConfig(*m["tls"]))
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)

