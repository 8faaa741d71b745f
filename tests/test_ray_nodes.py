"""The cluster spread over Ray nodes the way a KubeRay deployment spreads it: a head node
(`ray start --head`) and a worker node (`ray start --address`) on hosts of their own (network
namespaces on a bridge, tests/helpers/netns.py), each advertising a custom resource as KubeRay worker
groups do. `pdserve up --ray-address` on the head places the prefill pool on the head and the
decode pool on the worker node: the answers are the single engine's, the KV crosses the
worker node's link, and the internal services ask for mutual TLS and the cluster token. A
third node joins with room for a decode worker and `pdserve scale` puts one there. The
worker node's raylet is killed mid-stream: its streams move to the other decode worker (or
end with an error event), every block on the nodes left comes back, the router keeps
serving, and when the node comes back its worker re-registers. Every process is stopped by
its PID (no `ray stop`)."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.security import proves, stats_request
from tests.helpers.clusters import write_identity
from tests.helpers.netns import Hosts, stderr_of, stop_all
from tests.helpers.procs import ENV, alive, descendants

trustme = pytest.importorskip("trustme")
pytestmark = [pytest.mark.slow, pytest.mark.ray]
HOSTS = Hosts(["head", "worker", "spare"], "10.232.0", str(os.getpid() % 100000))
IP = HOSTS.address
MODEL, TOKEN, API_KEY = "SmolLM2-135M-Instruct", "nodes-token", "nodes-key"
RAY = str(Path(sys.executable).with_name("ray"))
RAY_PORT, ROUTER_PORT = 6379, 8393  # each host has its own ports: nothing else listens there
# Ray notices a lost node after ~2 s instead of ~30, and a worker process its raylet's death
# after 0.2 s: the test's waits stay short
RAY_ENV = ENV | {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                 "RAY_health_check_failure_threshold": "4", "RAY_health_check_initial_delay_ms": "1000",
                 "RAY_raylet_death_check_interval_milliseconds": "200"}


class Cluster:
    """The processes of the test: Ray nodes by host, and `pdserve up` on the head."""

    def __init__(self, logs: Path, tls):
        self.logs, self.tls = logs, tls
        self.ray_dir = tempfile.mkdtemp(prefix="pdr-")  # short: Ray's socket paths have a length limit
        self.nodes: dict[str, subprocess.Popen] = {}
        self.stopped: list[subprocess.Popen] = []  # nodes lost and replaced
        self.up: subprocess.Popen | None = None
        self.pids: set[int] = set()
        self.url = f"http://{IP['head']}:{ROUTER_PORT}"
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def start_node(self, host: str, resource: str) -> None:
        """A Ray node on `host` with 1 CPU and 1 of `resource`; returns once it has joined."""
        role = ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"] if host == "head" else [
            "--address", f"{IP['head']}:{RAY_PORT}"]
        p = HOSTS.run(self.logs, host, RAY, "start", "--block", "--disable-usage-stats", *role,
                      "--node-ip-address", IP[host], "--num-cpus", "1", "--resources", json.dumps({resource: 1}),
                      "--object-store-memory", str(80 << 20), "--temp-dir", os.path.join(self.ray_dir, host),
                      env=RAY_ENV, stdout_pipe=False)
        if host in self.nodes:
            self.stopped.append(self.nodes[host])
        self.nodes[host] = p
        wait_until(lambda: "Ray runtime started" in stderr_of(p) or p.poll() is not None, 120, f"{host} node")
        assert p.poll() is None, stderr_of(p)

    def start_up(self) -> None:
        tls = self.tls
        self.up = HOSTS.run(
            self.logs, "head", sys.executable, "-m", "pdserve", "up", "--ray-address", f"{IP['head']}:{RAY_PORT}",
            "--host", IP["head"], "--port", str(ROUTER_PORT), "--api-key", API_KEY, "--cluster-token", TOKEN,
            "--cluster-name", "nodes", "--prefill-resource", "pdtest_prefill", "--decode-resource", "pdtest_decode",
            "--tls-cert", tls.cert_file, "--tls-key", tls.key_file, "--tls-ca", tls.ca_file,
            "--tls-server-name", tls.server_name, "--kv-cache-memory", "128MiB", "--threads", "1",
            "--no-idle-decode-prefill", env=RAY_ENV)  # a lone prompt still crosses to the decode node
        line = self.up.stdout.readline()
        assert line.startswith("curl "), stderr_of(self.up)

    def track(self) -> None:
        """Remember every process below ours (they must all be gone at the end)."""
        for p in [*self.nodes.values(), *([self.up] if self.up else [])]:
            self.pids |= descendants(p.pid)

    def log(self) -> str:
        return stderr_of(self.up, last=1 << 24)

    def workers(self) -> dict[str, dict]:
        r = httpx.get(self.url + "/admin/workers", headers=self.headers, timeout=10)
        return {w["worker_id"]: w for w in r.json()["workers"]}

    def stats(self, worker_id: str, token: str = TOKEN, tls=True):
        """The worker's own Stats over its gRPC service (mutual TLS unless `tls` is False)."""
        w = self.workers()[worker_id]
        stub = pb_grpc.PrefillServiceStub if w["role"] == "prefill" else pb_grpc.DecodeServiceStub
        if tls:
            creds = self.tls.channel_credentials()
            ch = grpc.secure_channel(w["address"], creds, [("grpc.ssl_target_name_override", self.tls.server_name)])
        else:
            ch = grpc.insecure_channel(w["address"])
        with ch:
            req = stats_request(token)
            reply = stub(ch).Stats(req, timeout=10)
            assert proves(token, req, reply)
            return reply

    def complete(self, prompt: str, n: int) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = httpx.post(self.url + "/v1/completions", json=body, headers=self.headers, timeout=180)
        assert r.status_code == 200, r.text
        return r.json()


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray-nodes")
    tls = write_identity(trustme.CA(), logs, "cluster")
    c = Cluster(logs, tls)
    try:
        HOSTS.create()
        c.start_node("head", "pdtest_prefill")
        c.start_node("worker", "pdtest_decode")
        c.start_up()
        c.track()
        yield c
    finally:
        c.track()
        codes = stop_all([c.up] if c.up else [], timeout_s=90)
        stop_all([*c.stopped, *c.nodes.values()], timeout_s=60, sig=signal.SIGTERM)
        HOSTS.delete()
    assert codes == [0], c.log()
    assert "Traceback" not in c.log(), c.log()
    wait_until(lambda: not [p for p in c.pids if alive(p)], 30, "every process of the cluster to exit")


