"""bf16 matmuls on AMX tiles (amx.c): what "auto" runs prompt rows on where the CPU has AMX.

`pack(w)` rounds an fp32 (N, K) matrix to bf16 (round to nearest even) in the tiles' layout;
`matmul(x, packed)` rounds each activation to bf16 and sums the products in fp32 tiles;
`attention(q, k_cache, v_cache, tables, lens)` is prompt rows' paged attention in bf16 tiles
(amx_attention.c), or with `tiles=False` the same flash-style attention in AVX-512 BF16 vectors
(bf16_attention.c: where the CPU has AVX-512 BF16, with or without AMX). A row's result depends
only on that row. `available()` is False unless the library was built for AMX (cpu.py's
"avx512-amx") and Linux grants the process the tile state; `vector_attention_available()` unless
it was built with AVX-512 BF16.
"""
from __future__ import annotations

import ctypes

import torch

from . import _bad, bound_runs, load

_fn = _attn = _vec = None
_F32, _BF16 = torch.float32, torch.bfloat16
_KV = {torch.float32: 0, torch.bfloat16: 1}  # the caches the attention reads (kvformat.h's KV_F32, KV_BF16)


def _bound():
    global _fn, _attn, _vec
    if _fn is None:
        lib = load()
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.amx_bf16_matmul.argtypes = [p, p, p, i64, i64, i64, c_int]
        for attn in (lib.amx_prompt_attention, lib.bf16_prompt_attention):
            attn.argtypes, attn.restype = [p] * 6 + [c_int] * 6 + [ctypes.c_float, c_int, c_int], c_int
        lib.amx_bf16_matmul.restype = lib.amx_bf16_available.restype = lib.bf16_attention_available.restype = c_int
        _attn = lib.amx_prompt_attention
        _vec = lib.bf16_prompt_attention if lib.bf16_attention_available() else False
        _fn = lib.amx_bf16_matmul if lib.amx_bf16_available() else False
    return _fn


def vector_attention_available() -> bool:
    """True where `attention(..., tiles=False)` runs: a build with AVX-512 BF16."""
    return bound_runs(lambda: _bound() is not None and _vec)


def available() -> bool:
    """True where the kernel runs: an AMX build of the native kernels, and the tiles granted."""
    return bound_runs(_bound)


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


def attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `attention` takes these rows: head dim 64, an fp32 or bf16 cache, at most 16 query
    heads per KV head."""
    return (q.dim() == 3 and q.shape[2] == 64 and k_cache.dtype in _KV and k_cache.dim() == 4
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[1] // k_cache.shape[2] <= 16)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, tiles: bool = True) -> torch.Tensor:
    """Prompt rows' attention over the paged cache, as native.paged_decode_attention takes its
    arguments (tables and lens checked by native.paged_attention_tables; no window): q (B, H, 64)
    fp32, caches (blocks, block_size, KVH, 64) fp32 or bf16. Returns (B, H, 64) fp32. `tiles`:
    on AMX tiles, else in AVX-512 BF16 vectors (the same arithmetic, summed in another order)."""
    if tiles and not _bound():
        raise RuntimeError("AMX attention needs a CPU with AMX (and the avx512-amx build)")
    if not tiles and not vector_attention_available():
        raise RuntimeError("bf16 vector attention needs a CPU with AVX-512 BF16 (and a build for it)")
    q = q.contiguous()
    if q.dtype is not _F32 or not attention_fits(q, k_cache) or v_cache.shape != k_cache.shape \
            or v_cache.dtype is not k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()) \
            or tables.dtype is not torch.int64 or lens.shape != (q.shape[0],) or tables.shape[0] != q.shape[0]:
        raise _bad("expected q fp32 (B, H, 64), fp32 or bf16 caches (blocks, bs, KVH, 64), int64 tables (B, n)"
                   " and lens (B,)", q, k_cache, tables, lens)
    out = torch.empty_like(q)
    B, H, D = q.shape
    if B:
        kernel = _attn if tiles else _vec
        rc = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                    out.data_ptr(), B, H, k_cache.shape[2], D, k_cache.shape[1], tables.shape[1], D ** -0.5,
                    torch.get_num_threads(), _KV[k_cache.dtype])
        if rc:
            raise MemoryError("bf16 attention: no memory for its packed keys") if rc == -1 else \
                RuntimeError(f"bf16 attention failed ({rc})")
    return out
