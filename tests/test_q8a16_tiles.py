"""The Q8_0 x int16 kernel's tiles (engine/kernels/native/q8a16.c: 4 rows x 2 column blocks, 8 or
12 rows of a pair in 512-bit vectors, the last rows and an odd last block alone) at every row
count 1..70 and at random shapes: each row's logits are bitwise the ones an fp32 emulation of
the documented arithmetic gives, and the ones the row gets alone, on one thread or two."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import q8a16

pytestmark = pytest.mark.skipif(not native.available() or not q8a16.available(),
                                reason="the q8a16 kernel needs the native build with AVX2")

_gen = torch.Generator().manual_seed(29)
# (N, K): random multiples of 8 and 32, N / 8 odd in half of them (a block without a pair)
SHAPES = [(8, 32), (24, 96), (40, 64)] + [
    (8 * int(torch.randint(1, 41, (1,), generator=_gen)), 32 * int(torch.randint(1, 21, (1,), generator=_gen)))
    for _ in range(4)]


def _problem(n: int, k: int, rows: int = 70, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + n + k)
    q, d = native.quantize_q8_0(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g) * 3
    x[1, :32] = 0.0  # an all-zero group: its scale is 0
    return x, q, d


def _emulated(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The kernel's fp32 arithmetic step by step: per 32 of a row d_x = max|x| / 32767 and
    xq = round-half-even(x * (32767 / max|x|)); per group the exact integer sum, converted to fp32
    and accumulated as acc = fma(isum, d_w * d_x, acc) over groups in order from +0 (the fma
    emulated in float64, where the product of two fp32 values is exact)."""
    rows, k = x.shape
    h = x.reshape(rows, k // 32, 32)
    amax = h.abs().amax(2)
    dx = amax / 32767.0
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    xq = torch.round(h * inv[..., None]).clamp(-32767, 32767).to(torch.int64)
    qw = q.to(torch.int64).reshape(q.shape[0], k // 32, 32)
    acc = torch.zeros(rows, q.shape[0], dtype=torch.float32)
    for g in range(k // 32):
        isum = (xq[:, g] @ qw[:, g].T).to(torch.float32)
        scale = d[None, :, g].float() * dx[:, None, g]
        acc = (isum.double() * scale.double() + acc.double()).float()
    return acc


def _with_threads(n: int, fn):
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_row_count_gives_each_row_its_bits_alone_and_the_emulated_ones(n, k):
    x, q, d = _problem(n, k)
    packed = q8a16.pack(q, d)
    alone = torch.cat([q8a16.matmul(x[i:i + 1].contiguous(), *packed) for i in range(x.shape[0])])
    ref = _emulated(x, q, d)
    assert torch.equal(alone, ref), f"{(alone - ref).abs().max().item()} off the emulated fp32 arithmetic"
    for threads in (1, 2):
        for rows in range(1, x.shape[0] + 1):
            y = _with_threads(threads, lambda: q8a16.matmul(x[:rows].contiguous(), *packed))
            assert torch.equal(y, alone[:rows]), f"{rows} rows on {threads} threads: " \
                                                 f"{(y - alone[:rows]).abs().max().item()} off"
    exact = x.double() @ native.dequantize_q8_0(q, d).double().T
    assert ((alone.double() - exact).norm() / exact.norm()).item() < 1e-4  # int16 activations: near exact


def test_a_head_sized_matrix_matches_the_emulation_at_decode_batch_sizes():
    """SmolLM2's head width (576) and enough columns for several pairs per thread."""
    x, q, d = _problem(1000, 576, rows=37, seed=1)
    packed = q8a16.pack(q, d)
    ref = _emulated(x, q, d)
    for rows in (1, 4, 8, 32, 37):
        assert torch.equal(q8a16.matmul(x[:rows].contiguous(), *packed), ref[:rows])