@pytest.fixture(scope="module")
def reference(smollm):
    """reference(prompt, n): the single engine's greedy n tokens, as text; given a list of
    prompts, each one's, run in one batch (the engine is batch invariant, docs/models.md: the
    same tokens as one at a time, in a fraction of the steps)."""
    loaded, tok = smollm
    engine = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20)), tok)

    def texts(prompt: str | list[str], n: int) -> str | list[str]:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        out = engine.generate([tok.encode(p) for p in prompts], SamplingParams(max_tokens=n, temperature=0,
                                                                              ignore_eos=True))
        got = [tok.decode(ids, skip_special_tokens=True) for ids in out]
        return got[0] if isinstance(prompt, str) else got
    return texts


def test_pools_on_their_nodes_and_the_kv_crosses_the_link(cluster, reference):
    # no --redis-url: the Redis `pdserve up` embeds listens on the head's address, with a password
    assert f"registry: redis://:***@{IP['head']}:" in cluster.log()
    workers = cluster.workers()
    assert {k: w["address"].split(":")[0] for k, w in workers.items()} == {"prefill-0": IP["head"],
                                                                          "decode-0": IP["worker"]}
    prompt = "Tell me about the history of lighthouses on the coast of Portugal. " * 12
    before, kv_before = HOSTS.rx_bytes("worker"), cluster.stats("decode-0").kv_bytes
    answer = cluster.complete(prompt, 12)
    received, kv = HOSTS.rx_bytes("worker") - before, cluster.stats("decode-0").kv_bytes - kv_before
    assert answer["choices"][0]["text"] == reference(prompt, 12)
    assert cluster.stats("decode-0").remote_prefills == 1
    print(f"\n{received} bytes reached the worker node; the KV pushed to it was {kv}")
    assert kv > 100_000 and received >= kv  # ~170 tokens of KV, whatever its dtype


