"""LoRA adapters with tensor parallelism: each rank's part of an adapter (split as the base
weights, the KV heads replicated over 4 ranks) sums to the whole update; an engine over 2
ranks, rows of two adapters and of the base batched in one step, gives the single engine's
greedy tokens and logprobs within float tolerance; an adapter loaded at run time reaches every
rank (and a bad one is refused without disturbing the others); every KV block comes back and
the ranks stop. Through `pdserve up` under Ray, a decode pool of 3 ranks serves adapters given
at start and loaded at run time as the single engine does, from a placement group that reserves
every rank's CPUs and in which Ray restarts the whole group when a rank is killed."""
import os
import signal

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.lora import LoRAFilesMissingError, load_adapter
from pdserve.engine.model.weights import load_model, load_state_dict
from pdserve.engine.parallel.shard import _rows, shard_lora
from pdserve.engine.parallel.tp import ModelSource
from tests.conftest import assert_engine_clean
from tests.helpers.lora import make_adapter, run_jobs, save_small_llama

pytest.importorskip("peft")

PROMPTS = [[5, 17, 99, 250, 3, 42, 42, 7], [300, 12, 8], list(range(20, 60))]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
TOL = 1e-4  # as tests/test_tp.py: the ranks sum their partial products in another order


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The base and three adapters: all seven projections at rank 8; q, v and down at rank 4
    with rsLoRA; k, o, gate and up at rank 4 (loaded at run time)."""
    root = tmp_path_factory.mktemp("lora_tp")
    base = save_small_llama(root / "base")
    make_adapter(base, root / "ad1", seed=1)
    make_adapter(base, root / "ad2", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                 use_rslora=True)
    make_adapter(base, root / "ad3", seed=3, r=4, alpha=8, targets=["k_proj", "o_proj", "gate_proj", "up_proj"])
    return root


def config(root) -> EngineConfig:
    return EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=8 << 20),
                        lora=LoRAConfig(max_loras=3, modules=(("ad1", str(root / "ad1")), ("ad2", str(root / "ad2")))))


@pytest.fixture(scope="module")
def single(root):
    return LLMEngine(load_model(root / "base", quantization="none"), config(root))


@pytest.fixture(scope="module")
def group(root):
    e = LLMEngine.tensor_parallel(ModelSource(model=str(root / "base")), config(root), 2)
    yield e
    e.shutdown()
    assert all(p.poll() is not None for p in e.tp.procs), "a rank outlived the engine"


def run(eng, jobs):
    """Add every (id, prompt, adapter) job and step to the end: {id: (tokens, logprobs)}, and
    the adapters (None: the base) of each step's rows; every block back, no adapter in use."""
    out, mixes = run_jobs(eng, jobs, PARAMS)
    assert_engine_clean(eng)
    assert eng.loras.in_use == 0
    return out, mixes


def assert_same(got, want):
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, f"{rid}: tokens over 2 ranks {got[rid][0]} != over 1 {tokens}"
        diff = max(abs(a - b) for a, b in zip(got[rid][1], logprobs))
        assert diff < TOL, f"{rid}: logprobs differ by {diff:.2e}"


@pytest.mark.parametrize("tp", [2, 4])
def test_the_ranks_parts_of_an_adapter_sum_to_its_update(root, tp):
    """Column-parallel (qkv, gate_up): each rank's update is the whole update's rows of its
    outputs; row-parallel (o, down): the ranks' updates of their inputs sum to the whole."""
    _, cfg, _ = load_state_dict(root / "base")
    whole = load_adapter("ad1", root / "ad1", cfg, 16)
    parts = [load_adapter("ad1", root / "ad1", cfg, 16, split=lambda p, c, r=r: shard_lora(p, c, tp, r))
             for r in range(tp)]
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        def update(adapter, fused, inp):
            m = adapter.layers[layer][fused]
            return inp @ m.a.T @ m.b.T
        qkv, gate_up = update(whole, "qkv", x), update(whole, "gate_up", x)
        for r, part in enumerate(parts):
            rows = _rows(cfg, tp, r)
            want = torch.cat([qkv[:, :q][:, rows["q_proj"]], qkv[:, q:q + kv][:, rows["k_proj"]],
                              qkv[:, q + kv:][:, rows["v_proj"]]], dim=1)
            torch.testing.assert_close(update(part, "qkv", x), want)
            want = torch.cat([gate_up[:, :inter][:, rows["gate_proj"]], gate_up[:, inter:][:, rows["up_proj"]]], dim=1)
            torch.testing.assert_close(update(part, "gate_up", x), want)
        for fused, proj, width in (("o", "o_proj", q), ("down", "down_proj", inter)):
            inp = torch.randn(5, width, generator=torch.Generator().manual_seed(layer))
            summed = sum(update(p, fused, inp[:, _rows(cfg, tp, r)[proj]]) for r, p in enumerate(parts))
            torch.testing.assert_close(summed, update(whole, fused, inp), rtol=1e-5, atol=1e-5)


