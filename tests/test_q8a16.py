"""The Q8_0 x int16 kernel (engine/kernels/native/q8a16.c): what "auto" runs a GGUF's Q8_0 LM
head on. Checked against its documented arithmetic in float64, for batch invariance
(the one-row path and the four-row tiles give the same bits), and for its choice by make_linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import q8a16
from pdserve.engine.model.quant import Q8A16Linear, WeightOnlyLinear, make_linear

pytestmark = pytest.mark.skipif(not native.available() or not q8a16.available(),
                                reason="the q8a16 kernel needs the native build with AVX2")


def _grid(n: int, k: int, seed: int = 0):
    return native.quantize_q8_0(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)


def _reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """In float64: each 32 of a row rounded to int16 (fp32 scale 32767 / max|x|, round half to
    even), integer products with the signed weights per group, scaled by d_w * d_x."""
    rows, k = x.shape
    h = x.reshape(rows, k // 32, 32)
    amax = h.abs().amax(2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    xq, dx = torch.round(h * inv).clamp(-32767, 32767).double(), (amax / 32767).double()[..., 0]
    qw = q.double().reshape(q.shape[0], k // 32, 32)
    return (torch.einsum("igk,jgk->ijg", xq, qw) * dx[:, None, :] * d.double()[None]).sum(2)


@pytest.mark.parametrize("n,k", [(960, 576), (8, 32), (24, 96)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 65])
def test_the_kernel_computes_the_documented_quantized_products(n, k, rows):
    q, d = _grid(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0.0  # an all-zero group: scale 0
    q[0, :32] = -127  # the extreme products: a group's sum stays inside int32
    x[-1, :32] = -5.0
    y = q8a16.matmul(x, *q8a16.pack(q, d))
    ref = _reference(x, q, d)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    exact = x.double() @ native.dequantize_q8_0(q, d).double().T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-4  # int16: near the fp32 product


def test_a_rows_logits_depend_on_nothing_but_the_row():
    """Bitwise the same alone (the one-row path) or in any tile of a batch, on any threads."""
    packed = q8a16.pack(*_grid(1024, 576))
    x = torch.randn(67, 576)
    full = q8a16.matmul(x, *packed)
    for lo, hi in ((0, 1), (3, 4), (0, 3), (5, 9), (64, 67), (66, 67)):
        assert torch.equal(q8a16.matmul(x[lo:hi].contiguous(), *packed), full[lo:hi])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(q8a16.matmul(x, *packed), full)
    finally:
        torch.set_num_threads(n)


def test_bad_input_is_refused_with_the_shapes_named():
    q, d = _grid(16, 64)
    packed = q8a16.pack(q, d)
    with pytest.raises(ValueError, match=r"x fp32 \(M, 64\); got torch.float32 \(2, 96\)"):
        q8a16.matmul(torch.randn(2, 96), *packed)
    with pytest.raises(ValueError, match="N % 8 == 0"):
        q8a16.pack(*_grid(12, 64))
    with pytest.raises(ValueError, match="int8 q"):
        q8a16.pack(q.float(), d)


def test_auto_runs_q8_0_grids_on_int8_activations_and_exact_keeps_fp32_math():
    w = native.dequantize_q8_0(*_grid(64, 96, seed=3))
    x = torch.randn(5, 96)
    auto, exact = make_linear(w, "auto"), make_linear(w, "exact")
    assert isinstance(auto, Q8A16Linear) and isinstance(exact, WeightOnlyLinear)
    assert torch.equal(auto(x), q8a16.matmul(x, *auto.packed))
    torch.testing.assert_close(auto(x), F.linear(x, w), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(exact(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert not hasattr(auto, "dequantized")  # one byte per weight: no fp32 copy of the head


def test_the_decode_step_benchmark_times_both_heads():
    """bench/decode_step.py's LM-head rows: both kernels on the same Q8_0 weights, per row count."""
    from types import SimpleNamespace

    from pdserve.bench.decode_step import head_times
    w = native.dequantize_q8_0(*_grid(8192, 576))  # large enough that its times do not round to 0 ms
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=SimpleNamespace(data=w)))
    out = head_times(model, [1, 3], repeats=2, bw=10e9)
    assert set(out) == {"1", "3"}
    assert all(v["int16_act_ms"] > 0 and v["fp32_act_ms"] > 0 and v["roof_fraction_int16_act"] > 0 for v in out.values())