def test_internal_services_need_mutual_tls_and_the_cluster_token(cluster):
    assert cluster.stats("decode-0").worker_id == "decode-0"
    with pytest.raises(grpc.RpcError) as e:
        cluster.stats("decode-0", tls=False)  # plaintext: refused at the handshake
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as e:
        cluster.stats("decode-0", token="not-the-token")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_scale_puts_the_new_decode_worker_on_the_node_with_room(cluster):
    cluster.start_node("spare", "pdtest_decode")  # the worker node is full: a new node joins, as an autoscaler adds one
    r = subprocess.run([sys.executable, "-m", "pdserve", "scale", "--url", cluster.url, "--api-key", API_KEY,
                        "--decode", "2"], capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr + cluster.log()
    assert json.loads(r.stdout) == {"prefill": 1, "decode": 2}
    # registered first, healthy at the router's next poll of its stats
    w = wait_until(lambda: (w := cluster.workers().get("decode-1")) and w["healthy"] and w, 30,
                   "decode-1 to register and answer the router's health poll")
    assert w["address"].split(":")[0] == IP["spare"]
    cluster.track()


# the streams outlive the node's loss on a fast CPU too (128 tokens ended first on a 2-core Zen 4)
STREAM_TOKENS = 512


def stream(cluster: Cluster, prompt: str, out: dict) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    out["texts"], out["events"] = [], []
    with httpx.Client(timeout=180) as http, http.stream("POST", cluster.url + "/v1/completions", json=body,
                                                        headers=cluster.headers) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                out["events"].append(ev)
                out["texts"] += [c["text"] for c in ev.get("choices", [])]


def test_worker_node_lost_mid_stream_then_back(cluster, reference):
    prompts = [f"A short story about {what}" for what in ("a lighthouse keeper", "a clockmaker", "a river",
                                                          "a mountain village")]
    results = [{} for _ in prompts]
    threads = [threading.Thread(target=stream, args=(cluster, p, out)) for p, out in zip(prompts, results)]
    for t in threads:
        t.start()
    wait_until(lambda: all(cluster.stats(d).running for d in ("decode-0", "decode-1")), 60,
               "streams on both decode workers")
    wait_until(lambda: all(len(out.get("texts", ())) >= 4 for out in results), 60, "every stream to be under way")
    old = cluster.workers()["decode-0"]
    raylet = [p for p in descendants(cluster.nodes["worker"].pid) if comm(p) == "raylet"]
    assert len(raylet) == 1
    os.kill(raylet[0], signal.SIGKILL)
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a stream hung after its node was lost"
    failed, wanted = 0, reference(prompts, STREAM_TOKENS)
    for want, out in zip(wanted, results):
        if "error" in out["events"][-1]:  # not migrated: ended with a clear error
            assert out["events"][-1]["error"]["message"], out["events"][-1]
            failed += 1
        else:  # migrated (or never on the lost node): exactly the uninterrupted answer
            assert "".join(out["texts"]) == want
    metrics = httpx.get(cluster.url + "/metrics", headers=cluster.headers, timeout=10).text
    migrated = sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("pdserve_migrations_total"))
    print(f"\nnode lost: {migrated:g} stream(s) migrated, {failed} ended with an error, of {len(prompts)}")
    assert migrated + failed >= 1  # decode-0 was serving at least one of them

    wait_until(lambda: not cluster.workers().get("decode-0", {}).get("healthy"), 30, "the router to drop decode-0")
    prompt = "The history of the printing press begins"
    assert cluster.complete(prompt, 16)["choices"][0]["text"] == reference(prompt, 16)  # what is left serves
    for w in ("prefill-0", "decode-1"):  # every block back on the nodes left
        wait_until(lambda: (s := cluster.stats(w)).kv_usage == 0 and s.running == s.waiting == 0, 30,
                   f"{w} to hold no block")

    cluster.start_node("worker", "pdtest_decode")  # the node comes back: Ray restarts decode-0 on it
    back = wait_until(lambda: (w := cluster.workers().get("decode-0")) and w["healthy"]
                      and w["address"] != old["address"] and w, 180, "decode-0 to re-register")
    assert back["address"].split(":")[0] == IP["worker"]
    restarted = next(line for line in cluster.log().splitlines() if "worker decode-0 restarted" in line)
    print(restarted)
    assert cluster.stats("decode-0").kv_usage == 0
    cluster.track()


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
