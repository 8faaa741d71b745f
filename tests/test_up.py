"""`pdserve up` as a user runs it (the one shared with tests/test_isolation_up.py,
tests/helpers/shared_up.py): embedded Redis, a local Ray cluster with a prefill and a decode
actor, the router; an OpenAI request; a Redis that refuses clients without its password; a
Responses API conversation stored in its Redis; Ctrl-C (the last test on it) leaves no
process behind."""
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.procs import alive
from tests.helpers.ray_procs import wait_until
from tests.helpers.shared_up import stops_it

pytestmark = [pytest.mark.slow, pytest.mark.ray]
LONG_TOKENS = 3000  # streams still running when the shutdown test's Ctrl-C comes


def test_up_serves(default_up, smollm):
    from openai import OpenAI

    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams

    url, log = default_up.url, default_up.text()
    assert len(default_up.track()) >= 4  # redis-server, Ray's own processes, two worker actors
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert httpx.get(f"{url}/health").status_code == 200
    registry_refuses_strangers(log)
    workers_run_at_our_priority(log)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    loaded, tok = smollm
    ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20)), tok).generate(
        [tok.encode(tok.apply_chat_template(msgs))], SamplingParams(max_tokens=24, temperature=0))[0]
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    isolation_under_ray(url, model)
    responses_under_ray(client, model)
    holding_under_ray(url, model)
    # the driver and its router run no model: torch (~2 s of each start) stays out of `pdserve up`'s process
    assert "libtorch" not in open(f"/proc/{default_up.up.p.pid}/maps").read()
    # the workers' loads keep the model's grid forms on disk (engine/model/packed_cache.py): one
    # file, written whole (no temporary file left by the two workers writing at once; another
    # pytest worker's engines may be writing theirs: a left one never goes, a written one does)
    forms = Path(os.environ["PDSERVE_CACHE_DIR"]) / "forms"
    assert list(forms.glob("SmolLM2-135M-Instruct-auto-*.forms.safetensors"))
    wait_until(lambda: not list(forms.glob("*.tmp*")), 60, "no temporary file in the forms cache")
    metrics = httpx.get(f"{url}/metrics").text
    assert 'role="prefill"' in metrics and 'role="decode"' in metrics
    # where each prompt was computed: at least one found the decode worker idle (no hand-off)
    placed = dict(re.findall(r'^pdserve_prompt_placements_total\{where="(\w+)"\} (\S+)$', metrics, re.M))
    assert set(placed) == {"prefill_pool", "decode_urgent", "decode_load", "decode"} and float(placed["decode_load"]) >= 1, placed
    for role in ("prefill", "decode"):  # each worker reports its preemptions by cause
        assert re.search(rf'^pdserve_preemptions_total{{cause="priority",role="{role}"', metrics, re.M), metrics
        # the host KV tier is on by default (sized from free memory) on every worker
        assert [line for line in metrics.splitlines() if line.startswith("pdserve_kv_tier_hits_tokens_total{")
                and f'role="{role}"' in line and 'tier="host"' in line], metrics
    deadline = time.time() + 5  # every KV block back in its pool, in both actor processes
    while time.time() < deadline:
        usage = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                 if line.startswith("pdserve_kv_usage_ratio{")]
        running = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                   if line.startswith("pdserve_running_requests{")]
        if len(usage) == 2 and all(line.endswith(" 0.0") for line in usage + running):
            break
        time.sleep(0.3)
    assert len(usage) == 2 and all(line.endswith(" 0.0") for line in usage + running), usage + running


