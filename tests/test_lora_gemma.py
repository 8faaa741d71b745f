"""LoRA adapters on Gemma 3 against transformers + peft: a small random Gemma 3 (two sliding
layers and a global one, qk-norm, GeGLU, scaled queries) with two peft adapters of random
non-zero weights; greedy tokens and their logprobs equal, each adapter alone and both batched
with the base in one step, on the torch path, on the C kernels (the C LoRA routine in the
layer loop: Gemma never takes the one-call C decode step) and on the Triton backend (the
Triton LoRA kernel). The real Gemma 3 270M with an adapter through `pdserve up`:
tests/test_multi_model_up.py."""

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model import native_step
from pdserve.engine.model.weights import load_model
from tests.conftest import assert_engine_clean
from tests.helpers.lora import SMALL, peaked_random, two_adapters

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

GEMMA = dict(head_dim=32, tie_word_embeddings=False, sliding_window=8, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"])
PROMPTS = [[5, 17, 99, 250, 3, 42, 42, 7], [300, 12, 8], list(range(20, 44))]  # the last one past the window
N = 8
LOGPROB_TOL = 2e-4  # as tests/test_lora.py: fp32 throughout


def save_small_gemma3(path):
    """transformers' Gemma3ForCausalLM with peaked random weights (as tests/test_architectures.py
    draws them), saved. Its LM head is not tied: tied to embeddings scaled by sqrt(hidden), a
    random model only repeats its last token, whatever the adapter."""
    peaked_random(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**(SMALL | GEMMA))).eval()
                  ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The base directory and transformers + peft's (tokens, logprobs) per adapter (None: the
    base) and prompt: ad1 on all seven projections at rank 8, ad2 on q, v and down at rank 4
    with rsLoRA."""
    root = tmp_path_factory.mktemp("lora-gemma")
    base = save_small_gemma3(root / "base")
    want, _, _ = two_adapters(base, root, PROMPTS, N)
    return root, want


def gemma_engine(root, attention: str) -> LLMEngine:
    loaded = load_model(root / "base", quantization="none")
    assert loaded.config.model_type == "gemma3"
    return LLMEngine(loaded, EngineConfig(
        quantization="none", attention=attention, cache=CacheConfig(kv_cache_memory=8 << 20),
        lora=LoRAConfig(max_loras=2, modules=(("ad1", str(root / "ad1")), ("ad2", str(root / "ad2"))))))


@pytest.fixture(scope="module", params=["torch", "native"])
def engine(request, ref):
    return gemma_engine(ref[0], request.param)


def run(eng, jobs):
    """Add every (id, prompt, adapter) job, step to the end: {id: (tokens, logprobs)}."""
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0)
    for rid, prompt, lora in jobs:
        eng.add_request(rid, prompt, params, lora=lora)
    out = {rid: ([], []) for rid, _, _ in jobs}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.logprobs)
    assert_engine_clean(eng)
    assert eng.loras.in_use == 0
    return out


def assert_matches(got, want, what):
    assert got[0] == want[0], f"{what}: tokens {got[0]} != transformers+peft {want[0]}"
    diff = max(abs(a - b) for a, b in zip(got[1], want[1]))
    assert diff < LOGPROB_TOL, f"{what}: logprobs differ by {diff:.2e}"


@pytest.mark.parametrize("lora", ["ad1", "ad2", None])
def test_alone_equal_to_peft(engine, ref, lora):
    for i, prompt in enumerate(PROMPTS):
        assert_matches(run(engine, [("r", prompt, lora)])["r"], ref[1][lora][i], f"{lora} prompt {i}")


def test_two_adapters_and_the_base_batched_in_one_step(engine, ref):
    jobs = [(f"{lora}-{i}", p, lora) for i, p in enumerate(PROMPTS) for lora in ("ad1", "ad2", None)]
    got = run(engine, jobs)
    for rid, _, lora in jobs:
        assert_matches(got[rid], ref[1][lora][int(rid[-1])], rid)


def test_the_c_kernels_run_gemma_adapters_in_the_layer_loop(ref):
    """No one-call C decode step for Gemma 3 (qk-norm, GeGLU, windows: said by why_not); its
    adapter rows take the C LoRA routine in the layer loop, the same output as the torch path."""
    eng = gemma_engine(ref[0], "native")
    model = eng.runner.model
    assert model.native_ops and model.native_decode is None and "qk-norm" in native_step.why_not(model)
    jobs = [("a", PROMPTS[1], "ad1"), ("b", PROMPTS[0], "ad2")]
    got = run(eng, jobs)
    assert_matches(got["a"], ref[1]["ad1"][1], "ad1")
    assert_matches(got["b"], ref[1]["ad2"][0], "ad2")


def test_batched_on_the_triton_backend_through_the_kernel(ref):
    pytest.importorskip("triton")
    eng = gemma_engine(ref[0], "triton")
    batches, real = [], eng.runner._lora_batch
    eng.runner._lora_batch = lambda ordered: batches.append(real(ordered)) or batches[-1]
    jobs = [(f"{lora}-{i}", PROMPTS[i], lora) for i in (0, 1) for lora in ("ad1", "ad2", None)]
    got = run(eng, jobs)
    del eng.runner._lora_batch
    for rid, _, lora in jobs:
        assert_matches(got[rid], ref[1][lora][int(rid[-1])], rid)
    ran = [b for b in batches if b is not None]
    assert ran and all(b._segments is not None for b in ran), "a step's LoRA update did not take the kernel"
