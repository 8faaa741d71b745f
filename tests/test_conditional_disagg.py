"""Conditional disaggregation: a decode worker whose cache already holds all of a prompt but
a short tail (per its KV events) prefills that tail itself, skipping the prefill worker and
the KV transfer; a longer new part still goes through the prefill pool. The answers are the
single engine's either way, and every block comes back."""
import time

import httpx
import pytest

from deploy.local import LocalCluster, LocalClusterConfig
from deploy.redis_server import EmbeddedRedis
from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.redis]
MODEL = "smollm2"
SYSTEM = ("You are a meticulous assistant for a travel agency. Always answer in one short sentence, mention the "
          "city by name, and never invent prices. The agency serves Paris, Rome, Madrid, Lisbon and Vienna.")
LONG = "Before you answer, consider the season, the opening hours, the queues and the ticket offices. " * 3


@pytest.mark.parametrize("local_tokens", [64, 0])
def test_a_decode_worker_holding_the_prefix_prefills_a_short_tail_itself(smollm, local_tokens):
    loaded, tok = smollm
    questions = ["What is a good museum in Paris?", "What is a good museum in Rome?", LONG + "And in Madrid?"]
    with EmbeddedRedis() as redis:
        cfg = LocalClusterConfig(redis_url=redis.url, cluster=f"cond-{local_tokens}", model_name=MODEL,
                                 decode_local_prefill=local_tokens,
                                 engine=EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20)))
        c = LocalCluster(loaded, tok, cfg).start()
        try:
            answers = []
            for q in questions:
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                r = httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": msgs})
                assert r.status_code == 200, r.text
                answers.append((msgs, r.json()["choices"][0]["message"]["content"]))
                time.sleep(0.3)  # the decode worker's KV events reach the router's index
            decode = c.worker("decode-0").worker
            prefill = c.worker("prefill-0").worker
            counts = (decode.local_prefills, decode.remote_prefills, prefill.prefills)
            streams = dict(c.router.cluster.decode_streams)
        finally:
            c.stop()
        assert all(e.blocks.num_used_blocks == 0 for e in c.engines())
    # the 2nd prompt differs from the 1st only after the system prompt: a short tail
    assert counts == ((1, 2, 2) if local_tokens else (0, 3, 3)), counts
    assert streams == {}
    ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20)), tok)
    for msgs, text in answers:
        ids = ref.generate([tok.encode(tok.apply_chat_template(msgs))], SamplingParams(max_tokens=6, temperature=0))[0]
        assert text == tok.decode(ids, skip_special_tokens=True)
