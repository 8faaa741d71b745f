"""Two hosts on one machine: the prefill worker in one network namespace, the decode worker,
router and Redis in another, each on its veth link to a bridge (tests/helpers/netns.py). The KV
cache really crosses a network link (the decode host's veth counters show it), the answer is
the single engine's, and every process stops cleanly. Skipped where network namespaces cannot be created (no root)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.kv.cache import engine_kv_format
from pdserve.common.sampling_params import SamplingParams
from pdserve.registry.embedded import redis_server_binary
from tests.helpers.netns import Hosts, stderr_of, stop_all

pytestmark = pytest.mark.slow
HOSTS = Hosts(["prefill", "decode"], "10.231.0", str(os.getpid() % 100000))
IP_P, IP_D = HOSTS.address["prefill"], HOSTS.address["decode"]
PASSWORD = "netns-test"
REDIS_URL = f"redis://:{PASSWORD}@{IP_D}:6391/0"


@pytest.fixture(scope="module")
def namespaces():
    try:
        HOSTS.create()
        yield
    finally:
        HOSTS.delete()


def pdserve(logs: Path, host: str, *args: str) -> subprocess.Popen:
    return HOSTS.run(logs, host, sys.executable, "-m", "pdserve", *args)


def test_kv_crosses_a_network_link(namespaces, smollm, tmp_path):
    loaded, tok = smollm
    common = ("--redis-url", REDIS_URL, "--cluster-name", "netns", "--kv-cache-memory", "64MiB", "--threads", "1",
              "--cluster-token", "netns-token")  # workers on a network address need one
    procs = [HOSTS.run(tmp_path, "decode", redis_server_binary(), "--bind", IP_D, "--port", "6391", "--requirepass", PASSWORD,
                   "--save", "", "--appendonly", "no")]
    try:
        procs.append(pdserve(tmp_path, "prefill", "worker", "--role", "prefill", "--worker-id", "prefill-p", "--host", IP_P, *common))
        procs.append(pdserve(tmp_path, "decode", "worker", "--role", "decode", "--worker-id", "decode-d", "--host", IP_D, *common))
        for p in procs[1:]:
            line = p.stdout.readline()
            assert line.startswith("ready "), stderr_of(p) if p.poll() is not None else line
        procs.append(pdserve(tmp_path, "decode", "router", "--port", "8391", "--redis-url", REDIS_URL, "--cluster-name", "netns",
                             "--cluster-token", "netns-token",
                             "--no-idle-decode-prefill"))  # the lone prompt's KV must cross the link
        assert procs[-1].stdout.readline().startswith("curl "), stderr_of(procs[-1])

        prompt = "Tell me about the history of lighthouses on the coast of Portugal. " * 12
        before = HOSTS.rx_bytes("decode")
        client = ("import httpx, json; r = httpx.post('http://127.0.0.1:8391/v1/completions', timeout=120, json="
                  f"{{'model': 'SmolLM2-135M-Instruct', 'prompt': {prompt!r}, 'max_tokens': 12, 'temperature': 0}}); "
                  "w = httpx.get('http://127.0.0.1:8391/admin/workers').json(); print(json.dumps([r.json(), w]))")
        out = subprocess.run(["ip", "netns", "exec", HOSTS.ns["decode"], sys.executable, "-c", client], capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        answer, workers = json.loads(out.stdout)
        received = HOSTS.rx_bytes("decode") - before
    finally:
        codes = stop_all(procs)
    ids = tok.encode(prompt)
    ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20)), tok).generate(
        [ids], SamplingParams(max_tokens=12, temperature=0))[0]
    assert answer["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    assert {w["worker_id"]: w["address"].split(":")[0] for w in workers["workers"]} == {"prefill-p": IP_P,
                                                                                      "decode-d": IP_D}
    c, fmt = loaded.config, engine_kv_format(EngineConfig(), loaded.model)  # the prompt's KV as the pools keep it
    kv_bytes = c.num_hidden_layers * 2 * c.num_key_value_heads * fmt.bytes_per_row(c.head_dim) * len(ids)
    print(f"\n{received} bytes crossed the link; the prompt's KV is {kv_bytes}")
    assert received >= kv_bytes, f"only {received} bytes crossed the link, the KV alone is {kv_bytes}"
    # router, decode, prefill exit cleanly (redis-server: by signal)
    assert codes[:-1] == [0, 0, 0], [(c, stderr_of(p)) for c, p in zip(codes, reversed(procs)) if c != 0]
