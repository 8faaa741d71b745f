"""Router protections: API keys, bounded admission (429 + Retry-After), request timeout (504),
and `pdserve up` refusing to expose an unauthenticated API."""
import os
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.config import SecurityConfig
from pdserve.deploy.local import LocalCluster
from tests.helpers.clusters import local_config

pytestmark = pytest.mark.slow
MODEL = "smollm2"
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def cluster(smollm):
    loaded, tok = smollm
    cfg = local_config(64 << 20, router={"max_inflight": 2}, security=SecurityConfig(api_keys=(KEY,)))
    c = LocalCluster(loaded, tok, cfg).start()
    yield c
    c.stop()
    for eng in c.engines():
        assert eng.blocks.num_used_blocks == 0 and not eng.has_unfinished_requests()


def post(c, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(c.url + "/v1/completions", json=body, headers=headers, **({"timeout": 30} | kw))


BODY = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "temperature": 0}


def test_api_key_required_on_v1_only(cluster):
    from openai import AuthenticationError, OpenAI

    for key in (None, "wrong", KEY + "x", KEY[:-1]):
        r = post(cluster, BODY, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(cluster.url + "/v1/completions", json=BODY, headers={"Authorization": KEY})  # no scheme
    assert r.status_code == 401
    assert post(cluster, BODY).status_code == 200
    assert httpx.get(cluster.url + "/health").status_code == 200  # probes need no key
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=cluster.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0).models.list().data[0].id == MODEL
    for path, body in (("/tokenize", {"model": MODEL, "prompt": "hi"}), ("/detokenize", {"model": MODEL, "tokens": [1]})):
        assert httpx.post(cluster.url + path, json=body).status_code == 401  # the tokenizer is behind the key too
        assert httpx.post(cluster.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(cluster.url + f"/v1/models/{MODEL}").status_code == 401


def test_past_the_limit_requests_wait_most_urgent_first_and_a_full_queue_gives_429(cluster):
    """Both places taken (--max-inflight 2): a low-priority request, then an urgent one, wait
    in the router's queue; when a place frees the urgent one goes first. A full queue refuses
    a request no more urgent than those waiting with 429 and Retry-After."""
    import threading

    long = BODY | {"max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    queue, done = cluster.router.admission, []

    def waiter(name: str, priority: int) -> None:
        done.append((name, post(cluster, BODY | {"priority": priority}, timeout=120).status_code))
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", cluster.url + "/v1/completions", json=long, headers=headers) as a, \
                http.stream("POST", cluster.url + "/v1/completions", json=long, headers=headers) as b:
            lines_a, lines_b = a.iter_lines(), b.iter_lines()  # kept: dropping one closes its stream
            next(lines_a), next(lines_b)  # both admitted and streaming
            threads = []
            for name, priority in (("low", 5), ("urgent", -1)):
                threads.append(threading.Thread(target=waiter, args=(name, priority)))
                threads[-1].start()
                _wait_for(lambda: len(queue.waiting) == len(threads))
            assert 'pdserve_router_queue_requests{priority="high"} 1.0' in httpx.get(cluster.url + "/metrics").text
            queue.max_waiting = 2
            r = post(cluster, BODY | {"priority": 7})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            queue.max_waiting = cluster.router.config.queue_size
            a.close()  # its place goes to the urgent one; the low one waits for the next
            _wait_for(lambda: done)
            # b would stream its 1,000 tokens with the low one's decodes standing aside for it
            # (priority 0 before 5): 10 s of the suite; closed, the low one runs alone
            b.close()
            for t in threads:
                t.join(120)
            assert done == [("urgent", 200), ("low", 200)]
    _wait_for(lambda: queue.inflight == 0, 5)
    assert queue.waiting == [] and queue.by_tenant == {}
    assert post(cluster, BODY).status_code == 200
    assert 'pdserve_requests_total{status="rejected"}' in httpx.get(cluster.url + "/metrics").text
    # more generations than are ever admitted at once (limit 2): refused for good, not "retry"
    for body, param in ((BODY | {"n": 3}, "n"), (BODY | {"prompt": ["a", "b", "c"]}, "prompt")):
        r = post(cluster, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert len(post(cluster, BODY | {"prompt": ["a", "b"]}).json()["choices"]) == 2
    assert queue.inflight == 0


def test_request_timeout_gives_504_and_aborts(cluster):
    from dataclasses import replace

    cluster.router.config = replace(cluster.router.config, request_timeout_s=2.0)
    t = time.time()
    r = post(cluster, BODY | {"max_tokens": 1000, "ignore_eos": True})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.time() - t < 10
    deadline = time.time() + 2
    while time.time() < deadline and any(e.blocks.num_used_blocks for e in cluster.engines()):
        time.sleep(0.05)
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in cluster.engines())


def test_up_refuses_public_host_without_key():
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "pdserve", "up", "--host", "0.0.0.0"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2 and "--api-key" in r.stderr


def _wait_for(cond, timeout=30.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.01)


def test_pool_queue_limits_give_429_once_every_worker_of_the_pool_is_full(smollm):
    """Per-pool bounded admission: a full worker refuses (RESOURCE_EXHAUSTED naming itself),
    the router tries the others of its pool and answers 429 only when all are full."""
    from concurrent.futures import ThreadPoolExecutor

    loaded, tok = smollm
    # KV room for all of them on the decode worker (short of blocks, a request waits there for them)
    cfg = local_config(256 << 20, prefill=2, prefill_max_queue=1)
    c = LocalCluster(loaded, tok, cfg).start()
    prefill = [c.worker(f"prefill-{i}").worker for i in range(2)]
    decode = c.worker("decode-0").worker

    def long_body(i):  # distinct prompts: no prefix hits, each prefill takes a while
        return {"model": MODEL, "prompt": f"{i} " + "the quick brown fox jumps over the lazy dog " * 60,
                "max_tokens": 2, "temperature": 0}
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, c, long_body(i)) for i in range(2)]
            _wait_for(lambda: all(p.inflight == 1 for p in prefill))  # one prompt on each prefill worker
            r = post(c, long_body(2))
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "prefill-" in r.json()["error"]["message"]
            assert [f.result().status_code for f in held] == [200, 200]  # the admitted ones are unaffected

            decode.max_queue = 1
            held = pool.submit(post, c, long_body(3))
            _wait_for(lambda: decode.queued == 1)
            r = post(c, long_body(4))
            assert r.status_code == 429 and "decode-0" in r.json()["error"]["message"]
            assert held.result().status_code == 200
        assert post(c, BODY, key=None).status_code == 200  # capacity back: admitted at once
        metrics = httpx.get(c.url + "/metrics").text
        assert 'pdserve_rejected_requests_total{reason="pool_full"} 2.0' in metrics
        assert sum(p.refused for p in prefill) >= 2 and decode.refused == 1
        assert all(p.inflight == 0 for p in prefill) and decode.queued == 0
    finally:
        c.stop()
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in c.engines())


def test_more_streams_than_the_batch_holds_queue_and_are_all_served(smollm):
    """With the default per-worker queues, 80 concurrent streams against one decode worker
    whose batch holds 8 are all served in turn: the rest wait in its queue, none gets 429,
    and the batch never grows past its limit (requests prefilled remotely included)."""
    import asyncio

    from pdserve.config import PoolConfig
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    loaded, tok = smollm
    engine = EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20), scheduler=SchedulerConfig(max_num_seqs=8))
    cfg = local_config(engine=engine, prefill_max_queue=PoolConfig().max_queue, decode_max_queue=PoolConfig().max_queue)
    c = LocalCluster(loaded, tok, cfg).start()
    decode = c.worker("decode-0").engine
    most = []

    async def one(client, i):
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 4, "stream": True,
                "temperature": 0}
        async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
            most.append(len(decode.scheduler.running))
            return r.status_code, [line async for line in r.aiter_lines() if line][-2:]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(80)))
    try:
        results = asyncio.run(all_at_once())
    finally:
        c.stop()
    assert [s for s, _ in results] == [200] * 80
    assert all(lines[-1] == "data: [DONE]" for _, lines in results)
    assert max(most) <= 8
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in c.engines())
