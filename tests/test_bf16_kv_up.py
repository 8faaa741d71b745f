"""A bf16 KV cache through `pdserve up` under Ray, as a user starts it with no flags (the shared
cluster, tests/helpers/shared_up.py): bf16 is the default cache dtype on a CPU, so both workers
hold bf16 caches, and the default model at "auto" decodes over it in one C call a step
(engine/kernels/native/step.c, which stores the new K/V rounded to bf16 as torch does): the
greedy tokens are the single engine's with a bf16 cache (not the fp32 cache's, which differ
from the first decode step on for this prompt); every KV block is back in its pool after. And a
long prompt, whose rows past position 128 attend in bf16 where the CPU has AVX-512 BF16."""

import re

import httpx
import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from tests.helpers.procs import wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PROMPT = [{"role": "user", "content": "Write a short poem about the harbour at dawn."}]
N = 24


def test_up_decodes_over_a_bf16_cache_as_the_single_engine_does(default_up, smollm):
    loaded, tok = smollm
    ids = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    want = {kv: LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20, kv_cache_dtype=kv)),
                          tok).generate([ids], params)[0] for kv in ("fp32", "bf16")}
    assert want["bf16"][0] == want["fp32"][0] and want["bf16"] != want["fp32"]  # the cache's dtype shows
    url = default_up.url
    metrics = httpx.get(url + "/metrics", timeout=10).text
    dtypes = re.findall(r'^pdserve_kv_cache_info\{.*kv_cache_dtype="(\w+)".*\} 1\.0$', metrics, re.M)
    assert dtypes == ["bfloat16", "bfloat16"], metrics
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(want["bf16"], skip_special_tokens=True)
    wait_kv_back(url, 2)  # every KV block back in its pool, in both workers


def test_up_answers_a_long_prompt_as_the_single_engine_does(default_up, smollm):
    """A 600-token prompt: on a CPU with AVX-512 BF16 its rows past position 128 attend in bf16
    (engine/kernels/native/bf16_attention.c) in the prefill worker, and the decode worker goes on
    over that cache; elsewhere all in fp32. Either way the single engine's greedy tokens."""
    loaded, tok = smollm
    ids = torch.randint(200, 30000, (600,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    want = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20)), tok).generate([ids], params)[0]
    model = httpx.get(default_up.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(default_up.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    wait_kv_back(default_up.url, 2)
