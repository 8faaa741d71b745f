"""Triton kernels for the GPU path: writing new K/V into the paged cache, paged-attention
decode that reads the cache blocks in place (no gather into a dense copy), and copying a
request's blocks to and from a contiguous transfer buffer.

On CUDA they are what `TritonAttentionBackend` runs; the tests run them on the CPU under
`TRITON_INTERPRET=1` against the torch path (the interpreter's bf16 arithmetic is wrong, so
low-precision inputs are upcast to fp32 there). Cache layout: (n_blocks, block_size, n_kv,
head_dim) per layer for K and for V; a slot is block * block_size + offset.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _fp32_if_interpreted(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() if INTERPRETED and t.dtype in (torch.bfloat16, torch.float16) else t for t in ts]


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    for start in range(0, ROW, BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = i < ROW
        tl.store(kc_ptr + slot * ROW + i, tl.load(k_ptr + t * ROW + i, mask=m), mask=m)
        tl.store(vc_ptr + slot * ROW + i, tl.load(v_ptr + t * ROW + i, mask=m), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (T, n_kv, hd) written to cache slots `slot_mapping` (T,)."""
    T = k.shape[0]
    if T == 0:
        return
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(T,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping,
                           ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)))


@triton.jit
def _load_kv(c_ptr, s_ptr, rows, d, valid, HD: tl.constexpr, FMT: tl.constexpr):
    """(rows, HD) K or V as fp32. FMT 0: a float cache; 1: int8 codes; 2: fp8 e4m3 codes
    (bytes) -- 8-bit rows are HD codes then an fp32 scale, read through `s_ptr` (the same
    memory as fp32 words)."""
    if FMT == 0:
        return tl.load(c_ptr + rows[:, None] * HD + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    W: tl.constexpr = HD + 4
    x = tl.load(c_ptr + rows[:, None] * W + d[None, :], mask=valid[:, None], other=0)
    if FMT == 1:
        vals = x.to(tl.float32)
    else:  # e4m3fn: exponent re-biased 7 -> 127; exponent 0 is subnormal, m * 2^-9
        b = x.to(tl.int32) & 0xFF
        em = b & 0x7F
        normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        mag = tl.where(em < 8, em.to(tl.float32) * (1.0 / 512.0), normal)
        vals = tl.where((b & 0x80) != 0, -mag, mag)
    scale = tl.load(s_ptr + rows * (W // 4) + HD // 4, mask=valid, other=0.0)
    return vals * scale[:, None]


@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                         max_blocks, N_HEADS: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr,
                         BS: tl.constexpr, FMT: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (N_HEADS // N_KV)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (seq * N_HEADS + head) * HD + d).to(tl.float32)
    seq_len = tl.load(lens_ptr + seq)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([HD], dtype=tl.float32)
    offs = tl.arange(0, BS)
    for b in range(0, tl.cdiv(seq_len, BS)):  # online softmax over the sequence's blocks, in place
        block = tl.load(tables_ptr + seq * max_blocks + b).to(tl.int64)
        pos = b * BS + offs
        valid = pos < seq_len
        rows = (block * BS + offs) * N_KV + kv_head
        k = _load_kv(kc_ptr, ks_ptr, rows, d, valid, HD, FMT)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = _load_kv(vc_ptr, vs_ptr, rows, d, valid, HD, FMT)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out_ptr + (seq * N_HEADS + head) * HD + d, acc / l_i)


def _kernel_view(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A cache as the decode kernel reads it: (codes, scales as fp32 words, FMT)."""
    if cache.dtype == torch.int8:
        return cache, cache.view(torch.float32), 1
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8), cache.view(torch.float32), 2
    (c,) = _fp32_if_interpreted(cache)
    return c, c, 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """One query token per sequence attending to its cached keys, read block by block from
    the paged cache (a float dtype, or int8/fp8 rows with their scales: engine/kv/formats.py).
    q: (B, n_heads, hd); block_tables: (B, max_blocks) long; seq_lens: (B,).
    Returns (B, n_heads, hd) in fp32 (the caller casts)."""
    B, n_heads, hd = q.shape
    _, bs, n_kv, _ = k_cache.shape
    (q,) = _fp32_if_interpreted(q)
    kc, ks, fmt = _kernel_view(k_cache)
    vc, vs, _ = _kernel_view(v_cache)
    out = torch.empty((B, n_heads, hd), dtype=torch.float32, device=q.device)
    if B:
        _paged_decode_kernel[(B, n_heads)](q.contiguous(), kc, vc, ks, vs, block_tables.contiguous(),
                                           seq_lens.contiguous(), out, scale or hd ** -0.5, block_tables.shape[1],
                                           N_HEADS=n_heads, N_KV=n_kv, HD=hd, BS=bs, FMT=fmt)
    return out


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    t = tl.load(dst_ids_ptr + i).to(tl.int64)
    for start in range(0, SIZE, BLOCK):
        j = start + tl.arange(0, BLOCK)
        m = j < SIZE
        tl.store(dst_ptr + t * SIZE + j, tl.load(src_ptr + s * SIZE + j, mask=m), mask=m)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for blocks (first dimension) of equal size: gathers a
    request's blocks into a contiguous transfer buffer (dst_ids = 0..n-1) or scatters one
    into the cache (src_ids = 0..n-1)."""
    n = src_ids.numel()
    if n == 0:
        return
    size = src[0].numel()
    _copy_blocks_kernel[(n,)](src, dst, src_ids, dst_ids, SIZE=size, BLOCK=min(1024, triton.next_power_of_2(size)))
