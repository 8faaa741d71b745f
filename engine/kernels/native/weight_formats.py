"""The weight formats the native matmuls read, on the Python side: per-row int8, GGUF's Q4_1
and Q8_0 (groups of 32 along K), quantized and dequantized with torch ops."""
from __future__ import annotations

import torch

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: returns q int8 (N, K) and scales fp32 (N,), w ~ q * scale."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight (N, K), got shape {tuple(w.shape)}")
    w = w.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # an all-zero row gets q = 0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (groups of 32 along K, w ~ q * d + m, q in 0..15). Returns packed uint8 (N, K/2),
    d and m fp32 (N, K/32). GGUF's nibble order: group g is bytes 16g..16g+15, byte 16g + j holds
    element 32g + j in its low nibble and 32g + 16 + j in its high one."""
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"expected a 2-D weight (N, K) with K a multiple of 32, got shape {tuple(w.shape)}")
    n, k = w.shape
    g = w.detach().float().reshape(n, k // 32, 32)
    m = g.amin(dim=2)
    d = (g.amax(dim=2) - m) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))  # constant group: d = 0, q = 0, w = m
    q = torch.round((g - m[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return packed.contiguous(), d.contiguous(), m.contiguous()


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 (GGUF's: groups of 32 along K, w ~ q * d, q in -127..127). Returns q int8 (N, K)
    and d fp32 (N, K/32)."""
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"expected a 2-D weight (N, K) with K a multiple of 32, got shape {tuple(w.shape)}")
    n, k = w.shape
    g = w.detach().float().reshape(n, k // 32, 32)
    d = g.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))  # an all-zero group: d = 0, q = 0
    q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d.contiguous()


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.float().reshape(n, k // 32, 32) * d[..., None]).reshape(n, k)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]


def dequantize_q4_1(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n = packed.shape[0]
    b = packed.reshape(n, -1, 16)
    q = torch.cat([b & 15, b >> 4], dim=2).float()
    return (q * d[..., None] + m[..., None]).reshape(n, -1)


def grid_form(w: torch.Tensor, rel_tol: float) -> tuple[str, tuple] | None:
    """("q4_1", quantize_q4_1's output) or ("q8_0", quantize_q8_0's) of the 2-D fp32 `w` (K a
    multiple of 32) if re-quantizing it that way moves no weight by more than `rel_tol` x max |w|
    (as GGUF checkpoints dequantize), else None. The same arithmetic as dequantizing each format's
    quantization, in one pass over reused buffers: every worker's start checks every matrix."""
    n, k = w.shape
    g = w.detach().reshape(n, k // 32, 32)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    tol = rel_tol * torch.maximum(hi.max(), -lo.min()).clamp(min=1e-30)
    d = (hi - lo) / 15
    q = (g - lo).mul_(torch.where(d > 0, 1 / d, torch.zeros_like(d))).round_().clamp_(0, 15)
    err = torch.empty_like(q)
    if torch.mul(q, d, out=err).add_(lo).sub_(g).abs_().max() <= tol:
        q = q.to(torch.uint8)
        packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
        return "q4_1", (packed.contiguous(), d.reshape(n, -1).contiguous(), lo.reshape(n, -1).contiguous())
    d = torch.maximum(hi, lo.neg_()).div_(127)  # max |w| of each group / 127
    q = torch.mul(g, torch.where(d > 0, 1 / d, torch.zeros_like(d)), out=q).round_().clamp_(-127, 127)
    if torch.mul(q, d, out=err).sub_(g).abs_().max() <= tol:
        return "q8_0", (q.to(torch.int8).reshape(n, k).contiguous(), d.reshape(n, -1).contiguous())
    return None
