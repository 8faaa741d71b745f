"""A bf16 KV cache through `pdserve up` under Ray (one prefill and one decode worker, the
default model at "auto": its decode-only steps run as one C call, engine/kernels/native/step.c,
which stores the new K/V rounded to bf16 as torch does): the greedy tokens are the single
engine's with a bf16 cache (not the fp32 cache's, which differ from the first decode step on
for this prompt), prefilled remotely; every KV block is back in its pool after."""

import httpx
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.registry.embedded import free_port
from tests.helpers.procs import Proc, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PROMPT = [{"role": "user", "content": "Write a short poem about the harbour at dawn."}]
N = 24


def test_up_decodes_over_a_bf16_cache_as_the_single_engine_does(smollm):
    loaded, tok = smollm
    ids = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    want = {kv: LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20, kv_cache_dtype=kv)),
                          tok).generate([ids], params)[0] for kv in ("fp32", "bf16")}
    assert want["bf16"][0] == want["fp32"][0] and want["bf16"] != want["fp32"]  # the cache's dtype shows
    port = free_port()
    up = Proc("up", "--port", str(port), "--prefill", "1", "--decode", "1", "--kv-cache-memory", "64MiB",
              "--kv-cache-dtype", "bf16", "--cluster-token", "test-token", "--shutdown-grace", "3")
    url = f"http://127.0.0.1:{port}"
    try:
        line = up.p.stdout.readline()
        assert line.startswith("curl "), up.text() if up.p.poll() is not None else line
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(want["bf16"], skip_special_tokens=True)
        wait_kv_back(url, 2)  # every KV block back in its pool, in both workers
    finally:
        rc = stop(up)
    assert rc == 0, up.text()
