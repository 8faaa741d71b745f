"""Runs of a prompt's rows attend together (engine/kernels/native/attention_rows.c): every row's
result is bitwise what the same query gets alone, over fp32 and bf16 caches, across run
boundaries, with shared prefixes, windows and decode rows in the same call."""
import math

import pytest
import torch

from pdserve.engine.kernels.native import available, paged_decode_attention

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")


def _rows(spans, bs, width):
    """spans: (block table, first len, rows) -> per-row tables and lens (a run per span)."""
    tables, lens = [], []
    for table, first, n in spans:
        for i in range(n):
            tables.append(table + [0] * (width - len(table)))
            lens.append(first + i)
    return torch.tensor(tables, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)


def _reference(q, kc, vc, tables, lens, skips, bs):
    """float64 softmax(q k^T / sqrt(d)) v per row over its keys [skip, len)."""
    B, H, D = q.shape
    kvh = kc.shape[2]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for r in range(B):
        n = int(lens[r])
        blocks = tables[r, :(n + bs - 1) // bs]
        k = kc[blocks].reshape(-1, kvh, D)[:n].double()
        v = vc[blocks].reshape(-1, kvh, D)[:n].double()
        s0 = 0 if skips is None else int(skips[r])
        for h in range(H):
            kh = h // (H // kvh)
            w = torch.softmax((k[s0:, kh] @ q[r, h].double()) / math.sqrt(D), 0)
            out[r, h] = w @ v[s0:, kh]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv,hd", [(9, 3, 64), (4, 4, 64), (6, 2, 24)])
def test_each_row_of_a_run_is_its_own_computation(dtype, n_heads, n_kv, hd):
    bs, g = 16, torch.Generator().manual_seed(7)
    kc = torch.randn(80, bs, n_kv, hd, generator=g).to(dtype)
    vc = torch.randn(80, bs, n_kv, hd, generator=g).to(dtype)
    shared = [11, 3, 40, 7]
    spans = [
        (shared + [5, 6], 60, 37),         # a prompt chunk after a cached prefix: runs of 16, 16, 5
        (shared + [12, 13, 14], 1, 90),    # a fresh prompt sharing the first blocks with the first
        ([20, 21], 17, 1),                 # a decode row
        ([30, 31, 32], 20, 9),             # a short chunk starting mid-block
    ]
    width = 8
    tables, lens = _rows(spans, bs, width)
    q = torch.randn(len(lens), n_heads, hd, generator=g)
    got = paged_decode_attention(q, kc, vc, tables, lens)
    for r in range(len(lens)):
        alone = paged_decode_attention(q[r:r + 1], kc, vc, tables[r:r + 1], lens[r:r + 1])
        assert torch.equal(alone[0], got[r]), f"row {r}"
    ref = _reference(q, kc.float(), vc.float(), tables, lens, None, bs)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-4)


def test_rows_with_windows_and_tables_that_part_are_not_merged_wrongly():
    """Consecutive positions whose skips differ (a sliding window) or whose tables part after
    the shared blocks attend as their own rows: each equals itself alone and the reference."""
    bs, g = 8, torch.Generator().manual_seed(3)
    kc, vc = torch.randn(40, bs, 3, 64, generator=g), torch.randn(40, bs, 3, 64, generator=g)
    tables = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 3, 9]], dtype=torch.int64)
    lens = torch.tensor([25, 26, 27, 28], dtype=torch.int64)
    for skips in (None, torch.tensor([0, 0, 2, 2], dtype=torch.int64)):
        q = torch.randn(4, 9, 64, generator=g)
        got = paged_decode_attention(q, kc, vc, tables, lens, skips=skips)
        for r in range(4):
            alone = paged_decode_attention(q[r:r + 1], kc, vc, tables[r:r + 1], lens[r:r + 1],
                                           skips=None if skips is None else skips[r:r + 1])
            assert torch.equal(alone[0], got[r])
        torch.testing.assert_close(got.double(), _reference(q, kc, vc, tables, lens, skips, bs), atol=2e-5,
                                   rtol=1e-4)
