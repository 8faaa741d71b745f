"""The Triton LoRA kernel (engine/kernels/triton_lora.py, punica's segmented gathered matmul)
against a torch reference computed from each projection's own A, B and scaling: mixed
batches of several adapters and base rows, ranks differing per adapter and per projection
(masked to the step's largest rank), adapters missing a matrix; then through a tiny Llama's
forward on the Triton attention backend, equal to transformers + peft. Without CUDA the
kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest), fp32, on small
shapes; on CUDA the same tests run it compiled."""
import pytest
import torch

pytest.importorskip("triton", reason="the Triton LoRA kernel needs triton (a test dependency on x86-64)")

from pdserve.engine.kernels.triton_lora import Segments, sgmv_add  # noqa: E402
from pdserve.engine.model.lora import FUSED, LoRAAdapter, fuse_layer  # noqa: E402
from pdserve.engine.model.lora_batch import LoRABatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the kernel sums K and the rank in other blocks than torch's matmul (about 1e-6 on
# O(1) outputs here); base rows are compared bit for bit
ATOL, RTOL = 2e-5, 1e-5
SHAPES = {"q_proj": (24, 40), "k_proj": (8, 40), "v_proj": (8, 40), "o_proj": (40, 24),
          "gate_proj": (72, 40), "up_proj": (72, 40), "down_proj": (40, 72)}


def adapter(seed: int, ranks: dict[str, int], scaling: float, layers: int = 2) -> tuple[LoRAAdapter, list]:
    """An adapter with rank `ranks[p]` on each projection p it names, and its raw (A, B) per
    layer and projection (the reference's input)."""
    g = torch.Generator().manual_seed(seed)
    raw, fused = [], []
    for _ in range(layers):
        pairs = {p: (torch.randn(r, SHAPES[p][1], generator=g) * SHAPES[p][1] ** -0.5,
                     torch.randn(SHAPES[p][0], r, generator=g) * r ** -0.5) for p, r in ranks.items()}
        raw.append(pairs)
        fused.append(fuse_layer(pairs, SHAPES, scaling, torch.float32, DEVICE))
    a = LoRAAdapter(f"ad{seed}", None, max(ranks.values()), scaling, tuple(ranks), "0" * 64, fused)
    a.id = seed
    return a, raw


def reference(x, y, groups, raws, scalings, layer, matrix):
    """y + each row's adapter's update, projection by projection into its slice, in float64."""
    out = y.double().clone()
    for (ad, rows), raw, s in zip(groups, raws, scalings):
        rows = torch.arange(x.shape[0]) if rows is None else rows.cpu()
        col = 0
        for p in FUSED[matrix]:
            n = SHAPES[p][0]
            if p in raw[layer]:
                a, b = (t.double() for t in raw[layer][p])
                out[rows, col:col + n] += (x.double().cpu()[rows] @ a.T @ b.T * s).to(out.device)
            col += n
    return out


def out_width(matrix):
    return sum(SHAPES[p][0] for p in FUSED[matrix])


def in_width(matrix):
    return SHAPES[FUSED[matrix][0]][1]


@pytest.fixture(scope="module")
def three():
    """Rank 8 on every projection, scaling 2; rank 3 on q and v and 5 on down (rsLoRA-like
    scaling 0.7); rank 20 on q, k, v only (scaling 0.25: no o/gate_up/down matrices)."""
    every = {p: 8 for p in SHAPES}
    specs = [(1, every, 2.0), (2, {"q_proj": 3, "v_proj": 3, "down_proj": 5}, 0.7),
             (3, {"q_proj": 20, "k_proj": 20, "v_proj": 20}, 0.25)]
    return [adapter(seed, ranks, s) + (s,) for seed, ranks, s in specs]


@pytest.mark.parametrize("matrix", list(FUSED))
def test_mixed_batch_equals_the_reference_and_leaves_base_rows_alone(three, matrix):
    T = 37  # several row blocks of 16 in the longest segment
    rows = [torch.tensor([0, 3, 4, 5, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 30]),
            torch.tensor([1, 2, 6, 25, 26, 27]), torch.tensor([36])]
    base = torch.ones(T, dtype=torch.bool)
    for r in rows:
        base[r] = False
    groups = [(ad, r.to(DEVICE)) for (ad, _, _), r in zip(three, rows)]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, in_width(matrix), generator=g).to(DEVICE)
    y = torch.randn(T, out_width(matrix), generator=g).to(DEVICE)
    segs = Segments(groups, T, DEVICE)
    assert segs.max_rank == 60 and segs.max_len == 19  # qkv of adapter 3: three rank-20 slices stacked
    for layer in range(2):
        got = y.clone()
        sgmv_add(x, got, segs, layer, matrix)
        want = reference(x, y, groups, [raw for _, raw, _ in three], [s for _, _, s in three], layer, matrix)
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
        assert torch.equal(got[base.to(DEVICE)], y[base.to(DEVICE)]), "a base row was written"