@stops_it
def test_up_shuts_down_cleanly_with_work_in_flight(default_up):
    """Ctrl-C while three long streams run: bounded shutdown, exit code 0, no traceback (the
    streams still running when the grace ends are cancelled: each client is told the server is
    shutting down), nothing left behind (the last test of the shared cluster)."""
    proc, procs = default_up.up.p, default_up.track()
    got: list[list[str]] = [[] for _ in range(3)]
    try:
        streams = [threading.Thread(target=long_stream, args=(default_up.port, i, got[i]), daemon=True)
                   for i in range(3)]
        for t in streams:
            t.start()
        time.sleep(3)
    finally:
        default_up.stopped = True
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        err = default_up.text()
    # 3 s for the streams, 3 s for the workers, then Ray and Redis stop (not a timing
    # assertion: without the bound it waited for the streams, minutes here)
    assert time.monotonic() - t0 < 30, err
    assert rc == 0, err
    assert "Traceback" not in err, err
    for t in streams:
        t.join(10)
    assert all(len(lines) > 2 for lines in got), [len(lines) for lines in got]  # they were streaming
    cut = [lines[-2:] for lines in got if "[DONE]" in lines[-1]]
    assert all("shutting_down" in last[0] for last in cut), cut  # ended by the shutdown, and told so
    deadline = time.time() + 20
    while time.time() < deadline and any(alive(p) for p in procs):
        time.sleep(0.2)
    assert not [p for p in procs if alive(p)], "processes left behind"
    # Ray's private session directory goes too (113 of them had piled up in /tmp once)
    temp = err.split("session files in ")[1].split(")")[0]
    assert temp.startswith(tempfile.gettempdir()) and not os.path.exists(temp), temp


def workers_run_at_our_priority(log: str) -> None:
    """Ray starts workers at nice 15; beside any ordinary process they would then get a few
    percent of a core. Every thread of each worker runs at the priority `pdserve up` ran at."""
    pids = [int(p) for p in re.findall(r" worker \S+ \(pid (\d+)\)", log)]
    assert len(pids) == 2, log
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice
            assert nice <= ours, f"worker {pid} thread {tid} runs at nice {nice}"


def registry_refuses_strangers(log: str) -> None:
    """The embedded Redis has a password of its own (random: none was given), which the log
    never shows; a client without it is refused, while the workers (given it) registered."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    m = re.search(r"registry: redis://:\*\*\*@(127\.0\.0\.1):(\d+)/0 \(embedded redis-server", log)
    assert m, log
    once = Retry(NoBackoff(), 0)  # redis-py retries refused credentials for seconds by default
    for password in (None, "guess"):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=m.group(1), port=int(m.group(2)), password=password, retry=once).ping()


def isolation_under_ray(url: str, model: str) -> None:
    """Priorities, tenants, sessions and the grammar budget through `pdserve up`'s Ray pools."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body | {"priority": -2}, timeout=60,
                   headers={"x-pdserve-tenant": "team-a", "x-pdserve-session": "conv-1"})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", json=body, timeout=60, headers={"x-pdserve-priority": "3"})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", timeout=120, json=body | {
        "max_tokens": 300, "response_format": {"type": "grammar", "grammar": 'start: s\ns: s s | s s s | "a" | "b"\n'}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_budget_exceeded", r.text
    metrics = httpx.get(url + "/metrics").text
    assert 'pdserve_class_wait_seconds_count{priority="high",tenant="team-a"} 1.0' in metrics
    assert 'pdserve_class_wait_seconds_count{priority="low",tenant="default"} 1.0' in metrics
    # each went through the router's queue (its places were free: no wait), by priority band
    assert 'pdserve_router_queue_requests{priority="high"} 0.0' in metrics
    assert 'pdserve_router_queue_requests{priority="low"} 0.0' in metrics


def holding_under_ray(url: str, model: str) -> None:
    """A burst of 10 distinct ~600-token prompts at once: the router holds those no worker
    would start soon (router/holding.py) and routes each as a place opens; all are served."""
    import concurrent.futures

    def one(g: int) -> int:
        body = {"model": model, "prompt": [1000 + (g * 7919 + i * 31) % 40000 for i in range(600)], "max_tokens": 2}
        return httpx.post(url + "/v1/completions", json=body, timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        assert list(pool.map(one, range(10))) == [200] * 10
    metrics = httpx.get(url + "/metrics").text
    held = float(re.search(r"^pdserve_held_prompts_total (\S+)$", metrics, re.M).group(1))
    assert held >= 1 and re.search(r"^pdserve_held_prompts_now 0\.0$", metrics, re.M), metrics


def responses_under_ray(client, model: str) -> None:
    """A Responses API conversation through `pdserve up`: stored in its Redis, continued by id
    without resending it, its history from the cache."""
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=8, temperature=0)
    follow = client.responses.create(model=model, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=8, temperature=0)
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(follow.id).output_text == follow.output_text


def long_stream(port: int, i: int, lines: list[str]) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Tell story {i}", "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
    except httpx.HTTPError:
        pass  # cut off by the shutdown
