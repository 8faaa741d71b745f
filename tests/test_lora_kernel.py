"""The C LoRA routine (engine/kernels/native/lora.c): y[rows] += (x[rows] @ A.T) @ B.T, as the
Python path and the C decode step both compute it; checked against torch in float64, for a
row's independence of the others and of the threads, and for its errors."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import lora

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels need a C compiler")


def _case(M=7, K=96, N=40, r=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g), torch.randn(M, N, generator=g), torch.randn(r, K, generator=g),
            torch.randn(N, r, generator=g))


@pytest.mark.parametrize("shape", [(7, 96, 40, 5), (1, 576, 960, 48), (9, 13, 11, 3)])
def test_rows_add_is_the_low_rank_update(shape):
    x, y, a, b = _case(*shape)
    rows = torch.tensor(sorted({0, shape[0] - 1}), dtype=torch.int64)
    want = y.double().clone()
    want[rows] += (x[rows].double() @ a.double().T) @ b.double().T
    got = lora.rows_add(x, y.clone(), a, b.T.contiguous(), rows)
    assert (got.double() - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    untouched = [i for i in range(shape[0]) if i not in rows.tolist()]
    assert torch.equal(got[untouched], y[untouched])
    every = lora.rows_add(x, y.clone(), a, b.T.contiguous())
    assert torch.allclose(every.double(), y.double() + (x.double() @ a.double().T) @ b.double().T, atol=1e-3)


def test_a_rows_update_depends_on_nothing_but_the_row():
    x, y, a, b = _case(M=33, K=576, N=200, r=16)
    bt = b.T.contiguous()
    full = lora.rows_add(x, y.clone(), a, bt)
    for lo, hi in ((0, 1), (5, 9), (32, 33)):
        assert torch.equal(lora.rows_add(x[lo:hi], y[lo:hi].clone(), a, bt), full[lo:hi])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lora.rows_add(x, y.clone(), a, bt), full)
    finally:
        torch.set_num_threads(n)


def test_bad_input_is_refused():
    x, y, a, b = _case()
    with pytest.raises(ValueError, match="bt"):
        lora.rows_add(x, y, a, b)  # B not transposed
    with pytest.raises(ValueError, match="rows must lie"):
        lora.rows_add(x, y, a, b.T.contiguous(), torch.tensor([7]))
    with pytest.raises(ValueError, match="fp32"):
        lora.rows_add(x.double(), y, a, b.T.contiguous())
