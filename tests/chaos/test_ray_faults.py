"""Chaos on a real `pdserve up` cluster (Ray actors, embedded Redis, gRPC): worker and router
processes are SIGKILLed mid-request. The client's request survives (or, for the router it was
talking to, fails cleanly), the dead worker comes back through Ray's actor restart and
re-registers, and afterwards every KV block is back in every pool and no process is left.

Each test prints a row of the fault table in docs/reliability.md (run with -s to see them)."""
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.registry.embedded import free_port
from tests.helpers.procs import alive, descendants, registry_url, restart_redis
from tests.helpers.ray_procs import CHAOS_TOKEN, Proc, engine_stats, get_workers, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.chaos]
TOKEN = CHAOS_TOKEN
REDIS_PASSWORD = "chaos-redis-password"


def busy_worker(url: str, role: str, what: str, timeout: float) -> dict:
    """The `role` worker seen with a request in its engine (one that has two steps left is
    seen however fast the machine is)."""
    def busy():
        found = [w for w, s in engine_stats(url, role).values() if s.running]
        return found[0] if found else time.sleep(0.005)
    return wait_until(busy, timeout, what)


def clean(url: str) -> bool:
    """Every worker answers, holds no KV block and has no request."""
    ws = get_workers(url).values()
    return len(ws) == 4 and all(w["healthy"] and w["kv_usage"] == 0 and w["running"] == 0 and w["waiting"] == 0
                                for w in ws)


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    up = Proc("up", "--port", str(port), "--prefill", "2", "--decode", "2", "--kv-cache-memory", "64MiB",
              "--cluster-token", TOKEN, "--cluster-name", "chaos", "--redis-password", REDIS_PASSWORD,
              "--prefill-cpus", "0.5", "--decode-cpus", "0.5",
              "--threads", "1",
              "--no-idle-decode-prefill")  # a lone prompt still goes through the prefill pool, to kill it there
    procs: set[int] = set()
    try:
        up.wait_ready()
        up.url = f"http://127.0.0.1:{port}"
        up.redis_url = registry_url(up.text(), REDIS_PASSWORD)
        up.pids = {}
        for line in up.log:  # "[pdserve  9.1s] decode worker decode-0 (pid 123) on 127.0.0.1:4567"
            if " worker " in line and "(pid " in line:
                words = line.split()
                up.pids[words[words.index("worker") + 1]] = int(line.split("(pid ")[1].split(")")[0])
        assert len(up.pids) == 4, up.log
        procs = descendants(up.p.pid)
        yield up
    finally:
        procs |= descendants(up.p.pid)
        up.p.send_signal(signal.SIGINT)
        try:
            rc = up.p.wait(90)
        except subprocess.TimeoutExpired:
            up.p.kill()
            raise AssertionError("pdserve up did not stop within 90 s of SIGINT; its log ends:\n"
                                 + "".join(up.log[-30:])) from None
    if getattr(up, "redis", None) is not None:  # the Redis a test restarted in place of the embedded one
        up.redis.stop()
    assert rc == 0, "".join(up.log)
    assert "Traceback" not in "".join(up.log), "".join(up.log)
    wait_until(lambda: not [p for p in procs if alive(p)], 30, "every process of the cluster to exit")


@pytest.fixture(scope="module")
def reference(smollm):
    loaded, tok = smollm
    engine = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20)), tok)
    return lambda prompt, n: tok.decode(engine.generate([tok.encode(prompt)],
                                                        SamplingParams(max_tokens=n, temperature=0,
                                                                       ignore_eos=True))[0], skip_special_tokens=True)


def wait_restarted(cluster, worker_id: str, killed_at: float, old_address: str) -> float:
    """Seconds from the kill until the worker serves again under a new process and address."""
    def back():
        w = get_workers(cluster.url).get(worker_id)
        return w is not None and w["healthy"] and w["address"] != old_address
    wait_until(back, 120, f"{worker_id} to restart and re-register")
    recovery = time.monotonic() - killed_at
    line = wait_until(lambda: cluster.find(f"worker {worker_id} restarted"), 10, "the supervisor's log line")
    cluster.pids[worker_id] = int(line.split("-> ")[1].split(",")[0])
    return recovery


def report(fault: str, lost: int, leaked: int, recovery: float) -> None:
    print(f"\n| {fault} | {lost} | {leaked} | {recovery:.1f} s |")


