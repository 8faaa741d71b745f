"""The LoRA update of a mixed batch in one Triton launch per fused matrix: punica's / S-LoRA's
segmented gathered matmul (SGMV).

A step's rows under an adapter are listed adapter by adapter (`row_ids`, one segment per
adapter, `seg_starts` its bounds); the rows of the base are in no segment and never touched.
A program takes up to BLOCK_M rows of one segment, gathers them from x, shrinks them by that
adapter's A (`t = x A^T`, rank columns, accumulated in fp32 over K in BLOCK_K chunks) and
expands them by its B (`y += t B^T`, N in BLOCK_N chunks), read-modify-writing its rows of y
only: no two programs share a row, so no atomics. Adapters of different ranks share a launch:
the rank axis is one block of the step's largest rank (at least 16, as `tl.dot` needs),
columns past an adapter's own rank masked to zero, so smaller ranks are padded to the max
rank without copying anything.

The adapters' matrices are not stacked per step: each adapter keeps, per layer and fused
matrix, the addresses of its A (rank, K) and B (N, rank, scaling folded in,
engine/model/lora.py) and its rank in one int64 table on its device, built once (`table_of`);
a step stacks its adapters' tables, and a program reads the pointers of its segment's
adapter (as vLLM's punica kernels read their LoRA pointer tensors). A matrix an adapter does
not target has rank 0: its programs write nothing.

On CUDA the kernel runs compiled, fp32 products in IEEE fp32 (not TF32); the tests run it on
the CPU under `TRITON_INTERPRET=1`, fp32 only (the interpreter's bf16 arithmetic is wrong).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MATRICES = ("qkv", "o", "gate_up", "down")  # a table's order of a layer's fused matrices
BLOCK_M, BLOCK_K, BLOCK_N = 16, 32, 64


@triton.jit
def _sgmv_kernel(x_ptr, y_ptr, rows_ptr, seg_ptr, table_ptr, entry, entries, K, N, stride_x, stride_y,
                 R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    seg = tl.program_id(0)
    lo = tl.load(seg_ptr + seg)
    hi = tl.load(seg_ptr + seg + 1)
    at = table_ptr + (seg * entries + entry) * 3
    rank = tl.load(at + 2)
    start = lo + tl.program_id(1) * BM
    if (rank > 0) & (start < hi):
        a_ptr = tl.load(at).to(tl.pointer_type(x_ptr.dtype.element_ty))
        b_ptr = tl.load(at + 1).to(tl.pointer_type(x_ptr.dtype.element_ty))
        m = start + tl.arange(0, BM)
        row_ok = m < hi
        rows = tl.load(rows_ptr + m, mask=row_ok, other=0).to(tl.int64)
        r = tl.arange(0, R)
        r_ok = r < rank
        t = tl.zeros((BM, R), dtype=tl.float32)
        for k0 in range(0, K, BK):  # shrink: t = x[rows] @ A^T
            k = k0 + tl.arange(0, BK)
            k_ok = k < K
            xb = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                         other=0.0)
            ab = tl.load(a_ptr + r[None, :] * K + k[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                t += tl.dot(xb, ab, input_precision="ieee")
            else:
                t += tl.dot(xb, ab)
        t = t.to(x_ptr.dtype.element_ty)  # as PEFT's lora_A output, in the model's dtype
        for n0 in range(0, N, BN):  # expand: y[rows] += t @ B^T
            n = n0 + tl.arange(0, BN)
            n_ok = n < N
            bb = tl.load(b_ptr + n[None, :] * rank + r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                d = tl.dot(t, bb, input_precision="ieee")
            else:
                d = tl.dot(t, bb)
            mask = row_ok[:, None] & n_ok[None, :]
            yp = y_ptr + rows[:, None] * stride_y + n[None, :]
            yv = tl.load(yp, mask=mask, other=0.0)
            tl.store(yp, (yv.to(tl.float32) + d).to(yv.dtype), mask=mask)


def table_of(adapter, device: torch.device | str) -> torch.Tensor:
    """The adapter's (layers, 4, 3) int64 table on `device`: per layer and fused matrix
    (MATRICES order) the addresses of its A and B and its rank (0: not targeted). Built once
    per adapter and device (its largest rank kept beside it); the tensors it points to are
    the adapter's own."""
    device = _resolved(device)
    cached = getattr(adapter, "_triton_table", None)
    if cached is not None and cached.device == device:
        return cached
    rows = []
    for layer in adapter.layers:
        for name in MATRICES:
            m = layer.get(name)
            if m is None:
                rows.append((0, 0, 0))
                continue
            if not (m.a.is_contiguous() and m.b.is_contiguous()) or m.a.device != device:
                raise ValueError(f"LoRA adapter {adapter.name!r}: the Triton kernel needs contiguous "
                                 f"weights on {device}")
            rows.append((m.a.data_ptr(), m.b.data_ptr(), m.a.shape[0]))
    table = torch.tensor(rows, dtype=torch.int64).view(len(adapter.layers), len(MATRICES), 3).to(device)
    adapter._triton_table, adapter._triton_rank = table, max((r for _, _, r in rows), default=0)
    return table


