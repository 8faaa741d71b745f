"""Triton kernels against the torch path. Without CUDA they run in Triton's interpreter on the
CPU (TRITON_INTERPRET=1, set in conftest before triton loads), on small grids; bf16 inputs
are upcast to fp32 there (the interpreter's bf16 arithmetic is wrong). On CUDA the same tests
run the compiled kernels."""
import pytest
import torch

triton = pytest.importorskip("triton", reason="the GPU kernels need triton (a test dependency on x86-64)")

from pdserve.engine.kernels.attention import AttentionMetadata, TorchAttentionBackend, TritonAttentionBackend  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.engine.core.engine import LLMEngine  # noqa: E402
from pdserve.common.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.model.tiny import tiny_llama  # noqa: E402
from pdserve.engine.kernels.triton_kernels import copy_blocks, paged_decode_attention, store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def caches(n_blocks=12, bs=16, n_kv=2, hd=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_blocks, bs, n_kv, hd, generator=g).to(DEVICE, dtype),
            torch.randn(n_blocks, bs, n_kv, hd, generator=g).to(DEVICE, dtype))


def test_store_kv_writes_exactly_the_slots():
    kc, vc = caches()
    before_k, before_v = kc.clone(), vc.clone()
    k, v = torch.randn(5, 2, 16, device=DEVICE), torch.randn(5, 2, 16, device=DEVICE)
    slots = torch.tensor([3, 17, 40, 100, 191], device=DEVICE)
    store_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    others = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(flat_k[others], before_k.view(-1, 2, 16)[others])  # nothing else touched
    assert torch.equal(flat_v[others], before_v.view(-1, 2, 16)[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads", [2, 4])  # plain and grouped-query attention
def test_paged_decode_equals_the_torch_backend(dtype, n_heads):
    kc, vc = caches(dtype=dtype)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [11, 0, 0, 0], [4, 6, 8, 9]], device=DEVICE)
    lens = torch.tensor([40, 20, 1, 64], device=DEVICE)  # partial, full and single-token blocks
    q = torch.randn(4, n_heads, 16, device=DEVICE).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=4,
                             decode_block_tables=tables, decode_seq_lens=lens, prefills=[], block_size=16)
    ref_backend = TorchAttentionBackend()
    ref_backend.prepare(meta)
    ref = ref_backend.decode(q.float(), kc.float(), vc.float(), meta)
    got = paged_decode_attention(q, kc, vc, tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, ref, atol=tol, rtol=tol), (got - ref).abs().max()


def test_copy_blocks_gathers_and_scatters():
    kc, _ = caches()
    buf = torch.zeros(3, *kc.shape[1:], device=DEVICE)
    ids = torch.tensor([3, 7, 1], device=DEVICE)
    copy_blocks(kc, buf, ids, torch.arange(3, device=DEVICE))  # export: cache -> contiguous buffer
    assert torch.equal(buf, kc[ids])
    dest, _ = caches(seed=1)
    copy_blocks(buf, dest, torch.arange(3, device=DEVICE), torch.tensor([9, 0, 5], device=DEVICE))  # import
    assert torch.equal(dest[[9, 0, 5]], buf)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("n_heads", [2, 4])
def test_paged_decode_reads_8_bit_caches_as_the_torch_backend(fmt, n_heads):
    """Codes and their per-row scales read in place (engine/kv/formats.py), the same attention
    as the torch backend's on the same cache."""
    from pdserve.engine.kv import formats as kv_format
    kc, vc = (kv_format.encode(c, kv_format.FORMATS[fmt]) for c in caches())
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [11, 0, 0, 0], [4, 6, 8, 9]], device=DEVICE)
    lens = torch.tensor([40, 20, 1, 64], device=DEVICE)
    q = torch.randn(4, n_heads, 16, device=DEVICE)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=4,
                             decode_block_tables=tables, decode_seq_lens=lens, prefills=[], block_size=16)
    ref_backend = TorchAttentionBackend()
    ref_backend.prepare(meta)
    ref = ref_backend.decode(q, kc, vc, meta)
    got = paged_decode_attention(q, kc, vc, tables, lens)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_tiny_model_generates_the_same_with_the_triton_backend(kv):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(9 + 11 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cache = CacheConfig(kv_cache_memory=2 << 20, kv_cache_dtype=kv)
    want = LLMEngine(tiny_llama(0), EngineConfig(cache=cache, attention="torch")).generate(prompts, params)
    eng = LLMEngine(tiny_llama(0), EngineConfig(cache=cache, attention="triton"))
    assert isinstance(eng.runner.model.backend, TritonAttentionBackend)
    assert eng.generate(prompts, params) == want
    assert eng.blocks.num_used_blocks == 0