def test_decode_worker_sigkill_mid_stream(cluster, reference):
    prompt = "The history of the printing press begins"
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 48, "ignore_eos": True,
            "temperature": 0, "stream": True}
    texts, finish, killed = [], None, None
    with httpx.Client(timeout=120) as http, http.stream("POST", cluster.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            texts.append(ev["choices"][0]["text"])
            finish = ev["choices"][0]["finish_reason"] or finish
            if len(texts) == 8:
                victim = busy_worker(cluster.url, "decode", "the serving worker", 5)
                os.kill(cluster.pids[victim["worker_id"]], signal.SIGKILL)
                killed = time.monotonic()
    assert "".join(texts) == reference(prompt, 48) and finish == "length"  # continued exactly, elsewhere
    recovery = wait_restarted(cluster, victim["worker_id"], killed, victim["address"])
    wait_until(lambda: clean(cluster.url), 10, "all KV blocks back, no request left")
    assert "pdserve_migrations_total 1.0" in httpx.get(cluster.url + "/metrics").text
    report("decode worker SIGKILL mid-stream (migrated)", 0, 0, recovery)


def test_prefill_worker_sigkill_mid_prefill(cluster, reference):
    # ~1150 tokens, three prefill steps (busy_worker sees it after the first), and the KV still
    # fits the 64 MiB caches
    prompt = "Tell me about the sea. " * 180
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)))
    t.start()
    victim = busy_worker(cluster.url, "prefill", "a prefill worker to start the prompt", 30)
    os.kill(cluster.pids[victim["worker_id"]], signal.SIGKILL)
    killed = time.monotonic()
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text  # recomputed on the decode worker: same answer, no error
    assert r.json()["choices"][0]["text"] == reference(prompt, 8)
    recovery = wait_restarted(cluster, victim["worker_id"], killed, victim["address"])
    wait_until(lambda: clean(cluster.url), 10, "all KV blocks back, no request left")
    report("prefill worker SIGKILL mid-prefill (recomputed)", 0, 0, recovery)


def test_router_sigkill_then_restart(cluster):
    """The router keeps no state: a killed router's streams end (the client sees the
    connection drop) and the workers abort them; a new router serves at once."""
    redis_url = cluster.redis_url
    port = free_port()
    args = ("router", "--port", str(port), "--redis-url", redis_url, "--cluster-name", "chaos",
            "--cluster-token", TOKEN)
    router = Proc(*args)
    url = f"http://127.0.0.1:{port}"
    try:
        router.wait_ready()
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with pytest.raises(httpx.TransportError):  # the stream breaks off: no fake success
            with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 10:
                        router.p.kill()  # SIGKILL
        killed = time.monotonic()
        router.p.wait(10)
        wait_until(lambda: clean(cluster.url), 5, "the workers to abort the dead router's request")
        aborted_in = time.monotonic() - killed
        router = Proc(*args)
        ready = router.wait_ready()
        r = httpx.post(url + "/v1/completions", json=body | {"stream": False, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        router.p.send_signal(signal.SIGINT)
        router.p.wait(30)
    wait_until(lambda: clean(cluster.url), 10, "all KV blocks back")
    print(f"\n(router: workers aborted the dead router's stream within {aborted_in:.2f} s)")
    report("router SIGKILL mid-stream, restarted", 0, 0, ready)


def test_redis_killed_then_restarted(cluster):
    """The registry dies: routing goes on from what the router last knew; when Redis is back
    (empty: no persistence), every worker registers again and the cluster serves as before."""
    import redis

    pid = int(cluster.find("embedded redis-server, pid").split("pid ")[1].split(")")[0])
    host, port = cluster.redis_url.split("@")[1].split("/")[0].split(":")
    os.kill(pid, signal.SIGKILL)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    time.sleep(2)  # heartbeats and event pushes fail meanwhile
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # served from the last known membership
    cluster.redis = restart_redis(host, int(port), password=REDIS_PASSWORD)  # the operator restarts it, empty
    restarted = time.monotonic()
    db = redis.Redis(host=host, port=int(port), password=REDIS_PASSWORD)
    wait_until(lambda: len(db.keys("pdserve:chaos:worker:*")) == 4, 30, "every worker to register again")
    recovery = time.monotonic() - restarted
    db.close()
    wait_until(lambda: clean(cluster.url), 10, "all workers healthy, no block held")
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    report("Redis SIGKILL, restarted empty (workers re-register)", 0, 0, recovery)
