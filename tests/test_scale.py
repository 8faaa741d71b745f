"""Scaling a pool of a running `pdserve up` (Ray actors) with `pdserve scale`: a new decode
worker registers and takes traffic; removing it drains it: it refuses new requests (they go
to the rest of the pool), its streams in flight finish untouched, then it stops. No request
is lost, every KV block comes back, no process is left."""
import json
import signal
import threading
import time

import httpx
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.registry.embedded import free_port
from tests.helpers.procs import alive, descendants, registry_url
from tests.helpers.ray_procs import Proc, engine_stats, get_workers, scale, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray]
MODEL = "SmolLM2-135M-Instruct"
TOKEN = "scale-token"


STREAM_TOKENS = 300  # both streams still run when the second starts and the scale-down begins, on a fast CPU too


def stream(url: str, prompt: str, out: dict, key: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    texts, events = [], []
    with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                texts += [c["text"] for c in events[-1].get("choices", [])]
    out[key] = ("".join(texts), events)


def test_scale_decode_up_then_drain_down(smollm):
    loaded, tok = smollm
    port = free_port()
    up = Proc("up", "--port", str(port), "--kv-cache-memory", "64MiB", "--cluster-name", "scale",
              "--cluster-token", TOKEN, "--prefill-cpus", "0.5", "--decode-cpus", "0.5", "--threads", "1")
    url = f"http://127.0.0.1:{port}"
    procs: set[int] = set()
    try:
        up.wait_ready()
        procs = descendants(up.p.pid)
        r = scale(url, decode=2)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {"prefill": 1, "decode": 2}
        wait_until(lambda: get_workers(url).get("decode-1", {}).get("healthy"), 15, "decode-1 to register")
        procs |= descendants(up.p.pid)
        # 0.5 CPU of the local Ray cluster is left: two more workers need 1.0, refused at once
        t0 = time.monotonic()
        full = scale(url, decode=4)
        assert full.returncode == 1 and "no room for 2 more decode worker(s)" in full.stderr, full.stderr
        assert "--ray-cpus" in full.stderr and time.monotonic() - t0 < 60  # not the 300 s start timeout

        # one stream on each decode worker (least-loaded routing), then shrink back to one
        results: dict = {}
        prompts = {"a": "The history of the printing press begins", "b": "A short story about a lighthouse keeper"}
        threads = {k: threading.Thread(target=stream, args=(url, p, results, k)) for k, p in prompts.items()}
        threads["a"].start()
        wait_until(lambda: sum(bool(s.running) for _, s in engine_stats(url, "decode", TOKEN).values()) == 1,
                   30, "the first stream to run")
        threads["b"].start()
        wait_until(lambda: all(s.running for _, s in engine_stats(url, "decode", TOKEN).values()),
                   30, "a stream on each decode worker")
        shrink: dict = {}
        scaler = threading.Thread(target=lambda: shrink.setdefault("r", scale(url, decode=1)))
        scaler.start()
        time.sleep(1.0)  # decode-1 is draining now: new requests go to decode-0
        during = httpx.post(url + "/v1/completions", timeout=120,
                            json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert during.status_code == 200, during.text
        for t in (*threads.values(), scaler):
            t.join(180)
        assert shrink["r"].returncode == 0 and json.loads(shrink["r"].stdout) == {"prefill": 1, "decode": 1}
        # both prompts' references in one batch (the engine is batch invariant, docs/models.md)
        ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20)), tok)
        wanted = ref.generate([tok.encode(p) for p in prompts.values()],
                              SamplingParams(max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True))
        for k, want in zip(prompts, wanted):  # both streams finished untouched, the drained one too
            text, events = results[k]
            assert not any("error" in e for e in events), events[-1]
            assert text == tok.decode(want, skip_special_tokens=True)
        assert "decode worker decode-1 removed after draining" in "".join(up.log)
        assert "pdserve_migrations_total 0.0" in httpx.get(url + "/metrics").text  # finished, not migrated
        wait_until(lambda: "decode-1" not in get_workers(url), 20, "the router to forget decode-1")
        wait_until(lambda: clean_two(url), 10, "all KV blocks back")
        bad = scale(url, decode=0)
        assert bad.returncode == 1 and "decode must be an integer in [1, 64]" in bad.stderr
        r = httpx.post(url + "/admin/scale", json={"embedding": 1}, timeout=10)
        assert r.status_code == 400 and "no 'embedding' pool" in r.json()["error"]["message"]
    finally:
        procs |= descendants(up.p.pid)
        up.p.send_signal(signal.SIGINT)
        rc = up.p.wait(90)
    assert rc == 0, "".join(up.log)
    wait_until(lambda: not [p for p in procs if alive(p)], 30, "every process to exit")


def clean_two(url: str) -> bool:
    ws = get_workers(url).values()
    return len(ws) == 2 and all(w["healthy"] and w["kv_usage"] == 0 and not w["running"] for w in ws)


def test_pools_only_head_and_a_separate_router():
    """The Kubernetes topology in miniature: `pdserve up --no-router` runs the pools (and their
    admin endpoints, behind an API key), `pdserve router` runs the OpenAI API elsewhere."""
    port, router_port = free_port(), free_port()
    up = Proc("up", "--no-router", "--port", str(port), "--kv-cache-memory", "64MiB", "--cluster-name", "topo",
              "--prefill-cpus", "0.5", "--decode-cpus", "0.5", "--threads", "1", "--api-key", "k-admin",
              "--cluster-token", "topo-token",  # the separate router is given the cluster's token
              "--redis-password", "topo-redis")  # and the registry's password
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k-admin"}
    procs: set[int] = set()
    router = None
    try:
        line = up.ready_line("pools ready: ")
        assert json.loads(line.removeprefix("pools ready: ")) == {"prefill": 1, "decode": 1}
        procs = descendants(up.p.pid)
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/admin/pools").status_code == 401  # the admin endpoints need the key
        assert httpx.get(url + "/admin/pools", headers=auth).json()["pools"] == {"prefill": 1, "decode": 1}
        assert httpx.post(url + "/v1/completions", json={}, headers=auth).status_code == 404  # no API here
        redis_url = registry_url(up.text(), "topo-redis")
        router = Proc("router", "--port", str(router_port), "--redis-url", redis_url, "--cluster-name", "topo",
                      "--cluster-token", "topo-token")
        router.wait_ready()
        r = httpx.post(f"http://127.0.0.1:{router_port}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        if router is not None:
            router.p.send_signal(signal.SIGINT)
            router.p.wait(30)
        procs |= descendants(up.p.pid)
        up.p.send_signal(signal.SIGINT)
        rc = up.p.wait(90)
    assert rc == 0, "".join(up.log)
    wait_until(lambda: not [p for p in procs if alive(p)], 30, "every process to exit")
