"""The decode side's view of incoming KV: leases and checks, no networking.

A decode worker calls `expect()` when it allocates a request's destination blocks; the lease
says exactly what may arrive (which blocks, how many tokens, from which senders, until when).
A transport hands each push to `accept()`, which refuses anything that does not match the
lease or whose checksum is wrong; complete arrivals wait in `take_ready()` for the worker's
step loop to import them. Leases past their deadline come out of `expired()` so the worker
can free the blocks and fail or recompute the request.
"""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.kv import formats as kv_format
from pdserve.common.errors import KVTransferError
from pdserve.protos import kv_transfer_pb2 as pb

from .relayout import reblock
from .wire import checksum, tensor_from_bytes


@dataclass
class Lease:
    request_id: str
    dest_block_ids: list[int]
    num_tokens: int
    deadline: float
    senders: frozenset[str] | None = None  # None: any sender that has the cluster token
    first_token_index: int = 0             # the blocks hold tokens [first_token_index, num_tokens)
    layers_done: set[tuple[int, int]] = field(default_factory=set)  # the (layer, KV head) cells filled
    buffer: torch.Tensor | None = None     # filled piece by piece (layer ranges, head ranges)
    block_hashes: tuple[int, ...] | None = None  # a peer pull's: the header must name exactly these
    lora_identity: str = ""                # the adapter the KV must be computed under ("": the base model)


@dataclass
class Arrival:
    request_id: str
    kv: torch.Tensor  # (layers, 2, n_blocks, block_size, n_kv_heads, row_width), in this cache's format
    first_token: int
    num_tokens: int


