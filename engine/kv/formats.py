"""How K/V are stored: a float dtype, or 8-bit codes with a scale per token and KV head.

A quantized cache tensor has the float cache's shape except its last dimension: each
(token, KV head) row holds `head_dim` one-byte codes, then the 4 bytes of its fp32 scale
(`absmax / qmax` of that row, fixed when the token's K/V are stored). A scale per row, not
per block, because decode appends one token at a time: a block-wide scale would have to be
re-fitted (and every earlier code re-rounded) whenever a later token is larger. The scale
costs 4 bytes per 64 codes (SmolLM2): 3.76x the tokens of an fp32 cache in the same memory.

The tensor's dtype names the format (int8: int8 codes; float8_e4m3fn: fp8 codes), so a
slice of the cache is self-describing through export, the wire and import; with head_dim
a multiple of 4, every scale is 4-byte aligned (the kernels read it as a float in place).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.errors import KVTransferError

SCALE_BYTES = 4
SCALE_LAYOUT = "token-head-f32"  # what a KV header names for these formats


@dataclass(frozen=True)
class KVFormat:
    name: str             # on the wire and in the stats: "float32", "bfloat16", "int8", ...
    dtype: torch.dtype    # the cache tensor's element type
    qmax: float = 0.0     # largest code magnitude; 0: not quantized

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    @property
    def code(self) -> int:
        """The C kernels' format id (attention.c KV_*)."""
        return {"float32": 0, "bfloat16": 1, "int8": 2, "float8_e4m3fn": 3}.get(self.name, -1)

    def row_width(self, head_dim: int) -> int:
        """Elements of the cache tensor's last dimension."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_row(self, head_dim: int) -> int:
        return self.row_width(head_dim) * torch.empty((), dtype=self.dtype).element_size()

    def head_dim(self, row_width: int) -> int:
        return row_width - SCALE_BYTES if self.quantized else row_width

    @property
    def scale_layout(self) -> str:
        return SCALE_LAYOUT if self.quantized else ""


FORMATS = {f.name: f for f in (
    KVFormat("float32", torch.float32), KVFormat("float16", torch.float16), KVFormat("bfloat16", torch.bfloat16),
    KVFormat("int8", torch.int8, 127.0), KVFormat("float8_e4m3fn", torch.float8_e4m3fn, 448.0))}
CHOICES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "float8_e4m3fn", "int8": "int8"}


def format_of(dtype: torch.dtype) -> KVFormat:
    for f in FORMATS.values():
        if f.dtype == dtype:
            return f
    raise KVTransferError(f"unsupported KV dtype {dtype}")


def encode(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """K/V rows (..., head_dim) in a float dtype -> the format's rows (..., row_width). fp32
    rows on the CPU are quantized by the C kernel (a 1k-token prompt's KV: ~10x faster than
    the torch ops of `encode_reference`, which it matches bit for bit)."""
    if not fmt.quantized:
        return x.to(fmt.dtype)
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 2 and x.numel():
        import pdserve.engine.kernels.native as native
        if native.available():
            rows = x.reshape(-1, 1, x.shape[-1])
            out = torch.empty(rows.shape[0], 1, 1, fmt.row_width(x.shape[-1]), dtype=fmt.dtype)
            native.kv_store_8bit(rows, out, torch.arange(rows.shape[0]))
            return out.view(*x.shape[:-1], out.shape[-1])
    return encode_reference(x, fmt)


def encode_reference(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """`encode` by torch ops (any device and float dtype): the definition of the formats."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fmt.qmax, torch.ones_like(amax))
    q = xf / scale
    if fmt.dtype == torch.int8:
        codes = q.round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        codes = q.clamp_(-fmt.qmax, fmt.qmax).to(fmt.dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(fmt.dtype)


def decode(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The format's rows (..., row_width) -> K/V (..., head_dim) in `dtype`."""
    fmt = format_of(rows.dtype)
    if not fmt.quantized:
        return rows.to(dtype)
    if rows.device.type == "cpu" and rows.numel() >= 1 << 16 and rows.shape[-1] % 4 == 0:  # a hand-off: in C, ~2x
        import pdserve.engine.kernels.native as native
        if native.available():
            return native.kv_load_8bit(rows).to(dtype)
    raw = rows.view(torch.uint8)
    hd = fmt.head_dim(rows.shape[-1])
    scale = raw[..., hd:].contiguous().view(torch.float32)         # (..., 1)
    codes = raw[..., :hd].view(fmt.dtype).float()
    return (codes * scale).to(dtype)


def convert(kv: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """KV in any format -> `fmt` (itself when it already is)."""
    if kv.dtype == fmt.dtype:
        return kv
    src = format_of(kv.dtype)
    if not src.quantized and not fmt.quantized:
        return kv.to(fmt.dtype)
    return encode(decode(kv), fmt)
