"""Two hosts on one machine: the prefill worker in one network namespace, the decode worker,
router and Redis in another, joined by a veth pair. The KV cache really crosses a network
link (the veth's byte counters show it), the answer is the single engine's, and every
process stops cleanly. Skipped where network namespaces cannot be created (no root)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.registry.embedded import redis_server_binary

pytestmark = pytest.mark.slow
TAG = str(os.getpid() % 100000)
NS_P, NS_D = f"pdp{TAG}", f"pdd{TAG}"
VETH_P, VETH_D = f"pvp{TAG}", f"pvd{TAG}"
IP_P, IP_D = "10.231.0.1", "10.231.0.2"
PASSWORD = "netns-test"
REDIS_URL = f"redis://:{PASSWORD}@{IP_D}:6391/0"


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command")
    if ip("netns", "add", NS_P).returncode != 0:
        pytest.skip("network namespaces are not permitted here")
    try:
        steps = [("netns", "add", NS_D), ("link", "add", VETH_P, "type", "veth", "peer", "name", VETH_D),
                 ("link", "set", VETH_P, "netns", NS_P), ("link", "set", VETH_D, "netns", NS_D),
                 ("-n", NS_P, "addr", "add", f"{IP_P}/24", "dev", VETH_P),
                 ("-n", NS_D, "addr", "add", f"{IP_D}/24", "dev", VETH_D)]
        steps += [("-n", ns, "link", "set", dev, "up") for ns, dev in
                  ((NS_P, VETH_P), (NS_D, VETH_D), (NS_P, "lo"), (NS_D, "lo"))]
        for step in steps:
            r = ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr}"
        yield
    finally:
        ip("netns", "del", NS_P)  # deleting a namespace removes its end of the veth, and the pair
        ip("netns", "del", NS_D)


def in_ns(logs: Path, ns: str, *argv: str) -> subprocess.Popen:
    # `ip netns exec` execs the command: the PID we hold is the program's own. Its stderr goes
    # to a file: a pipe nobody reads would block the process once it filled.
    err = open(logs / f"{len(list(logs.iterdir()))}-{Path(argv[0]).name}-{argv[-1]}.log", "w+")
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, stderr=err,
                            text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def pdserve(logs: Path, ns: str, *args: str) -> subprocess.Popen:
    return in_ns(logs, ns, sys.executable, "-m", "pdserve", *args)


def stderr_of(p: subprocess.Popen) -> str:
    p.stderr.seek(0)
    return p.stderr.read()[-4000:]


def stop_all(procs: list[subprocess.Popen], timeout_s: float = 90.0) -> list[int]:
    """Ctrl-C to all, newest first; each gets `timeout_s` to exit (the workers' own shutdown
    watchdog fires before). One that does not is asked for its stacks, killed, and its log shown."""
    for p in reversed(procs):
        p.send_signal(signal.SIGINT)
    codes, stuck = [], []
    for p in reversed(procs):
        try:
            codes.append(p.wait(timeout_s))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)
            time.sleep(2)
            p.kill()
            codes.append(p.wait())
            stuck.append(f"{p.args[3:]} did not stop within {timeout_s:g}s:\n{stderr_of(p)}")
    assert not stuck, "\n".join(stuck)
    return codes


def rx_bytes(ns: str, dev: str) -> int:
    with_stats = ip("-n", ns, "-s", "-j", "link", "show", dev)
    return json.loads(with_stats.stdout)[0]["stats64"]["rx"]["bytes"]


def test_kv_crosses_a_network_link(namespaces, smollm, tmp_path):
    loaded, tok = smollm
    common = ("--redis-url", REDIS_URL, "--cluster-name", "netns", "--kv-cache-memory", "64MiB", "--threads", "1",
              "--cluster-token", "netns-token")  # workers on a network address need one
    procs = [in_ns(tmp_path, NS_D, redis_server_binary(), "--bind", IP_D, "--port", "6391", "--requirepass", PASSWORD,
                   "--save", "", "--appendonly", "no")]
    try:
        procs.append(pdserve(tmp_path, NS_P, "worker", "--role", "prefill", "--worker-id", "prefill-p", "--host", IP_P, *common))
        procs.append(pdserve(tmp_path, NS_D, "worker", "--role", "decode", "--worker-id", "decode-d", "--host", IP_D, *common))
        for p in procs[1:]:
            line = p.stdout.readline()
            assert line.startswith("ready "), stderr_of(p) if p.poll() is not None else line
        procs.append(pdserve(tmp_path, NS_D, "router", "--port", "8391", "--redis-url", REDIS_URL, "--cluster-name", "netns",
                             "--cluster-token", "netns-token",
                             "--no-idle-decode-prefill"))  # the lone prompt's KV must cross the link
        assert procs[-1].stdout.readline().startswith("curl "), stderr_of(procs[-1])

        prompt = "Tell me about the history of lighthouses on the coast of Portugal. " * 12
        before = rx_bytes(NS_D, VETH_D)
        client = ("import httpx, json; r = httpx.post('http://127.0.0.1:8391/v1/completions', timeout=120, json="
                  f"{{'model': 'SmolLM2-135M-Instruct', 'prompt': {prompt!r}, 'max_tokens': 12, 'temperature': 0}}); "
                  "w = httpx.get('http://127.0.0.1:8391/admin/workers').json(); print(json.dumps([r.json(), w]))")
        out = subprocess.run(["ip", "netns", "exec", NS_D, sys.executable, "-c", client], capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        answer, workers = json.loads(out.stdout)
        received = rx_bytes(NS_D, VETH_D) - before
    finally:
        codes = stop_all(procs)
    ids = tok.encode(prompt)
    ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20)), tok).generate(
        [ids], SamplingParams(max_tokens=12, temperature=0))[0]
    assert answer["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    assert {w["worker_id"]: w["address"].split(":")[0] for w in workers["workers"]} == {"prefill-p": IP_P,
                                                                                      "decode-d": IP_D}
    c = loaded.config  # the prompt's KV, fp32: layers x (K, V) x KV heads x head dim x tokens
    kv_bytes = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4 * len(ids)
    print(f"\n{received} bytes crossed the link; the prompt's KV is {kv_bytes}")
    assert received >= kv_bytes, f"only {received} bytes crossed the link, the KV alone is {kv_bytes}"
    # router, decode, prefill exit cleanly (redis-server: by signal)
    assert codes[:-1] == [0, 0, 0], [(c, stderr_of(p)) for c, p in zip(codes, reversed(procs)) if c != 0]
