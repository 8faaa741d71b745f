"""Greedy tokens in one C call (sampling.c `argmax_rows_f32`): each row's argmax as torch.argmax
gives it (the first index of the largest value; a NaN counts as the largest), read in place,
the rows in parallel. torch's argmax over a (32, 49152) batch took 2.8 ms on one core of a Xeon
(model 207), a tenth of a one-thread decode step's LM head."""
from __future__ import annotations

import ctypes

import torch

from . import _bad, load

_fn = None


def _bound():
    global _fn
    if _fn is None:
        lib = load()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.argmax_rows_f32.argtypes = [p, i64, i64, i64, p, p, ctypes.c_int]
        lib.argmax_rows_f32.restype = None
        _fn = lib.argmax_rows_f32
    return _fn


def rows(logits: torch.Tensor, which: list[int]) -> list[int]:
    """The argmax of each row `which[i]` of logits (N, V): fp32, CPU, unit stride along V."""
    fn = _bound()
    if logits.dtype is not torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_cpu:
        raise _bad("expected CPU fp32 (N, V) logits with unit stride along V", logits)
    if any(not 0 <= r < logits.shape[0] for r in which):
        raise ValueError(f"argmax rows {which} out of the {logits.shape[0]} rows")
    idx = torch.tensor(which, dtype=torch.int64)
    out = torch.empty(len(which), dtype=torch.int64)
    if which:
        fn(logits.data_ptr(), logits.shape[1], logits.stride(0), len(which), idx.data_ptr(), out.data_ptr(),
           torch.get_num_threads())
    return out.tolist()