def test_two_adapters_and_the_base_batched_over_two_ranks_equal_one_rank(single, group):
    jobs = [(f"{lora}-{i}", p, lora) for i, p in enumerate(PROMPTS) for lora in ("ad1", "ad2", None)]
    want, _ = run(single, jobs)
    got, mixes = run(group, jobs)
    assert_same(got, want)
    assert {"ad1", "ad2", None} in mixes, "the adapters and the base never shared a step"
    assert want["ad1-0"][0] != want["None-0"][0] and want["ad2-0"][0] != want["None-0"][0]


def test_an_adapter_loaded_at_run_time_reaches_every_rank(root, single, group, tmp_path):
    for eng in (single, group):
        with pytest.raises(LoRAFilesMissingError):
            eng.load_lora("bad", str(tmp_path / "nowhere"))
        eng.load_lora("ad3", str(root / "ad3"))
    jobs = [("a", PROMPTS[0], "ad3"), ("b", PROMPTS[2], "ad1"), ("c", PROMPTS[1], None)]
    want, _ = run(single, jobs)
    got, _ = run(group, jobs)
    assert_same(got, want)
    # unloaded and loaded again under another name, a replacement (a new id), evictions from the
    # full registry and loads on demand: the ranks follow
    for eng in (single, group):
        eng.unload_lora("ad3")
        eng.load_lora("ad3-again", str(root / "ad3"))
        eng.load_lora("ad2", str(root / "ad2"))
        eng.load_lora("extra", str(root / "ad1"))  # a fourth: the least recently used idle one goes
    jobs = [("a", PROMPTS[0], "ad3-again"), ("b", PROMPTS[1], "ad2"), ("c", PROMPTS[2], "ad1")]
    want, _ = run(single, jobs)
    got, _ = run(group, jobs)
    assert_same(got, want)
    assert want["a"][0] != want["c"][0]
    assert group.loras.evictions >= 2 and group.loras.evictions == single.loras.evictions
    assert [(i.name, i.resident) for i in group.loras.adapters()] == [(i.name, i.resident)
                                                                       for i in single.loras.adapters()]


def _served(tok, want, prompt, n, url, paths):
    """The adapter given at start, one loaded at run time and the base answer as the single
    engine (`want`: its tokens by adapter, "None" the base); both workers list both adapters;
    every KV block is back after."""
    import httpx

    from tests.helpers.procs import wait_kv_back

    base = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def complete(model):
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    assert complete("sql") == tok.decode(want["sql"], skip_special_tokens=True)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": paths["chat"]}, timeout=300)
    assert r.status_code == 200, r.text
    assert complete("chat") == tok.decode(want["chat"], skip_special_tokens=True)
    assert complete(base) == tok.decode(want["None"], skip_special_tokens=True)
    workers = httpx.get(url + "/admin/workers", timeout=10).json()["workers"]
    assert len(workers) == 2 and all(sorted(a["name"] for a in w["lora_adapters"]) == ["chat", "sql"]
                                     for w in workers), workers
    wait_kv_back(url, 2)


def _rank_killed(up, url, prompt):
    """Ask for `prompt`, SIGKILL a rank of decode-0, wait for Ray to restart the worker and ask
    again; then the placement groups and free resources, as a Ray driver sees them, and
    `pdserve scale --decode 2`: (first answer, second, the probe's run, the scale's run, the
    cluster's processes seen after the restart)."""
    import subprocess
    import sys

    import httpx

    from tests.helpers.procs import ENV, descendants
    from tests.helpers.ray_procs import scale, wait_until

    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(url + "/v1/completions", timeout=120, json=body)
    actor = int(up.find("decode worker decode-0 (pid ").split("(pid ")[1].split(")")[0])
    ranks = sorted(descendants(actor))
    assert len(ranks) == 2, ranks
    os.kill(ranks[0], signal.SIGKILL)
    wait_until(lambda: up.find("decode worker decode-0 restarted"), 180, "decode-0 to restart")
    wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 60, "the cluster to serve")
    again = httpx.post(url + "/v1/completions", timeout=120, json=body)
    procs = descendants(up.p.pid)
    gcs = up.find("ray: ").split("ray: ")[1].split()[0]
    probe = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
             "print(json.dumps([list(ray.util.placement_group_table().values()), ray.available_resources()]))")
    out = subprocess.run([sys.executable, "-c", probe % gcs], check=False, capture_output=True, text=True, timeout=120,
                         env=ENV)
    return r, again, out, scale(url, decode=2), procs


