"""Q4_1 weights x int8 activations (w4a8.c) for compute-bound batches: prefill chunks and
large decode batches.

`pack(packed, d, m)` turns `quantize_q4_1`'s form into the kernel's layout (one byte per
weight, columns interleaved by 8: see w4a8.c); `matmul(x, *packed)` quantizes each 16
activations of a row to int8 with their own scale and multiplies in integers. The weights
stay exactly the Q4_1 grid; only the activations are rounded (by at most 1/254 of the
largest magnitude among their 16).
"""
from __future__ import annotations

import ctypes

import torch

from . import _bad, bound_runs, load

_fn = None
_F32, _U8 = torch.float32, torch.uint8


def _bound():
    global _fn
    if _fn is None:
        lib = load()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.w4a8_matmul.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int]
        lib.w4a8_matmul.restype = ctypes.c_int
        lib.w4a8_available.restype = ctypes.c_int
        _fn = lib.w4a8_matmul if lib.w4a8_available() else False
    return _fn


def available() -> bool:
    """True where the kernel runs (the native build loads, with AVX2)."""
    return bound_runs(_bound)


def pack(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 (N/8, K/4, 8, 4), d, m fp32 (N/8, K/32, 8)) from Q4_1's packed uint8 (N, K/2)
    and d, m (N, K/32). N must be a multiple of 8."""
    n, half = packed.shape
    if n % 8:
        raise ValueError(f"w4a8 needs a multiple of 8 output columns, got {n}")
    b = packed.reshape(n, -1, 16)
    q = torch.cat([b & 15, b >> 4], dim=2).reshape(n // 8, 8, half // 2, 4)
    inter = lambda t: t.reshape(n // 8, 8, -1).transpose(1, 2).contiguous()  # noqa: E731
    return q.transpose(1, 2).contiguous(), inter(d.float()), inter(m.float())


def check_packed(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    """Raises ValueError unless q, d, m are `pack`'s form: contiguous CPU q uint8 (N/8, K/4, 8, 4)
    with K % 32 == 0, d and m fp32 (N/8, K/32, 8)."""
    try:
        nb, quads, eight, four = q.shape
    except ValueError:
        raise _bad("q must be (N/8, K/4, 8, 4)", q) from None
    k = quads * 4
    if q.dtype is not _U8 or (eight, four) != (8, 4) or k & 31 or d.shape != (nb, k >> 5, 8) or m.shape != d.shape \
            or d.dtype is not _F32 or m.dtype is not _F32 or not q.is_cpu \
            or not (q.is_contiguous() and d.is_contiguous() and m.is_contiguous()):
        raise _bad("expected w4a8.pack's contiguous CPU q, d, m", q, d, m)


def matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """y (M, N) fp32 ~ x @ dequantize_q4_1(...).T with each 16 of x's row in int8; x fp32 (M, K)
    contiguous, the rest from `pack` (`checked`: q, d, m passed `check_packed` already; x is
    checked every call)."""
    fn = _bound()
    if not fn:
        raise RuntimeError("the w4a8 kernel needs AVX2")
    if not checked:
        check_packed(q, d, m)
    n, k = q.shape[0] * 8, q.shape[1] * 4
    if x.dtype is not _F32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or not x.is_cpu:
        raise _bad(f"expected contiguous CPU x fp32 (M, {k})", x)
    y = torch.empty(x.shape[0], n, dtype=_F32)
    if fn(x.data_ptr(), q.data_ptr(), d.data_ptr(), m.data_ptr(), y.data_ptr(), x.shape[0], n, k,
          torch.get_num_threads()):
        raise MemoryError("w4a8 matmul: no memory for the quantized activations")
    return y
