"""Conditional disaggregation: a decode worker whose own cache holds all of a prompt but a
short tail prefills that tail itself, skipping the prefill worker and the KV transfer; a
longer new part still goes through the prefill pool. The answers are the single engine's
either way, and every block comes back."""
import httpx
import pytest

from pdserve.deploy.local import LocalCluster
from pdserve.common.block_hash import hash_blocks
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from tests.helpers.clusters import local_config

pytestmark = pytest.mark.slow
MODEL = "smollm2"
SYSTEM = ("You are a meticulous assistant for a travel agency. Always answer in one short sentence, mention the "
          "city by name, and never invent prices. The agency serves Paris, Rome, Madrid, Lisbon and Vienna. "
          "Customers are often families with children, retired couples, or students travelling by train.")
LONG = "Before you answer, consider the season, the opening hours, the queues and the ticket offices. " * 6


@pytest.mark.parametrize("local_tokens", [64, 0])
def test_a_decode_worker_holding_the_prefix_prefills_a_short_tail_itself(smollm, local_tokens):
    loaded, tok = smollm
    questions = ["What is a good museum in Paris?", "Which museum in Rome would you recommend to a family with two young children?", LONG + "And in Madrid?"]
    cfg = local_config(32 << 20, router={"decode_local_prefill": local_tokens})
    c = LocalCluster(loaded, tok, cfg).start()
    try:
        answers = []
        for q in questions:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            r = httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": msgs})
            assert r.status_code == 200, r.text
            answers.append((msgs, r.json()["choices"][0]["message"]["content"]))
        decode = c.worker("decode-0").worker
        prefill = c.worker("prefill-0").worker
        counts = (decode.tail_prefills, decode.local_prefills, decode.remote_prefills, prefill.prefills)
        streams = dict(c.router.cluster.decode_streams)
        # the router counts the 2nd prompt as cached on the prefill worker only if it went there
        cc = c.router.cluster
        second = hash_blocks(tok.encode(tok.apply_chat_template(answers[1][0])), cc.block_size, cc.namespace)
        on_prefill = cc.index.match(second).get("prefill-0", 0)
    finally:
        c.stop()
    assert all(e.blocks.num_used_blocks == 0 for e in c.engines())
    # the 1st prompt is new (over 64 tokens); the 2nd differs from it only after the system
    # prompt: a short tail (22 tokens, one new full block); the 3rd adds over 64 new tokens
    assert counts == ((1, 1, 2, 2) if local_tokens else (0, 0, 3, 3)), counts
    assert streams == {}
    assert (on_prefill < len(second)) if local_tokens else (on_prefill == len(second)), (on_prefill, len(second))
    ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20)), tok)
    for msgs, text in answers:
        ids = ref.generate([tok.encode(tok.apply_chat_template(msgs))], SamplingParams(max_tokens=6, temperature=0))[0]
        assert text == tok.decode(ids, skip_special_tokens=True)
