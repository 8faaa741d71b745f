"""A mixture-of-experts layer's experts in two Triton launches: a grouped matmul over the
step's (token, expert) pairs sorted by expert (vLLM's fused_moe idea, without its padding).

The pairs are listed expert by expert (`rows`: each pair's token row, `seg_starts` (E + 1,)
each expert's bounds in the list). A program takes up to BLOCK_M pairs of one expert and
BLOCK_N output columns, gathers its pairs' input rows, multiplies them by that expert's
(N, K) slice of the stacked (E, N, K) weights (fp32 accumulation over K in BLOCK_K chunks)
and writes one output row per pair: no two programs share a row, so no atomics. The first
launch computes gate/up over the gathered token rows, torch the SwiGLU, the second launch down
with each pair's routing weight applied; the k outputs of a token are then summed in a fixed
order (not by atomics), so a row's result does not depend on the order programs ran in.
Only the experts some pair chose are read: an expert's programs with no pairs return at once.

The grid is sized by the step's rows (an expert has at most one pair per token), not by the
longest segment, so no device-to-host sync sizes it. On CUDA the kernel runs compiled, fp32
products in IEEE fp32; the tests run it on the CPU under `TRITON_INTERPRET=1`, fp32 only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M, BLOCK_K, BLOCK_N = 16, 32, 64


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, seg_ptr, scale_ptr, K, N, stride_x, stride_we, stride_wn,
                    stride_out, HAS_SCALE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                    IEEE: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    lo = tl.load(seg_ptr + e)
    hi = tl.load(seg_ptr + e + 1)
    start = lo + tl.program_id(1) * BM
    if start < hi:
        m = start + tl.arange(0, BM)
        m_ok = m < hi
        rows = tl.load(rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
        n = tl.program_id(2) * BN + tl.arange(0, BN)
        n_ok = n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < K
            xb = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wb = tl.load(w_ptr + e * stride_we + n[None, :] * stride_wn + k[:, None],
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BK, BN): W[e]^T's tile
            if IEEE:
                acc += tl.dot(xb, wb, input_precision="ieee")
            else:
                acc += tl.dot(xb, wb)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + m[:, None].to(tl.int64) * stride_out + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_matmul(x: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor, w: torch.Tensor,
                   max_per_expert: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[p] = x[rows[p]] @ w[e].T (times scale[p]) for each pair p of expert e's segment
    seg_starts[e]:seg_starts[e + 1]. x (T, K), rows (P,) int32, w (E, N, K) contiguous.
    Returns (P, N) in x's dtype."""
    P, (E, N, K) = rows.numel(), w.shape
    out = torch.empty(P, N, device=x.device, dtype=x.dtype)
    if P == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    grid = (E, triton.cdiv(max_per_expert, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _grouped_kernel[grid](x, w, out, rows, seg_starts, out if scale is None else scale, K, N, x.stride(0),
                          w.stride(0), w.stride(1), out.stride(0), HAS_SCALE=scale is not None, BM=BLOCK_M,
                          BK=BLOCK_K, BN=BLOCK_N, IEEE=x.dtype == torch.float32)
    return out


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, owned: range | None = None) -> torch.Tensor:
    """The weighted sum of each row's chosen SwiGLU experts. x (T, H); experts, weights (T, k)
    from the router; gate_up (E, 2I, H) and down (E, H, I), stacked. Pairs routed to experts
    outside `owned` contribute nothing. Returns (T, H)."""
    T, k = experts.shape
    E = gate_up.shape[0]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert
    rows = (order // k).to(torch.int32)
    scale = weights.reshape(-1)[order].to(x.dtype)
    if owned is not None and (owned.start, owned.stop) != (0, E):
        chosen = flat[order]
        scale = scale * ((chosen >= owned.start) & (chosen < owned.stop)).to(x.dtype)
    seg = torch.zeros(E + 1, dtype=torch.int32, device=x.device)
    seg[1:] = torch.cumsum(torch.bincount(flat, minlength=E), 0)
    h = grouped_matmul(x, rows, seg, gate_up, T)  # (P, 2I)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()  # (P, I), in pair order
    pairs = torch.arange(order.numel(), device=x.device, dtype=torch.int32)
    y = grouped_matmul(act, pairs, seg, down, T, scale)  # (P, H), weighted
    by_token = torch.empty_like(y)
    by_token[order] = y  # back to (token, slot) order: a fixed summation order per row
    return by_token.view(T, k, -1).sum(dim=1)


def usable(x: torch.Tensor) -> bool:
    """Whether the kernel runs on `x`'s device: CUDA, or fp32 on the CPU under the interpreter."""
    from pdserve.engine.kernels.triton_kernels import INTERPRETED

    return x.is_cuda or (INTERPRETED and x.dtype == torch.float32)
