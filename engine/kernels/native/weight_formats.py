"""The weight formats the native matmuls read, on the Python side: per-row int8, GGUF's Q4_1
and Q8_0 (groups of 32 along K), quantized and dequantized with torch ops; and whether a matrix
is exactly such a grid (grids.c)."""
from __future__ import annotations

import ctypes

import torch

_grids = None  # grids.c's two checks, bound at the first grid_form


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
    """("q4_1", quantize_q4_1's output) or ("q8_0", quantize_q8_0's) of the 2-D fp32 CPU `w` (K
    a multiple of 32) if re-quantizing it that way moves no weight by more than `rel_tol` x max
    |w| (as GGUF checkpoints dequantize), else None. In C (grids.c: the quantizers' arithmetic,
    one pass, stopping at the first group off the grid): every model load checks every matrix.
    Needs the native library (raises NativeKernelUnavailable without it)."""
    global _grids
    if _grids is None:
        from . import load
        lib, p, i64, f32, c_int = load(), ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.grid_q4_1.argtypes = [p, i64, i64, f32, p, p, p, c_int]
        lib.grid_q8_0.argtypes = [p, i64, i64, f32, p, p, c_int]
        lib.grid_q4_1.restype = lib.grid_q8_0.restype = c_int
        _grids = lib.grid_q4_1, lib.grid_q8_0
    q4_1, q8_0 = _grids
    w = w.detach().contiguous()
    if w.dtype != torch.float32 or not w.is_cpu or w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"expected a 2-D fp32 CPU weight (N, K) with K a multiple of 32, got {w.dtype} "
                         f"{tuple(w.shape)} on {w.device}")
    n, k = w.shape
    threads = torch.get_num_threads()
    d, m = torch.empty(n, k // 32), torch.empty(n, k // 32)
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    if q4_1(w.data_ptr(), n, k, rel_tol, packed.data_ptr(), d.data_ptr(), m.data_ptr(), threads):
        return "q4_1", (packed, d, m)
    q = torch.empty(n, k, dtype=torch.int8)
    if q8_0(w.data_ptr(), n, k, rel_tol, q.data_ptr(), d.data_ptr(), threads):
        return "q8_0", (q, d)
    return None