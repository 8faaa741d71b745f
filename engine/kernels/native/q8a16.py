"""Q8_0 weights x int16 activations (q8a16.c): what "auto" runs a GGUF's Q8_0 LM head on.

`pack(q, d)` turns `quantize_q8_0`'s form into the kernel's layout (columns interleaved by 8,
weights in pairs: see q8a16.c); `matmul(x, *packed)` rounds each 32 activations of a row to
int16 with their own scale and multiplies in integers. The weights stay exactly the Q8_0 grid;
the activations move by at most 1/65534 of the largest magnitude among their 32.
"""
from __future__ import annotations

import ctypes

import torch

from . import _bad, bound_runs, load

_fn = None
_F32, _I8 = torch.float32, torch.int8


def _bound():
    global _fn
    if _fn is None:
        lib = load()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.q8a16_matmul.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
        lib.q8a16_matmul.restype = lib.q8a16_available.restype = ctypes.c_int
        _fn = lib.q8a16_matmul if lib.q8a16_available() else False
    return _fn


def available() -> bool:
    """True where the kernel runs (the native build loads, with AVX2)."""
    return bound_runs(_bound)


def pack(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N/8, K/2, 8, 2), d fp32 (N/8, K/32, 8)) from Q8_0's q int8 (N, K) and d (N, K/32);
    N must be a multiple of 8 and K of 32."""
    if q.dim() != 2 or q.dtype is not _I8 or q.shape[0] % 8 or q.shape[1] % 32 \
            or d.shape != (q.shape[0], q.shape[1] // 32):
        raise _bad("q8a16 needs Q8_0's int8 q (N, K) and d (N, K/32) with N % 8 == 0, K % 32 == 0", q, d)
    n, k = q.shape
    packed = q.reshape(n // 8, 8, k // 2, 2).transpose(1, 2).contiguous()
    return packed, d.float().reshape(n // 8, 8, -1).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """y (M, N) fp32 ~ x @ dequantize_q8_0(...).T with each 32 of x's row in int16; q, d from
    `pack`, x fp32 (M, K) contiguous (checked every call)."""
    fn = _bound()
    if not fn:
        raise RuntimeError("the q8a16 kernel needs AVX2")
    n, k = q.shape[0] * 8, q.shape[1] * 2
    if x.dtype is not _F32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or not x.is_cpu:
        raise _bad(f"expected contiguous CPU x fp32 (M, {k})", x)
    y = torch.empty(x.shape[0], n, dtype=_F32)
    if fn(x.data_ptr(), q.data_ptr(), d.data_ptr(), y.data_ptr(), x.shape[0], n, k, torch.get_num_threads()):
        raise MemoryError("q8a16 matmul: no memory for the quantized activations")
    return y
