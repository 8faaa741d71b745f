"""bf16 matmuls on AMX tiles (amx.c): what "auto" runs prompt rows on where the CPU has AMX.

`pack(w)` rounds an fp32 (N, K) matrix to bf16 (round to nearest even) in the tiles' layout;
`matmul(x, packed)` rounds each activation to bf16 and sums the products in fp32 tiles. A
row's result depends only on that row. `available()` is False unless the library was built
for AMX (cpu.py's "avx512-amx") and Linux grants the process the tile state.
"""
from __future__ import annotations

import ctypes

import torch

from . import NativeKernelUnavailable, _bad, load

_fn = None
_F32, _BF16 = torch.float32, torch.bfloat16


def _bound():
    global _fn
    if _fn is None:
        lib = load()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.amx_bf16_matmul.argtypes = [p, p, p, i64, i64, i64, ctypes.c_int]
        lib.amx_bf16_matmul.restype = lib.amx_bf16_available.restype = ctypes.c_int
        _fn = lib.amx_bf16_matmul if lib.amx_bf16_available() else False
    return _fn


def available() -> bool:
    """True where the kernel runs: an AMX build of the native kernels, and the tiles granted."""
    try:
        return bool(_bound())
    except NativeKernelUnavailable:
        return False


def fits(w: torch.Tensor) -> bool:
    """Whether the kernel takes this (out, in) matrix: both sizes multiples of 32."""
    return w.dim() == 2 and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """bf16 (N/16, K/32, 16, 32) tiles of fp32 w (N, K): block (c, b) row r holds, for its 16
    columns in turn, k = 32b + 2r and 32b + 2r + 1 (amx.c)."""
    if not fits(w):
        raise _bad("amx.pack needs a 2-D (N, K) matrix with N and K multiples of 32", w)
    n, k = w.shape
    t = w.detach().float().to(_BF16).reshape(n // 16, 16, k // 32, 16, 2)  # column block, column, k block, r, pair
    return t.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32).contiguous()


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y (M, N) fp32 = bf16(x) @ W.T, with W from `pack`; x fp32 (M, K) contiguous."""
    fn = _bound()
    if not fn:
        raise RuntimeError("the AMX bf16 kernel needs a CPU with AMX (and the avx512-amx build)")
    n, k = w.shape[0] * 16, w.shape[1] * 32
    if x.dtype is not _F32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or not x.is_cpu:
        raise _bad(f"expected contiguous CPU x fp32 (M, {k})", x)
    y = torch.empty(x.shape[0], n, dtype=_F32)
    rc = fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], n, k, torch.get_num_threads())
    if rc:
        raise MemoryError("amx matmul: no memory for the bf16 activations") if rc == 1 else \
            RuntimeError(f"amx matmul failed ({rc})")
    return y