def test_one_adapter_on_every_row_and_empty_segments(three):
    """rows None (the whole step under one adapter), next to an adapter with no row at all."""
    (ad1, raw1, s1), (ad2, _, _) = three[0][:3], three[1][:3]
    T = 5
    groups = [(ad1, None), (ad2, torch.empty(0, dtype=torch.long, device=DEVICE))]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(T, 72, generator=g).to(DEVICE), torch.randn(T, 40, generator=g).to(DEVICE)
    got = sgmv_add(x, y.clone(), Segments(groups, T, DEVICE), 1, "down")
    want = reference(x, y, groups[:1], [raw1], [s1], 1, "down")
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


def test_a_step_picks_the_kernel_and_matches_the_torch_path(three):
    """LoRABatch.of_spans as the runner builds it: with `triton` the layer's update goes
    through the kernel (one segment table per step) and equals the torch ops' update."""
    spans = [(0, 6, three[0][0]), (6, 9, None), (9, 20, three[1][0]), (20, 24, three[2][0]), (24, 30, three[0][0])]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(30, 40, generator=g).to(DEVICE), torch.randn(30, out_width("qkv"), generator=g).to(DEVICE)
    by_torch = LoRABatch.of_spans(spans, 30, DEVICE)
    by_torch.triton = False
    by_triton = LoRABatch.of_spans(spans, 30, DEVICE)
    by_triton.triton = True
    want = by_torch.layer(1).add("qkv", x, y.clone())
    got = by_triton.layer(1).add("qkv", x, y.clone())
    assert by_triton._segments is not None and by_torch._segments is None
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(got[6:9], y[6:9])


def test_tiny_llama_on_the_triton_backend_equals_peft(tmp_path):
    """Two peft adapters (all projections at rank 8; q, v, down at rank 4, rsLoRA) and the base
    batched in one engine on the Triton attention backend: the layers' updates go through
    the kernel, and greedy tokens and logprobs equal transformers + peft's."""
    pytest.importorskip("peft")
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.engine.model.weights import load_model
    from tests.conftest import assert_engine_clean
    from tests.helpers.lora import make_adapter, reference as peft_reference, save_small_llama

    n, prompts = 4, [[5, 17, 99, 250, 3, 42, 42, 7], [300, 12, 8]]
    base = save_small_llama(tmp_path / "base")
    models = {"ad1": make_adapter(base, tmp_path / "ad1", seed=1),
              "ad2": make_adapter(base, tmp_path / "ad2", seed=2, r=4, alpha=8,
                                  targets=["q_proj", "v_proj", "down_proj"], use_rslora=True)}
    want = {(lora, i): peft_reference(m, p, n) for lora, m in models.items() for i, p in enumerate(prompts)}
    with models["ad1"].disable_adapter():
        want |= {(None, i): peft_reference(models["ad1"], p, n) for i, p in enumerate(prompts)}
    assert want[("ad1", 0)][0] != want[(None, 0)][0] != want[("ad2", 0)][0], "the adapters must change the output"
    eng = LLMEngine(load_model(base, quantization="none", device=DEVICE), EngineConfig(
        quantization="none", attention="triton", device=DEVICE, cache=CacheConfig(kv_cache_memory=4 << 20),
        lora=LoRAConfig(max_loras=2, modules=tuple((a, str(tmp_path / a)) for a in models))))
    batches, real = [], eng.runner._lora_batch
    eng.runner._lora_batch = lambda ordered: batches.append(real(ordered)) or batches[-1]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    for (lora, i) in want:
        eng.add_request(f"{lora}-{i}", prompts[i], params, lora=lora)
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks, lps = got.setdefault(o.request_id, ([], []))
            toks.extend(o.new_token_ids)
            lps.extend(lp.logprob for lp in o.logprobs)
    for (lora, i), (tokens, logprobs) in want.items():
        assert got[f"{lora}-{i}"][0] == tokens, f"{lora} prompt {i}"
        assert max(abs(a - b) for a, b in zip(got[f"{lora}-{i}"][1], logprobs)) < 2e-4, f"{lora} prompt {i}"
    ran = [b for b in batches if b is not None]
    assert ran and all(b._segments is not None for b in ran), "a step's LoRA update did not take the kernel"
    assert any(len(b.groups) == 2 for b in ran)
    del eng.runner._lora_batch
    assert_engine_clean(eng)
