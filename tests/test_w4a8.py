"""The Q4_1 x int8-activation kernel (engine/kernels/native/w4a8.c) and "auto"'s use of it: the kernel
computes exactly the quantized products it documents, a row's result never depends on its
batch or the thread count, and "exact" keeps fp32 math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import q8a16, w4a8
from pdserve.engine.model.quant import W4A8Linear, WeightOnlyLinear, make_linear

pytestmark = pytest.mark.skipif(not native.available() or not w4a8.available(),
                                reason="the w4a8 kernel needs the native build with AVX2")


def _grid(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return native.quantize_q4_1(torch.randn(n, k, generator=g) * 0.05)


def _reference(x: torch.Tensor, packed, d, m) -> torch.Tensor:
    """What the kernel documents, in float64: each 16 of a row rounded to int8 (fp32 scale
    127 / max|x|, round half to even), integer products with the 4-bit weights scaled per half
    group, plus each group's minimum times the exact sum of its 32 activations."""
    rows, k = x.shape
    h = x.reshape(rows, k // 16, 16)
    amax = h.abs().amax(2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(h * inv).clamp(-127, 127).double()
    dx = (amax / 127).double()
    b = packed.reshape(packed.shape[0], -1, 16)
    qw = torch.cat([b & 15, b >> 4], 2).double().reshape(packed.shape[0], k // 16, 16)
    dw = d.double().repeat_interleave(2, 1)
    dots = torch.einsum("ihk,jhk->ijh", q, qw) * dx[..., 0][:, None, :] * dw[None]
    sums = x.double().reshape(rows, k // 32, 32).sum(2)
    return dots.sum(2) + sums @ m.double().T


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (8, 32), (24, 96)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 65, 130])
def test_the_kernel_computes_the_documented_quantized_products(n, k, rows):
    grid = _grid(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :16] = 0.0  # an all-zero half group: scale 0, no division by it
    y = w4a8.matmul(x, *w4a8.pack(*grid))
    ref = _reference(x, *grid)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # and it approximates the fp32 product of the same weights closely
    exact = x.double() @ native.dequantize_q4_1(*grid).double().T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 0.03  # ~1% on these random rows


def test_a_rows_result_depends_on_nothing_but_the_row():
    """Bitwise the same whatever the other rows, the row's place in a tile, or the threads."""
    packed = w4a8.pack(*_grid(576, 1536))
    x = torch.randn(131, 1536)
    full = w4a8.matmul(x, *packed)
    for lo, hi in ((0, 1), (0, 3), (5, 9), (64, 130), (130, 131)):
        assert torch.equal(w4a8.matmul(x[lo:hi].contiguous(), *packed), full[lo:hi])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w4a8.matmul(x, *packed)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, full)


def test_bad_input_is_refused_with_the_shapes_named():
    packed = w4a8.pack(*_grid(16, 64))
    with pytest.raises(ValueError, match=r"x fp32 \(M, 64\); got torch.float32 \(2, 96\)"):
        w4a8.matmul(torch.randn(2, 96), *packed)  # K does not match
    with pytest.raises(ValueError, match="x fp32"):
        w4a8.matmul(torch.randn(2, 64, dtype=torch.float64), *packed, checked=True)
    with pytest.raises(ValueError, match="w4a8.pack"):
        w4a8.matmul(torch.randn(2, 64), packed[0][:, :1], *packed[1:])  # not the packed form
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a8.pack(*_grid(12, 64))


def test_auto_runs_q4_1_grids_on_int8_activations_and_exact_keeps_fp32_math():
    w = native.dequantize_q4_1(*_grid(64, 96, seed=3))
    x = torch.randn(5, 96)
    auto, exact = make_linear(w, "auto"), make_linear(w, "exact")
    assert isinstance(auto, W4A8Linear) and isinstance(exact, WeightOnlyLinear)
    assert torch.equal(auto(x), w4a8.matmul(x, *auto.packed))
    torch.testing.assert_close(exact(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # a matrix with no whole blocks of 8 outputs, or no grid at all (Q8_0 grids: tests/test_q8a16.py)
    odd = native.dequantize_q4_1(*_grid(12, 96))
    assert isinstance(make_linear(odd, "auto"), WeightOnlyLinear)
    assert not isinstance(make_linear(torch.randn(64, 96), "auto"), (W4A8Linear, WeightOnlyLinear))


def test_without_avx2_auto_falls_back_to_exact(tmp_path, monkeypatch):
    """The portable build (a CPU without AVX2) has no w4a8 kernel: "auto" is then "exact"."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_flags", lambda: ["-O2", "-fPIC", "-shared", "-fopenmp"])
    # every function load() binds, restored after the test: one left on the scalar build would
    # change the numerics of every later engine in the session
    for name in native.BOUND:
        monkeypatch.setattr(native, name, None)
    monkeypatch.setattr(w4a8, "_fn", None)
    monkeypatch.setattr(q8a16, "_fn", None)
    assert not w4a8.available()
    with pytest.raises(RuntimeError, match="AVX2"):
        w4a8.matmul(torch.randn(1, 32), *w4a8.pack(*_grid(8, 32)))
    w = native.dequantize_q4_1(*_grid(64, 96))
    assert isinstance(make_linear(w, "auto"), WeightOnlyLinear)
    q8 = native.dequantize_q8_0(*native.quantize_q8_0(torch.randn(64, 96)))
    assert isinstance(make_linear(q8, "auto"), WeightOnlyLinear)  # the LM head, too
    assert not q8a16.available()
