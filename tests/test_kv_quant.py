"""8-bit KV formats (engine/kv/formats.py): the codes and scales written when K/V are stored,
and every attention path reading them in place (the C kernel, the torch reference; the
Triton kernel in test_triton_kernels) to the same result."""
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv import formats as kv_format
from pdserve.engine.kernels.attention import AttentionMetadata, NativeAttentionBackend, TorchAttentionBackend
from pdserve.common.errors import KVTransferError
from pdserve.engine.kernels.native import available, paged_decode_attention

INT8, FP8 = kv_format.FORMATS["int8"], kv_format.FORMATS["float8_e4m3fn"]
native = pytest.mark.skipif(not available(), reason="no C compiler for the native kernels")

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def rows(n=50, heads=3, hd=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, hd, generator=g) * torch.rand(n, heads, 1, generator=g) * 8


@pytest.mark.parametrize("encode", [kv_format.encode, kv_format.encode_reference], ids=["encode", "reference"])
def test_int8_rows_round_to_their_scale_and_keep_their_bytes(encode):
    x = rows()
    x[3, 1] = 0.0  # an all-zero row: scale 1, codes 0, decoded exactly
    enc = encode(x, INT8)
    assert enc.dtype == torch.int8 and enc.shape == (50, 3, 68)
    scale = enc.view(torch.uint8)[..., 64:].contiguous().view(torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scale[amax > 0], (amax / 127)[amax > 0])
    assert scale[3, 1].item() == 1.0
    back = kv_format.decode(enc)
    assert back.shape == x.shape and torch.equal(back[3, 1], torch.zeros(64))
    assert ((back - x).abs() <= scale / 2 + 1e-6).all()  # half a step at most
    assert enc[..., :64].abs().max() == 127  # each row's largest value uses the full range


@pytest.mark.parametrize("encode", [kv_format.encode, kv_format.encode_reference], ids=["encode", "reference"])
def test_fp8_rows_keep_three_mantissa_bits_relative_to_their_scale(encode):
    x = rows(seed=1)
    enc = encode(x, FP8)
    back = kv_format.decode(enc)
    scale = enc.view(torch.uint8)[..., 64:].contiguous().view(torch.float32)
    normal = x.abs() >= scale * 2 ** -6  # e4m3's normal range
    assert ((back - x).abs()[normal] <= (x.abs() / 16)[normal] + 1e-6).all()
    assert ((back - x).abs()[~normal] <= (scale * 2 ** -10).expand_as(x)[~normal] + 1e-7).all()
    # the codes are torch's own e4m3 rounding of x / scale
    codes = enc.view(torch.uint8)[..., :64].contiguous().view(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), (x / scale).to(torch.float8_e4m3fn).view(torch.uint8))


