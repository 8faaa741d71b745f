"""What travels between the ranks of a tensor-parallel group, and how: rank 0's commands
(steps, KV exports and imports, stop) as JSON for their structure and raw bytes for their
tensors, sealed with an HMAC-SHA256 under the group's session key over a sequence number.

Nothing a rank receives is unpickled: a message decodes to lists, numbers, strings, tensors
of the dtypes in `DTYPES` and the attention metadata, and only after its seal checks (a
message from a process without the group's secret, or one replayed or reordered, is refused
before it is parsed). `group_secret()` makes the secret; the parent hands it to the ranks it
starts on their stdin, so another local user, who can reach the ranks' loopback ports, cannot
join the group or speak in it (engine/parallel/tp.py).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os

import torch

from pdserve.common.errors import PdserveError
from pdserve.engine.kernels.attention import AttentionMetadata, PrefillSpan

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.bool, torch.uint8,
                                                     torch.float32, torch.bfloat16, torch.float16)}
MAX_MESSAGE = 1 << 30  # bytes: a length above it is refused before anything is allocated
MAC_BYTES = 32


class PeerRefused(PdserveError, RuntimeError):
    """A peer of a tensor-parallel group did not prove the group's secret, or a message did
    not decode: the group does not form, or stops."""


def group_secret() -> bytes:
    """A fresh random secret for one group."""
    return os.urandom(32)


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of length-prefixed `parts` under `key` (no two part lists share an input)."""
    return hmac.new(key, b"".join(len(p).to_bytes(8, "big") + p for p in parts), hashlib.sha256).digest()


def store_prefix(secret: bytes) -> str:
    """The rendezvous store's key prefix of the group: a process without the secret cannot
    find (nor overwrite) the ranks' addresses in the store."""
    return "pdserve-tp/" + mac(secret, b"store").hex()


def seal(key: bytes, seq: int, payload: bytes) -> bytes:
    """`payload` with its MAC ahead: the seq-th message of the session `key`."""
    return mac(key, seq.to_bytes(8, "big"), payload) + payload


def unseal(key: bytes, seq: int, data: bytes) -> bytes:
    """The payload of `data`, if it is the seq-th message sealed under `key`; else PeerRefused."""
    payload = data[MAC_BYTES:]
    if len(data) < MAC_BYTES or not hmac.compare_digest(data[:MAC_BYTES], mac(key, seq.to_bytes(8, "big"),
                                                                                   payload)):
        raise PeerRefused(f"message {seq} of the tensor-parallel group failed its check: not from a rank that holds "
                          "the group's secret")
    return payload


def encode(obj) -> bytes:
    """`obj` (None, bool, int, float, str, lists and tuples of them, tensors, AttentionMetadata)
    as an 8-byte header length, the JSON header, then the tensors' bytes in order."""
    tensors: list[torch.Tensor] = []

    def enc(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (list, tuple)):
            return [enc(v) for v in x]
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().to("cpu").contiguous())
            return {"tensor": len(tensors) - 1}
        if isinstance(x, AttentionMetadata):  # its backend_state is derived on each rank, not sent
            return {"meta": enc([x.slot_mapping, x.num_decode_tokens, x.decode_block_tables, x.decode_seq_lens,
                                 [[p.start, p.end, p.num_cached, p.block_table, p.prompt_rows] for p in x.prefills], x.block_size])}
        raise TypeError(f"a tensor-parallel message cannot carry {type(x).__name__}")

    body = enc(obj)
    header = json.dumps({"body": body, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                   for t in tensors]}).encode()
    raw = [t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors]
    return len(header).to_bytes(8, "big") + header + b"".join(raw)


def _tensors(spec, data: memoryview, device: str) -> list[torch.Tensor]:
    out, at = [], 0
    for dtype_name, shape in spec:
        dtype = DTYPES.get(dtype_name)
        if dtype is None or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise PeerRefused(f"a tensor-parallel message has a tensor of {dtype_name} {shape}")
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if at + n > len(data):
            raise PeerRefused("a tensor-parallel message is shorter than its tensors")
        flat = torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out.append(flat.view(dtype).reshape(shape).to(device))
        at += n
    if at != len(data):
        raise PeerRefused("a tensor-parallel message is longer than its tensors")
    return out


def decode(data: bytes, device: str = "cpu"):
    """What `encode` encoded (tuples come back as lists), its tensors on `device`."""
    view = memoryview(data)
    n = int.from_bytes(view[:8], "big")
    try:
        header = json.loads(bytes(view[8:8 + n]))
        tensors = _tensors(header["tensors"], view[8 + n:], device)
        return _body(header["body"], tensors)
    except (ValueError, KeyError, TypeError, IndexError) as e:  # a malformed header or metadata
        raise PeerRefused(f"a tensor-parallel message did not decode: {e!r}") from e


def _body(body, tensors: list[torch.Tensor]):
    def dec(x):
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if set(x) == {"tensor"} and isinstance(x["tensor"], int) and 0 <= x["tensor"] < len(tensors):
            return tensors[x["tensor"]]
        if set(x) == {"meta"}:
            return _meta(dec(x["meta"]))
        raise PeerRefused(f"a tensor-parallel message has an unknown part {sorted(x)[:4]}")
    return dec(body)


def _meta(fields: list) -> AttentionMetadata:
    slots, n_decode, tables, lens, spans, block_size = fields
    return AttentionMetadata(slot_mapping=slots, num_decode_tokens=int(n_decode), decode_block_tables=tables,
                             decode_seq_lens=lens, prefills=[PrefillSpan(int(a), int(b), int(c), [int(i) for i in t], int(p))
                                                             for a, b, c, t, p in spans], block_size=int(block_size))
