"""The CPU paged decode-attention kernel (engine/kernels/native/attention.c) against the torch
reference backend, and the engine on it."""
import pytest
import torch

from pdserve.engine.kernels.attention import (
    AttentionMetadata,
    NativeAttentionBackend,
    PrefillSpan,
    TorchAttentionBackend,
    default_backend,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels.native import NativeKernelUnavailable, available
from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")


def _decode_case(seq_lens, n_heads, n_kv, hd, bs, num_blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, n_kv, hd, generator=g)
    v_cache = torch.randn(num_blocks, bs, n_kv, hd, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered over the cache
    tables, used = [], 0
    for n in seq_lens:
        k = (n + bs - 1) // bs
        tables.append(perm[used:used + k])
        used += k
    width = max(len(t) for t in tables) + 1  # padding past the last block must be ignored
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    q = torch.randn(len(seq_lens), n_heads, hd, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decode_tokens=len(seq_lens),
                             decode_block_tables=bt, decode_seq_lens=torch.tensor(seq_lens), prefills=[],
                             block_size=bs)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("seq_lens,n_heads,n_kv,hd,bs", [
    ([1, 5, 16, 17, 40], 9, 3, 64, 16),   # SmolLM2's heads: GQA 3:1, partial and full blocks
    ([3, 33], 4, 4, 16, 8),               # no GQA, head dim 16
    ([7], 8, 1, 24, 4),                   # MQA, head dim not a multiple of 8
    ([300, 2, 129], 9, 3, 64, 32),
])
def test_matches_torch_backend(seq_lens, n_heads, n_kv, hd, bs):
    q, kc, vc, meta = _decode_case(seq_lens, n_heads, n_kv, hd, bs)
    ref_meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
    ref_backend = TorchAttentionBackend()
    ref_backend.prepare(ref_meta)
    ref = ref_backend.decode(q, kc, vc, ref_meta)
    native = NativeAttentionBackend()
    native.prepare(meta)
    got = native.decode(q, kc, vc, meta)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hd", [64, 24])  # the unrolled 64-wide kernels and the generic one
@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_window_matches_torch_backend(hd, kv, window):
    """Each row sees only its last `window` keys: a window starting mid-block, on a block
    boundary, wider than some rows, of one token; over fp32 and int8 caches."""
    from pdserve.engine.kv import formats as kv_format
    q, kc, vc, meta = _decode_case([1, 5, 16, 17, 40, 129], 6, 2, hd, 16)
    if kv == "int8":
        fmt = kv_format.FORMATS[kv_format.CHOICES["int8"]]
        kc, vc = (kv_format.encode(c.view(-1, *c.shape[2:]), fmt).view(*c.shape[:2], *c.shape[2:3], -1)
                  for c in (kc, vc))
    ref_meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
    ref_backend, native = TorchAttentionBackend(), NativeAttentionBackend()
    ref_backend.prepare(ref_meta)
    native.prepare(meta)
    ref = ref_backend.decode(q, kc, vc, ref_meta, window)
    torch.testing.assert_close(native.decode(q, kc, vc, meta, window), ref, atol=2e-5, rtol=1e-4)
    full = ref_backend.decode(q, kc, vc, ref_meta)
    assert torch.equal(ref[:1], full[:1]) and (window >= 129 or not torch.allclose(ref[-1], full[-1]))


def test_peaked_softmax_and_nan_match_torch():
    """The kernel's own exp: scores spread over hundreds (most weights flush to 0) still match
    torch, and a NaN in one sequence's keys shows in its output only (not masked)."""
    q, kc, vc, meta = _decode_case([40, 129, 7], 9, 3, 64, 16)
    q = q * 40
    ref_meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
    ref_backend, native = TorchAttentionBackend(), NativeAttentionBackend()
    ref_backend.prepare(ref_meta)
    native.prepare(meta)
    torch.testing.assert_close(native.decode(q, kc, vc, meta), ref_backend.decode(q, kc, vc, ref_meta),
                               atol=2e-5, rtol=1e-4)
    kc[meta.decode_block_tables[1, 0], 3] = float("nan")
    got = native.decode(q, kc, vc, meta)
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


def test_bad_input_is_a_named_error():
    from pdserve.engine.kernels.native import paged_decode_attention

    q, kc, vc, meta = _decode_case([4], 9, 3, 64, 16)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.double(), kc, vc, meta.decode_block_tables, meta.decode_seq_lens)
    with pytest.raises(ValueError, match="heads"):
        paged_decode_attention(q[:, :8], kc, vc, meta.decode_block_tables, meta.decode_seq_lens)
    with pytest.raises(ValueError, match="block table"):
        paged_decode_attention(q, kc, vc, meta.decode_block_tables[:, :0], meta.decode_seq_lens)
    with pytest.raises(ValueError, match="attention backend"):
        default_backend("cpu", choice="flash")
    with pytest.raises((ValueError, NativeKernelUnavailable)):
        default_backend("cpu", torch.bfloat16, "native")


def test_engine_on_native_backend_equals_torch_backend(make_engine):
    """The tiny model end to end: chunked prefill, prefix hits, decode over many blocks; the
    native backend gives the torch backend's greedy tokens."""
    prompts = [[(i * 7 + j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 40, 71, 16))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for choice in ("torch", "native"):
        eng = make_engine(block_size=8, max_num_batched_tokens=32)
        eng.runner.model.backend = default_backend("cpu", choice=choice)
        assert type(eng.runner.model.backend).__name__ == ("TorchAttentionBackend" if choice == "torch"
                                                    else "NativeAttentionBackend")
        outs[choice] = eng.generate(prompts, params)
    assert outs["native"] == outs["torch"]


def test_auto_picks_native_on_cpu():
    assert isinstance(default_backend("cpu"), NativeAttentionBackend)
    assert EngineConfig().attention == "auto"


def _prefill_case(seed=0, bs=8, n_heads=9, n_kv=3, hd=64):
    """A step with two decode rows and two prefill chunks (one after a cached prefix), its
    K/V already written, as the model hands it to a backend."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(40, bs, n_kv, hd, generator=g), torch.randn(40, bs, n_kv, hd, generator=g)
    decode_tables = torch.tensor([[3, 4, 0], [5, 6, 7]])
    spans = [PrefillSpan(start=2, end=13, num_cached=0, block_table=[10, 11]),
             PrefillSpan(start=13, end=20, num_cached=17, block_table=[20, 21, 22, 23])]
    slots = [sp.block_table[(sp.num_cached + i) // bs] * bs + (sp.num_cached + i) % bs
             for sp in spans for i in range(sp.end - sp.start)]
    T = 20
    meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1] + slots), num_decode_tokens=2,
                             decode_block_tables=decode_tables, decode_seq_lens=torch.tensor([13, 20]),
                             prefills=spans, block_size=bs)
    q = torch.randn(T, n_heads, hd, generator=g)
    k, v = torch.randn(T, n_kv, hd, generator=g), torch.randn(T, n_kv, hd, generator=g)
    return q, k, v, kc, vc, meta


def test_prefill_rows_match_the_torch_backend_and_each_row_is_its_own_computation():
    """Prefill chunks (fresh and after a cached prefix) and decode rows in one step give the
    torch backend's attention; and a prefill row's result is bitwise what the same query gets
    as a lone decode row over the same keys (what makes a cached prefix, a chunk boundary or
    a batch change nothing)."""
    from pdserve.engine.kernels.native import paged_decode_attention
    q, k, v, kc, vc, meta = _prefill_case()
    ref_meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
    ref_backend, native = TorchAttentionBackend(), NativeAttentionBackend()
    ref_backend.prepare(ref_meta)
    ref = ref_backend.forward(q, k, v, kc.clone(), vc.clone(), ref_meta)
    native.prepare(meta)
    got = native.forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    sp = meta.prefills[1]
    for i in (0, 6):  # rows of the chunk after the cached prefix, each as a decode query alone
        row = sp.start + i
        alone = paged_decode_attention(q[row:row + 1], kc, vc, torch.tensor([sp.block_table]),
                                       torch.tensor([sp.num_cached + i + 1]))
        assert torch.equal(alone[0], got[row])


def test_a_bf16_cache_is_read_as_the_fp32_it_rounds_to():
    """The kernel on a bf16 cache gives what it gives on the same values widened to fp32
    (the conversion is exact), for every head size path; the torch backend agrees. Where the
    build reads bf16 in AVX-512 BF16 vectors (D = 64: the query in three bf16 terms, the
    numerators in two), within 2^-15 of fp64 sums of the same bf16 keys and values."""
    from pdserve.engine.kernels import native
    from pdserve.engine.kernels.native import paged_decode_attention
    from tests.helpers.reference import bf16_attention_reference
    in_vectors = "-DPDSERVE_BF16_VECTORS" in native._flags()
    for n_heads, n_kv, hd in ((9, 3, 64), (4, 4, 16)):
        q, kc, vc, meta = _decode_case([1, 17, 40], n_heads, n_kv, hd, 16)
        kb, vb = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
        got = paged_decode_attention(q, kb, vb, meta.decode_block_tables, meta.decode_seq_lens)
        wide = paged_decode_attention(q, kb.float(), vb.float(), meta.decode_block_tables, meta.decode_seq_lens)
        if in_vectors and hd == 64:
            for i, n in enumerate(meta.decode_seq_lens.tolist()):
                table = meta.decode_block_tables[i].tolist()
                ref = bf16_attention_reference(q[i:i + 1], kc, vc, table, torch.tensor([n]), query_bf16=False)
                assert (got[i].double() - ref[0]).abs().max() < 2 ** -15 * vb.float().abs().max()
                assert not torch.equal(got[i], wide[i]) or n == 1  # the vectors did run
        else:
            torch.testing.assert_close(got, wide, atol=1e-6, rtol=1e-6)
        ref_meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
        ref_backend = TorchAttentionBackend()
        ref_backend.prepare(ref_meta)
        torch.testing.assert_close(got, ref_backend.decode(q, kb, vb, ref_meta), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_of_many_rows_gives_each_row_the_bits_it_gets_alone(kv, threads):
    """A step of single rows, two a thread or more, attends a row (all its KV heads, block by
    block) an item; alone, a row's KV heads are items of their own. Every row's output is the
    same bits either way, with a sliding window's skipped keys too, in every cache format, and
    matches the reference."""
    from pdserve.engine.kernels.native import paged_decode_attention
    from pdserve.engine.kv import formats as kv_format
    lens = [1, 5, 16, 17, 40, 300, 129, 64]
    q, kc, vc, meta = _decode_case(lens, 9, 3, 64, 16, num_blocks=96)
    if kv in ("int8", "fp8"):
        fmt = kv_format.FORMATS[kv_format.CHOICES[kv]]
        kc, vc = (kv_format.encode(c.view(-1, *c.shape[2:]), fmt).view(*c.shape[:2], *c.shape[2:3], -1)
                  for c in (kc, vc))
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[kv]
        kc, vc = kc.to(dtype), vc.to(dtype)
    tables, seq = meta.decode_block_tables, meta.decode_seq_lens
    skips = torch.tensor([0, 2, 0, 15, 3, 7, 0, 9])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for sk in (None, skips):
            together = paged_decode_attention(q, kc, vc, tables, seq, skips=sk)
            for i in range(len(lens)):
                alone = paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], seq[i:i + 1],
                                               skips=None if sk is None else sk[i:i + 1])
                assert torch.equal(together[i], alone[0]), (i, (together[i] - alone[0]).abs().max())
    finally:
        torch.set_num_threads(before)
    ref_meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
    ref_backend = TorchAttentionBackend()
    ref_backend.prepare(ref_meta)
    ref = ref_backend.decode(q, kc, vc, ref_meta)
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, tables, seq), ref, atol=2e-5, rtol=1e-4)


def test_kv_cache_dtype_sizes_the_cache_and_is_what_attention_reads(make_engine):
    """bf16 K/V: twice the blocks of fp32 for the same memory, the tiny model's greedy tokens
    as with an fp32 cache; "auto" keeps the model's dtype."""
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.kv.cache import kv_format
    fp32, bf16 = make_engine(), make_engine(kv_cache_dtype="bf16")
    assert bf16.kv_cache.kv.dtype == torch.bfloat16 and fp32.kv_cache.kv.dtype == torch.float32
    assert bf16.kv_cache.num_blocks == 2 * fp32.kv_cache.num_blocks
    prompts = [[(i * 5 + j) % 200 + 3 for j in range(n)] for i, n in enumerate((9, 30))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert bf16.generate(prompts, params) == fp32.generate(prompts, params)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="CPU only"):
        kv_format("bf16", torch.float16, "cuda")
    assert kv_format("auto", torch.float16, "cuda").dtype == torch.float16
    assert kv_format("int8", torch.float16, "cuda").quantized  # the Triton kernel reads 8-bit codes