class KVReceiver:
    def __init__(self, model_fingerprint: str, layout: tuple[int, ...], dtype: str = "float32",
                 cluster_token: str = "", clock: Callable[[], float] = time.monotonic, convert: bool = True,
                 part: tuple[range, range] | None = None):
        """layout: this worker's (layers, 2, block_size, n_kv_heads, head_dim); dtype: its
        cache's KV format name (engine/kv_format.FORMATS). convert=False: KV in another
        format is refused instead of converted. part: the (layers, KV heads) of the whole
        model's that this receiver takes (one rank of a pipeline group, kv_transfer/stages.py;
        None: all); an arrival holds those alone."""
        self.fingerprint = model_fingerprint
        self.layout = tuple(layout)
        self.part = part or (range(layout[0]), range(layout[3]))
        self.format = kv_format.FORMATS[dtype]
        self.cluster_token = cluster_token
        self.clock = clock
        self.convert = convert
        self._leases: dict[str, Lease] = {}
        self._ready: list[Arrival] = []

    def expect(self, request_id: str, dest_block_ids: list[int], num_tokens: int, timeout_s: float,
               senders: set[str] | None = None, first_token_index: int = 0,
               block_hashes: list[int] | None = None, lora_identity: str = "") -> Lease:
        """Lease `dest_block_ids` for the KV of tokens [first_token_index, num_tokens) (the
        tokens before are this worker's cached prefix). `block_hashes` (a peer pull): the
        content hashes the blocks must hold, which the arriving header must name exactly.
        `lora_identity`: the LoRA adapter (name@digest) the request runs under here; KV computed
        under another adapter, or the base model, is refused (it is not this request's KV)."""
        lease = Lease(request_id, list(dest_block_ids), num_tokens, self.clock() + timeout_s,
                      frozenset(senders) if senders else None, first_token_index,
                      block_hashes=tuple(block_hashes) if block_hashes is not None else None,
                      lora_identity=lora_identity)
        self._leases[request_id] = lease
        return lease

    def cancel(self, request_id: str) -> None:
        """Drop a lease (the request was aborted); a later push for it is refused."""
        self._leases.pop(request_id, None)
        self._ready = [a for a in self._ready if a.request_id != request_id]

    def pending(self) -> list[str]:
        return list(self._leases)

    def expired(self) -> list[str]:
        """Remove and return the leases whose deadline has passed."""
        now = self.clock()
        gone = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for rid in gone:
            del self._leases[rid]
        return gone

    def take_ready(self) -> list[Arrival]:
        ready, self._ready = self._ready, []
        return ready

    def take(self, request_id: str) -> Arrival | None:
        """Remove and return one request's complete arrival, if it is here."""
        for i, a in enumerate(self._ready):
            if a.request_id == request_id:
                return self._ready.pop(i)
        return None

    # ---- checks -------------------------------------------------------------------------
    def check_header(self, h: pb.KVHeader) -> Lease:
        """Raise KVTransferError unless the header matches a live lease exactly."""
        if not hmac.compare_digest(h.cluster_token.encode(), self.cluster_token.encode()):
            raise KVTransferError("KV push refused: wrong or missing cluster token")
        lease = self._leases.get(h.request_id)
        if lease is None:
            raise KVTransferError(f"KV push for unknown or expired request {h.request_id!r}")
        if lease.deadline <= self.clock():
            raise KVTransferError(f"KV push for {h.request_id!r} arrived after its lease expired")
        if lease.senders is not None and h.sender_id not in lease.senders:
            raise KVTransferError(f"KV push for {h.request_id!r} from unexpected sender {h.sender_id!r}")
        if h.lora_identity != lease.lora_identity:
            raise KVTransferError(f"KV push for {h.request_id!r} was computed under adapter "
                                  f"{h.lora_identity or '(base model)'!r}, not this request's "
                                  f"{lease.lora_identity or '(base model)'!r}")
        if h.model_fingerprint != self.fingerprint:
            raise KVTransferError(f"KV push for {h.request_id!r}: model fingerprint {h.model_fingerprint!r} "
                                  f"does not match this worker's {self.fingerprint!r}")
        src = kv_format.FORMATS.get(h.dtype)  # another format than this cache's is converted as it lands
        if src is None:
            raise KVTransferError(f"KV push for {h.request_id!r}: dtype {h.dtype!r} is not a KV format "
                                  f"({', '.join(kv_format.FORMATS)}); this cache holds {self.format.name}")
        if src is not self.format and not self.convert:
            raise KVTransferError(f"KV push for {h.request_id!r}: {h.dtype} KV, but this worker's cache holds "
                                  f"{self.format.name} and converts none (--kv-dtype-mismatch refuse)")
        if h.kv_scales != src.scale_layout:
            raise KVTransferError(f"KV push for {h.request_id!r}: {h.dtype} KV with scale layout {h.kv_scales!r}; "
                                  f"this worker reads {src.scale_layout or 'no scales'!r} for it")
        _, two, _, heads, hd = self.layout
        own_l, own_h = self.part
        hs, he = (h.head_start, h.head_end) if h.head_end else (0, heads)
        src_bs = h.layout[2] if len(h.layout) == 5 else 0  # the sender's block size may differ from ours
        same_shape = tuple(h.layout[:2]) + tuple(h.layout[3:]) == (h.layer_end - h.layer_start, two, he - hs, hd)
        if len(h.layout) != 5 or not same_shape or not 0 < src_bs <= 4096 or \
                not own_l.start <= h.layer_start < h.layer_end <= own_l.stop or not own_h.start <= hs < he <= own_h.stop:
            raise KVTransferError(f"KV push for {h.request_id!r}: layout {tuple(h.layout)} layers "
                                  f"[{h.layer_start}, {h.layer_end}) heads [{hs}, {he}) does not fit this cache "
                                  f"{self.layout} (layers [{own_l.start}, {own_l.stop}), heads [{own_h.start}, "
                                  f"{own_h.stop}) here)")
        if list(h.dest_block_ids) != lease.dest_block_ids or h.num_tokens != lease.num_tokens:
            raise KVTransferError(f"KV push for {h.request_id!r}: blocks/tokens do not match the lease")
        if lease.block_hashes is not None and tuple(h.block_hashes) != lease.block_hashes:
            raise KVTransferError(f"KV pull for {h.request_id!r}: the blocks' hashes are not the prompt's "
                                  f"(another prefix or cache salt)")
        # the payload starts at the sender's block boundary at or before the first token awaited
        first = lease.first_token_index
        if h.token_offset % src_bs or not first - src_bs < h.token_offset <= first:
            raise KVTransferError(f"KV push for {h.request_id!r}: starts at token {h.token_offset}, but the blocks "
                                  f"await tokens from {lease.first_token_index} (sender block size {src_bs})")
        expected = (h.layer_end - h.layer_start) * two * self._src_blocks(h) * src_bs * (he - hs) * src.bytes_per_row(hd)
        if h.payload_bytes != expected:
            raise KVTransferError(f"KV push for {h.request_id!r}: payload of {h.payload_bytes} bytes, expected {expected}")
        return lease

    def accept(self, h: pb.KVHeader, payload: bytes | bytearray) -> None:
        """Check a complete push (header, payload bytes, checksum) and file it."""
        self.check_header(h)
        if len(payload) != h.payload_bytes:
            raise KVTransferError(f"KV push for {h.request_id!r} truncated: {len(payload)} of {h.payload_bytes} bytes")
        if checksum(payload) != h.checksum:
            raise KVTransferError(f"KV push for {h.request_id!r}: checksum mismatch (corrupted in transit)")
        self._land(h, tensor_from_bytes(payload, h.dtype, self._shape(h)))

    def accept_tensor(self, h: pb.KVHeader, kv: torch.Tensor) -> None:
        """In-process arrival: the same checks except the checksum (nothing crossed a wire)."""
        self.check_header(h)
        shape = self._shape(h)
        if tuple(kv.shape) != shape or kv.dtype != kv_format.FORMATS[h.dtype].dtype:
            raise KVTransferError(f"KV push for {h.request_id!r}: tensor {kv.dtype} {tuple(kv.shape)}, "
                                  f"expected {h.dtype} {shape}")
        self._land(h, kv)

    @classmethod
    def _shape(cls, h: pb.KVHeader) -> tuple[int, ...]:
        """The payload tensor's shape: (layers, 2, blocks, block_size, heads, row_width)."""
        width = kv_format.FORMATS[h.dtype].row_width(h.layout[4])
        return (h.layer_end - h.layer_start, 2, cls._src_blocks(h), h.layout[2], h.layout[3], width)

    @staticmethod
    def _src_blocks(h: pb.KVHeader) -> int:
        return -(-(h.num_tokens - h.token_offset) // h.layout[2])

    def _land(self, h: pb.KVHeader, kv: torch.Tensor) -> None:
        lease = self._leases[h.request_id]
        # into this cache's block size, from the first token its blocks await (no copy when equal)
        kv = reblock(kv, h.token_offset, lease.first_token_index, h.num_tokens, self.layout[2])
        kv = kv_format.convert(kv, self.format)  # pools with other KV formats: as this cache stores them
        if kv.shape[2] != len(lease.dest_block_ids):
            raise KVTransferError(f"KV push for {h.request_id!r}: {kv.shape[2]} blocks of tokens for "
                                  f"{len(lease.dest_block_ids)} destination blocks")
        (ls, le), (hs, he) = (h.layer_start, h.layer_end), (h.head_start, h.head_end or self.layout[3])
        own_l, own_h = self.part
        if (ls, le, hs, he) == (own_l.start, own_l.stop, own_h.start, own_h.stop):
            full = kv
        else:  # pieces (layer ranges streamed, another group's ranks): collect them until every cell is there
            if lease.buffer is None:
                lease.buffer = torch.empty((len(own_l), *kv.shape[1:4], len(own_h), kv.shape[5]), dtype=kv.dtype)
            lease.buffer[ls - own_l.start:le - own_l.start, :, :, :, hs - own_h.start:he - own_h.start] = kv
            lease.layers_done.update((i, j) for i in range(ls, le) for j in range(hs, he))
            if len(lease.layers_done) < len(own_l) * len(own_h):
                return
            full = lease.buffer
        del self._leases[h.request_id]
        self._ready.append(Arrival(h.request_id, full, h.first_token, h.num_tokens))


class PushAssembler:
    """One push as it arrives over a wire (header, then data pieces), refused as early as
    possible: the header is checked against the lease before any payload memory is taken,
    and data beyond the size the header announced is refused. Shared by the transports."""

    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        self.header: pb.KVHeader | None = None
        self.buf: bytearray | None = None
        self.received = 0

    def start(self, h: pb.KVHeader) -> None:
        if self.header is not None:
            raise KVTransferError("KV push carries a second header")
        self.receiver.check_header(h)
        self.header, self.buf = h, bytearray(h.payload_bytes)  # payload_bytes was checked against the lease

    def slot(self, nbytes: int) -> memoryview:
        """Where the next `nbytes` of payload go (receive straight into it)."""
        if self.header is None:
            raise KVTransferError("KV push must start with a header")
        if self.received + nbytes > len(self.buf):
            raise KVTransferError(f"KV push for {self.header.request_id!r} carries more than "
                                  f"the {self.header.payload_bytes} bytes announced")
        view = memoryview(self.buf)[self.received:self.received + nbytes]
        self.received += nbytes
        return view

    def data(self, piece: bytes) -> None:
        self.slot(len(piece))[:] = piece

    def chunk(self, c: pb.KVChunk) -> None:
        """One message of a gRPC push stream: its header or a data piece."""
        if c.WhichOneof("kind") == "header":
            self.start(c.header)
        else:
            self.data(c.data)

    def finish(self) -> None:
        """Check the whole push (size, checksum) and file it with the receiver."""
        if self.header is None:
            raise KVTransferError("empty KV push")
        payload = self.buf if self.received == len(self.buf) else self.buf[:self.received]
        self.receiver.accept(self.header, payload)