@native
@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8", "fp8"])
def test_whole_tensors_decode_in_c_as_in_torch(fmt):
    from pdserve.engine.kernels.native import kv_load_8bit
    enc = kv_format.encode(rows(n=2000, seed=5), fmt)  # above the size decode hands to C
    raw = enc.view(torch.uint8)
    want = raw[..., :64].contiguous().view(fmt.dtype).float() * raw[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(kv_load_8bit(enc), want) and torch.equal(kv_format.decode(enc), want)
    with pytest.raises(ValueError, match="int8 or fp8 rows"):
        kv_load_8bit(torch.zeros(3, 68))


def test_convert_between_formats_and_refuse_unknown_dtypes():
    x = rows(seed=2)
    i8 = kv_format.encode(x, INT8)
    assert kv_format.convert(i8, INT8) is i8
    assert torch.equal(kv_format.convert(i8, kv_format.FORMATS["float32"]), kv_format.decode(i8))
    f8 = kv_format.convert(i8, FP8)
    assert f8.dtype == torch.float8_e4m3fn and torch.equal(f8.view(torch.uint8),
                                                           kv_format.encode(kv_format.decode(i8), FP8).view(torch.uint8))
    with pytest.raises(KVTransferError, match="unsupported KV dtype"):
        kv_format.format_of(torch.int16)
    assert INT8.row_width(64) == 68 and INT8.bytes_per_row(64) == 68 and kv_format.FORMATS["float32"].bytes_per_row(64) == 256


def _decode_case(fmt, seq_lens, n_heads, n_kv, hd, bs=16, num_blocks=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = kv_format.encode(torch.randn(num_blocks, bs, n_kv, hd, generator=g) * 3, fmt)
    vc = kv_format.encode(torch.randn(num_blocks, bs, n_kv, hd, generator=g), fmt)
    perm = torch.randperm(num_blocks, generator=g)
    width = max((n + bs - 1) // bs for n in seq_lens) + 1
    tables = perm[:len(seq_lens) * width].view(len(seq_lens), width)
    q = torch.randn(len(seq_lens), n_heads, hd, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decode_tokens=len(seq_lens),
                             decode_block_tables=tables, decode_seq_lens=torch.tensor(seq_lens), prefills=[],
                             block_size=bs)
    return q, kc, vc, meta


@native
@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("n_heads,n_kv,hd", [(9, 3, 64), (4, 4, 16), (8, 1, 24)])
def test_the_c_kernel_reads_8_bit_caches_as_the_torch_reference(fmt, n_heads, n_kv, hd):
    """Both the unrolled head-dim-64 path and the generic one: scores scaled per key row,
    softmax weights per value row, the same attention as dequantizing first."""
    q, kc, vc, meta = _decode_case(fmt, [1, 9, 16, 40, 95], n_heads, n_kv, hd)
    ref = TorchAttentionBackend()
    ref_meta = AttentionMetadata(**{**meta.__dict__, "backend_state": {}})
    ref.prepare(ref_meta)
    want = ref.decode(q, kc, vc, ref_meta)
    got = paged_decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_seq_lens)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    dense = paged_decode_attention(q, kv_format.decode(kc), kv_format.decode(vc), meta.decode_block_tables,
                                   meta.decode_seq_lens)
    assert torch.equal(got, dense)  # rows decoded, then the fp32 arithmetic: bitwise the fp32 kernel's on them


@native
@pytest.mark.parametrize("hd", [64, 16])
def test_every_fp8_code_decodes_as_torch_decodes_it(hd):
    """One token per sequence: the output is its V row, so each code's value (subnormals,
    signs, zero, the largest normal) shows directly."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 non-NaN codes
    n = -(-codes.numel() // hd)
    padded = torch.cat([codes, torch.zeros(n * hd - codes.numel(), dtype=torch.uint8)]).view(n, 1, 1, hd)
    scale = torch.full((n, 1, 1, 1), 0.75).view(torch.uint8)
    vc = torch.cat([padded, scale], dim=-1).view(torch.float8_e4m3fn)  # n blocks of one token, one head
    kc = vc.clone()
    q = torch.randn(n, 1, hd)
    got = paged_decode_attention(q, kc, vc, torch.arange(n).view(n, 1), torch.ones(n, dtype=torch.long))
    want = padded.view(torch.float8_e4m3fn).float().view(n, 1, hd) * 0.75
    assert torch.equal(got, want)


@native
def test_native_and_torch_backends_store_the_same_bytes_and_attend_alike():
    """A step with decode rows and prefill chunks (one after a cached prefix): both backends
    write identical codes and scales, and give the same attention."""
    g = torch.Generator().manual_seed(3)
    bs, n_heads, n_kv, hd = 8, 9, 3, 64
    from pdserve.engine.kernels.attention import PrefillSpan
    spans = [PrefillSpan(start=2, end=13, num_cached=0, block_table=[10, 11]),
             PrefillSpan(start=13, end=20, num_cached=17, block_table=[20, 21, 22, 23])]
    slots = [sp.block_table[(sp.num_cached + i) // bs] * bs + (sp.num_cached + i) % bs
             for sp in spans for i in range(sp.end - sp.start)]
    q = torch.randn(20, n_heads, hd, generator=g)
    k, v = torch.randn(20, n_kv, hd, generator=g), torch.randn(20, n_kv, hd, generator=g)
    for fmt in (INT8, FP8):
        base_k = kv_format.encode(torch.randn(40, bs, n_kv, hd, generator=g), fmt)
        base_v = kv_format.encode(torch.randn(40, bs, n_kv, hd, generator=g), fmt)
        outs, caches = [], []
        for backend in (TorchAttentionBackend(), NativeAttentionBackend()):
            meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1] + slots), num_decode_tokens=2,
                                     decode_block_tables=torch.tensor([[3, 4, 0], [5, 6, 7]]),
                                     decode_seq_lens=torch.tensor([13, 20]), prefills=spans, block_size=bs)
            kc, vc = base_k.clone(), base_v.clone()
            backend.prepare(meta)
            outs.append(backend.forward(q, k, v, kc, vc, meta))
            caches.append((kc.view(torch.uint8), vc.view(torch.uint8)))
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
        torch.testing.assert_close(outs[1], outs[0], atol=3e-5, rtol=1e-4)
        kc, vc = (c.view(fmt.dtype) for c in caches[1])
        sp = spans[1]
        for i in (0, 6):  # a prefill row (over the step's decoded copy) is bitwise the same query as a lone decode row
            row = sp.start + i
            alone = paged_decode_attention(q[row:row + 1], kc, vc, torch.tensor([sp.block_table]),
                                           torch.tensor([sp.num_cached + i + 1]))
            assert torch.equal(alone[0], outs[1][row])


def test_block_count_grows_with_the_format(make_engine):
    """For the same --kv-cache-memory: fp32 rows of 16 values are 64 bytes, 8-bit rows 20 (16
    codes and a 4-byte scale) for the tiny model; the report counts what the memory holds."""
    fp32, i8, f8 = (make_engine(kv_cache_dtype=k) for k in ("fp32", "int8", "fp8"))
    assert i8.kv_cache.num_blocks == f8.kv_cache.num_blocks == fp32.kv_cache.bytes_per_block * fp32.kv_cache.num_blocks \
        // i8.kv_cache.bytes_per_block
    assert i8.kv_cache.bytes_per_block * 64 == fp32.kv_cache.bytes_per_block * 20
    assert i8.kv_cache.format.name == "int8" and f8.kv_cache.format.name == "float8_e4m3fn"
    assert i8.kv_cache.layout == fp32.kv_cache.layout  # what a hand-off header describes


@native
@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8", "fp8"])
def test_the_c_store_writes_what_encode_writes_ties_and_subnormals_included(fmt):
    """Rows whose scale is exactly 1 (absmax = qmax), holding every representable value and
    every midpoint between neighbours (ties round to even), then random rows: the C store
    and kv_format.encode write the same bytes, and only into the given slots."""
    from pdserve.engine.kernels.native import kv_store_8bit
    if fmt is INT8:
        grid = torch.arange(-127, 128, dtype=torch.float32)
    else:
        pos = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = torch.cat([-pos.flip(0), pos])
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    hd = 16
    values = torch.cat([values, torch.zeros(-values.numel() % (hd - 1))]).view(-1, hd - 1)
    crafted = torch.cat([torch.full((values.shape[0], 1), fmt.qmax), values], dim=1).view(-1, 1, hd)
    x = torch.cat([crafted, rows(n=crafted.shape[0], heads=1, hd=hd, seed=4)])
    cache = torch.zeros(x.shape[0] // 8 + 4, 8, 1, hd + 4, dtype=torch.uint8).view(fmt.dtype)
    slots = torch.randperm(cache.shape[0] * 8, generator=torch.Generator().manual_seed(0))[:x.shape[0]]
    kv_store_8bit(x, cache, slots)
    flat = cache.view(torch.uint8).view(-1, 1, hd + 4)
    assert torch.equal(flat[slots], kv_format.encode_reference(x, fmt).view(torch.uint8))
    assert torch.equal(kv_format.encode(x, fmt).view(torch.uint8), kv_format.encode_reference(x, fmt).view(torch.uint8))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat[untouched].any()
    with pytest.raises(ValueError, match="slot"):
        kv_store_8bit(x[:1], cache, torch.tensor([cache.shape[0] * 8]))


def test_auto_keeps_bf16_kv_where_the_matrices_quantize_their_activations(smollm):
    """The default cache format follows the numerics: bf16 for the default model under "auto"
    (int8 activations, llama.cpp's numerics, whose cache is 16-bit too), fp32 under "exact" and
    for an fp32 model; a GPU keeps the model's dtype."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv.cache import engine_kv_format, kv_format
    from pdserve.engine.model.tiny import tiny_llama
    from pdserve.engine.model.weights import load_model

    assert kv_format("auto", torch.float32, "cpu", int8_activations=True).dtype is torch.bfloat16
    assert kv_format("auto", torch.float32, "cpu").dtype is torch.float32
    assert kv_format("auto", torch.float16, "cuda", int8_activations=True).dtype is torch.float16
    assert kv_format("fp32", torch.float32, "cpu", int8_activations=True).dtype is torch.float32  # asked for
    assert engine_kv_format(EngineConfig(), tiny_llama(0).model).name == "float32"
    model = smollm[0].model
    assert engine_kv_format(EngineConfig(), model).name == ("bfloat16" if model.int8_activation_matrices() else "float32")
    exact = load_model(quantization="exact")
    assert exact.model.int8_activation_matrices() == 0
    assert engine_kv_format(EngineConfig(quantization="exact"), exact.model).name == "float32"


def _mapping_of(address: int) -> tuple[str, int]:
    """The VmFlags and AnonHugePages (kB) of this process's mapping that holds `address`."""
    flags, huge, inside = "", 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            flags = line
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
    return flags, huge


@pytest.mark.skipif(sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off here")
def test_the_kv_pool_is_advised_onto_huge_pages(make_engine):
    """The pool a decode step's attention reads from all over sits on memory advised for
    transparent huge pages (VmFlags `hg`), and it still starts as zeros."""
    from pdserve.engine.kv.cache import HUGE_PAGE, advise_huge_pages
    eng = make_engine(kv_cache_memory=4 * HUGE_PAGE)
    kv = eng.kv_cache.kv
    assert kv.nbytes >= 3 * HUGE_PAGE and not kv.any()
    flags, _ = _mapping_of(kv.data_ptr() + 2 * HUGE_PAGE)
    assert " hg" in flags, flags
    assert not advise_huge_pages(torch.zeros(16))  # no whole huge page inside: nothing to advise
