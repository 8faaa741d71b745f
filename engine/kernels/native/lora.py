"""LoRA updates of a step's rows in C (lora.c): what the Python path and the C decode step both
run on fp32 CPU adapters, so a row under an adapter gets the same bits on either path.

`rows_add(x, y, a, bt, rows)` adds `(x[rows] @ a.T) @ bt` into `y[rows]` in place (every row
when `rows` is None). `StepLoRA.of(groups, M)` packs a step's adapters (engine/model/lora_batch.py's
(adapter, rows) groups) into step.c's `step_lora`; each adapter's per-layer pointer table is
built once and kept on the adapter.
"""
from __future__ import annotations

import ctypes

import torch

from . import _bad, load

_fn = None
_F32, _I64 = torch.float32, torch.int64
MATRICES = ("qkv", "o", "gate_up", "down")  # step.c's order of a layer's fused matrices


def _bound():
    global _fn
    if _fn is None:
        lib = load()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.lora_rows_f32.argtypes = [p, i64, p, i64, i64, p, i64, p, p, i64, ctypes.c_int]
        lib.lora_rows_f32.restype = ctypes.c_int
        _fn = lib.lora_rows_f32
    return _fn


def usable(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether these tensors take the C routine (fp32 CPU, contiguous y)."""
    return x.is_cpu and x.dtype is _F32 and y.dtype is _F32 and a.dtype is _F32 and a.is_cpu and y.is_contiguous()


def rows_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             rows: torch.Tensor | None = None) -> torch.Tensor:
    """y (M, N) += (x[rows] @ a.T) @ bt at `rows` (int64; None: every row), in place; x (M, K),
    a (r, K), bt (r, N) fp32 CPU."""
    fn = _bound()
    x = x.contiguous()
    M, K = x.shape
    r, N = bt.shape
    if not usable(x, y, a) or y.shape != (M, N) or a.shape != (r, K) or not (a.is_contiguous() and bt.is_contiguous()) \
            or bt.dtype is not _F32:
        raise _bad(f"expected fp32 CPU x (M, K), y (M, N) contiguous, a ({r}, K), bt ({r}, N)", x, y, a, bt)
    if rows is not None:
        rows = rows.to(_I64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= M):
            raise _bad(f"rows must lie in [0, {M})", rows)
    if fn(x.data_ptr(), K, y.data_ptr(), N, M, None if rows is None else rows.data_ptr(),
          0 if rows is None else rows.numel(), a.data_ptr(), bt.data_ptr(), r, torch.get_num_threads()):
        raise MemoryError("LoRA update: no memory for its scratch")
    return y


class _Adapter(ctypes.Structure):
    _fields_ = [("ab", ctypes.c_void_p), ("ranks", ctypes.c_void_p)]


class StepLoRA(ctypes.Structure):
    """step.c's `step_lora`: the adapters of a decode step and each row's adapter."""
    _fields_ = [("n_adapters", ctypes.c_int64), ("max_rank", ctypes.c_int64), ("adapters", ctypes.c_void_p),
                ("row_slot", ctypes.c_void_p)]

    @classmethod
    def of(cls, groups: list, M: int) -> "StepLoRA":
        """From (adapter, rows or None) groups over M rows; the result keeps what it points to alive."""
        tables = [_table(adapter) for adapter, _ in groups]
        slot = torch.full((M,), -1, dtype=torch.int32)
        for s, (_, rows) in enumerate(groups):
            if rows is None:
                slot.fill_(s)
            else:
                slot[rows] = s
        arr = (_Adapter * len(tables))(*[_Adapter(t[0], t[1]) for t in tables])
        out = cls(len(tables), max(t[2] for t in tables), ctypes.addressof(arr), slot.data_ptr())
        out._keep = (arr, slot, tables)  # noqa: SLF001 - the memory the pointers name
        return out


def _table(adapter) -> tuple[int, int, int, tuple]:
    """(address of the ab pointers, address of the ranks, max rank, what they keep alive) of an
    adapter, built once: per layer and matrix its A (r, in) and B transposed (r, out), fp32."""
    cached = getattr(adapter, "_c_table", None)
    if cached is not None:
        return cached
    ptrs, ranks, keep = [], [], []
    for layer in adapter.layers:
        for name in MATRICES:
            m = layer.get(name)
            if m is None:
                ptrs += [None, None]
                ranks.append(0)
                continue
            bt = bt_of(m)
            if m.a.dtype is not _F32 or not m.a.is_cpu or not m.a.is_contiguous():
                raise ValueError(f"LoRA adapter {adapter.name!r}: the C step needs fp32 CPU weights")
            ptrs += [m.a.data_ptr(), bt.data_ptr()]
            ranks.append(m.a.shape[0])
            keep.append(bt)
    ab = (ctypes.c_void_p * len(ptrs))(*ptrs)
    rk = (ctypes.c_int64 * len(ranks))(*ranks)
    table = (ctypes.addressof(ab), ctypes.addressof(rk), max(ranks + [0]), (ab, rk, keep))
    adapter._c_table = table
    return table


def bt_of(m) -> torch.Tensor:
    """B transposed, contiguous (r, out): what the C routine reads; made once per module."""
    bt = getattr(m, "_bt", None)
    if bt is None:
        bt = m.b.T.contiguous()
        m._bt = bt
    return bt