def _resolved(device: torch.device | str) -> torch.device:
    """The device with its index ("cuda" -> "cuda:0"), as tensors on it report theirs."""
    device = torch.device(device)
    return device if device.type == "cpu" or device.index is not None else torch.empty(0, device=device).device


class Segments:
    """A step's rows under adapters, grouped by adapter: `row_ids` (L,) their rows, segment s
    being row_ids[seg_starts[s]:seg_starts[s + 1]]; `tables` (S, layers, 4, 3) each segment's
    adapter's table; `max_rank` and `max_len` (the longest segment) size the launch grid."""

    def __init__(self, groups: list, num_rows: int, device: torch.device | str):
        """From (adapter, rows or None for every row) groups over `num_rows` rows."""
        device = _resolved(device)
        rows = [torch.arange(num_rows, device=device) if r is None else r.to(device) for _, r in groups]
        lens = [int(r.numel()) for r in rows]
        self.row_ids = torch.cat(rows).to(torch.int32) if rows else torch.empty(0, dtype=torch.int32, device=device)
        self.seg_starts = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        self.tables = torch.stack([table_of(a, device) for a, _ in groups])
        self.max_len = max(lens, default=0)
        self.max_rank = max((a._triton_rank for a, _ in groups), default=0)  # noqa: SLF001 - set by table_of
        self.num_layers = self.tables.shape[1]


def usable(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether these tensors can take the kernel: x and the adapters of one float dtype, y
    row-contiguous, on CUDA (or fp32 on the CPU under the interpreter)."""
    from pdserve.engine.kernels.triton_kernels import INTERPRETED

    if x.dtype != dtype or y.dim() != 2 or x.dim() != 2 or y.stride(1) != 1 or x.device != y.device:
        return False
    return x.is_cuda or (INTERPRETED and x.dtype == torch.float32)


def sgmv_add(x: torch.Tensor, y: torch.Tensor, segs: Segments, layer: int, matrix: str) -> torch.Tensor:
    """y (T, N) += each segment's adapter's update of fused matrix `matrix` at layer `layer`
    on that segment's rows, in place; x (T, K) the matrix's input. Returns y."""
    if not segs.max_len or not segs.max_rank:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    K, N = x.shape[1], y.shape[1]
    entries = segs.num_layers * len(MATRICES)
    entry = layer * len(MATRICES) + MATRICES.index(matrix)
    R = max(16, triton.next_power_of_2(segs.max_rank))
    grid = (segs.seg_starts.numel() - 1, triton.cdiv(segs.max_len, BLOCK_M))
    _sgmv_kernel[grid](x, y, segs.row_ids, segs.seg_starts, segs.tables, entry, entries, K, N, x.stride(0),
                       y.stride(0), R=R, BM=BLOCK_M, BK=BLOCK_K, BN=BLOCK_N, IEEE=x.dtype == torch.float32)
    return y