@pytest.mark.slow
@pytest.mark.ray
def test_a_ray_tensor_parallel_decode_pool_serves_adapters_from_a_placement_group(smollm, tmp_path):
    """`pdserve up --decode-tp 3` with --lora-modules: the prefill worker (one rank) and the
    decode worker (three) run the adapters' requests as the single engine does, and an adapter
    loaded at run time reaches the decode worker's ranks (`_served`). The decode worker holds a
    placement group of one bundle per rank, packed on one node (the actor in the first), so its
    ranks' CPUs are reserved; a rank killed takes its worker down and Ray restarts the whole
    group in its placement group, which answers as the single engine; growing the pool past the
    free CPUs is refused at once, counting every rank; nothing is left after Ctrl-C."""
    import json

    from pdserve.engine.model.export import export_hf
    from pdserve.registry.embedded import free_port
    from tests.helpers.procs import alive, descendants, stop
    from tests.helpers.ray_procs import Proc, wait_until

    tok = smollm[1]
    export_hf("", tmp_path / "hf")
    make_adapter(tmp_path / "hf", tmp_path / "sql", seed=3, scale=0.5)
    make_adapter(tmp_path / "hf", tmp_path / "chat", seed=5, r=4, targets=["q_proj", "v_proj"], scale=0.5)
    paths = {"sql": str(tmp_path / "sql"), "chat": str(tmp_path / "chat")}
    prompt, n, colours = tok.encode("Write a short poem about the harbour at dawn."), 10, "The three primary colours are"
    ref = LLMEngine(load_model(quantization="none"), EngineConfig(
        quantization="none", cache=CacheConfig(kv_cache_memory=32 << 20),
        lora=LoRAConfig(max_loras=2, modules=tuple(paths.items()))), tok)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    want = {}
    for lora in ("sql", "chat", None):
        ref.add_request(str(lora), prompt, params, lora=lora)
    while ref.has_unfinished_requests():
        for o in ref.step():
            want.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert want["sql"] != want["None"] and want["chat"] != want["None"]
    port = free_port()
    up = Proc("up", "--port", str(port), "--prefill", "1", "--decode", "1", "--decode-tp", "3", "--prefill-cpus", "0.5",
              "--decode-cpus", "0.5", "--ray-cpus", "2", "--quantization", "none", "--kv-cache-memory", "64MiB",
              "--lora-modules", f"sql={paths['sql']}", "--max-loras", "2", "--cluster-token", "tp-token",
              "--shutdown-grace", "3")
    url, procs = f"http://127.0.0.1:{port}", set()
    try:
        up.wait_ready()
        procs = descendants(up.p.pid)
        _served(tok, want, prompt, n, url, paths)
        r, again, out, full, later = _rank_killed(up, url, colours)
        procs |= later
    finally:
        rc = stop(up, within_s=90)
    assert rc == 0, up.text()
    assert r.status_code == again.status_code == 200, (r.text, again.text)
    plain = tok.decode(ref.generate([tok.encode(colours)], SamplingParams(max_tokens=12, temperature=0))[0],
                       skip_special_tokens=True)
    assert r.json()["choices"][0]["text"] == again.json()["choices"][0]["text"] == plain
    assert out.returncode == 0, out.stderr
    groups, free = json.loads(out.stdout.strip().splitlines()[-1])
    (group,) = [g for g in groups if g["state"] == "CREATED"]
    assert group["name"] == "pdserve-decode-0" and group["strategy"] == "STRICT_PACK"
    assert list(group["bundles"].values()) == [{"CPU": 0.5}] * 3
    assert free.get("CPU", 0.0) == 0.0  # 2 CPUs: the prefill worker's 0.5 and the three ranks' 1.5
    assert full.returncode == 1 and "no room for 1 more decode worker(s): they need 1.5 CPU" in full.stderr, full.stderr
    wait_until(lambda: not [p for p in procs if alive(p)], 30, "every process of the cluster to exit")
