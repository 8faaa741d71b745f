"""Pipeline parallelism through `pdserve up` (engine/parallel/pp.py, deploy/up.py): a degree
above the layers, a pipeline with expert parallelism, PP x TP whose TP degree does not
divide the heads, or a split of other than one layer count a stage, is refused before Ray
starts, naming the flag and what fits; a pipeline's stages count as ranks when the pools are
placed; one Ray cluster (`--models-file`) of two models, SmolLM2 on 2-stage prefill and
decode workers (the default split: 15 layers and 15) and a tiny random Llama on a decode
worker of 2 stages x 2 tensor-parallel ranks, answers greedily as each single engine, prompts
prefilled remotely and locally, and every process exits on Ctrl-C; a decode stage killed
mid-stream moves the stream to another worker, token-exact."""
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest
import torch

from pdserve.config import ClusterConfig, PoolConfig
from pdserve.deploy.placement import RayResources, cluster_demands, placement_shortfall
from pdserve.engine.config import EngineConfig
from pdserve.registry.embedded import free_port
from tests.helpers.procs import ENV, Proc, alive, descendants, stop, wait_kv_back
from tests.helpers.ray_procs import wait_until


def test_up_refuses_a_pipeline_that_does_not_fit_before_starting_ray():
    refusals = {("--decode-pp", "31"): ("--decode-pp: pipeline-parallel degree 31: this model has 30 layers: "
                                        "use 1 to 30"),
                ("--pp", "2", "--decode-ep", "2"): "--decode-ep: expert-parallel degree 2: this llama model is dense",
                ("--decode-pp", "2", "--decode-tp", "2"): ("--decode-tp: tensor-parallel degree 2 does not divide "
                                                           "this model's 9 attention heads (3 KV heads): use one of 1, 3, 9"),
                ("--decode-pp", "3", "--decode-pp-layers", "12,18"): ("pp_layers 12,18 gives 2 stages but its pp is "
                                                                      "3: give one layer count a stage"),
                ("--decode-pp", "2", "--decode-pp-layers", "12,17"): ("--decode-pp-layers: pipeline layers 12,17: this "
                                                                      "model's 30 layers over 2 stages need 2 counts")}
    runs = {flags: subprocess.Popen([sys.executable, "-m", "pdserve", "up", *flags], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=ENV) for flags in refusals}  # at once
    for flags, why in refusals.items():
        _, stderr = runs[flags].communicate(timeout=120)
        assert runs[flags].returncode != 0 and why in stderr, (flags, stderr)
        assert "Ray" not in stderr  # refused before a local Ray started
    assert PoolConfig(pp=2, ep=3).ranks(EngineConfig()) == 6  # PP x EP (tests/test_pp_ep.py)


def test_a_pipelines_stages_are_placed_as_ranks():
    """Each stage is a process that takes the pool's CPUs, as a tensor-parallel rank does:
    3 stages of 1 CPU do not fit a 2-CPU Ray (refused at once), 2 of 0.5 do."""
    two_cpus = RayResources({"CPU": 2.0}, {"CPU": 2.0}, [{"CPU": 2.0}])
    config = ClusterConfig(engine=EngineConfig(), prefill=PoolConfig(replicas=0), decode=PoolConfig(pp=3))
    assert config.decode.ranks(config.engine) == 3
    short = placement_shortfall(cluster_demands(config), two_cpus)
    assert short is not None and "1 decode worker(s) of 3 CPU each" in short, short
    fits = ClusterConfig(engine=EngineConfig(pipeline_parallel_size=2), prefill=PoolConfig(num_cpus=0.5),
                         decode=PoolConfig(num_cpus=0.5))
    assert [d.ranks for d in cluster_demands(fits)] == [2, 2]
    assert placement_shortfall(cluster_demands(fits), two_cpus) is None
    assert fits.worker("decode", "d").engine.pipeline_parallel_size == 2


N = 8  # tokens of each greedy completion
LLAMA_PROMPTS = [[15, 4000, 977, 31, 12000, 5], list(range(300, 400))]  # the long one is prefilled remotely
# SmolLM2's prompts: the short one prefilled by its decode worker, the long one (101 tokens, over
# --decode-local-prefill's 64, its decode worker busy with the short one) by its prefill pipeline
PROMPT = "The three primary colours are"
SMOLLM_PROMPTS = [PROMPT, "Red, green and blue are the colours of light; painters learn another set. " * 6 + PROMPT]
SMOLLM, SMOLLM_N = "SmolLM2-135M-Instruct", 12


def _remote_and_local(url: str, model: str) -> str:
    """/metrics once `model`'s decode worker counts one prompt prefilled remotely (its KV
    crossed from the prefill worker) and one it prefilled itself (stats refresh every ~1 s)."""
    def counted():
        text = httpx.get(url + "/metrics", timeout=10).text
        return all(re.search(rf'pdserve_decode_prefills(_total)?\{{[^}}]*model="{model}"[^}}]*where="{where}"'
                             r'[^}]*\} 1\.0', text) for where in ("remote", "local")) and text
    return wait_until(counted, 30, f"{model}'s decode worker's remote and local prefill counts")


def _kv_bytes_alike(url: str, model: str) -> list[float]:
    """`model`'s prefill and decode workers' KV bytes (pushed by every rank of the one, received
    by every rank of the other), once /metrics has both and they are equal."""
    def alike():
        text = httpx.get(url + "/metrics", timeout=10).text
        got = [float(v) for v in re.findall(rf'pdserve_kv_transfer_bytes(?:_total)?\{{[^}}]*{re.escape(model)}'
                                            r'[^}]*\} ([0-9.e+]+)', text)]
        return len(got) == 2 and got[0] == got[1] > 0 and got
    return wait_until(alike, 30, f"{model}'s workers' KV bytes, pushed and received alike")


def _ranks(up, worker: str) -> set[int]:
    """The processes below worker `worker`'s actor process: its other ranks (stages)."""
    return descendants(int(re.search(rf"worker {worker} \(pid (\d+)\)", up.text()).group(1)))


@dataclass
class PPCluster:
    up: Proc
    url: str
    llama_want: list[list[int]]
    smollm_want: list[str]
    procs: set[int]


@pytest.fixture(scope="module")
def pp_cluster(tmp_path_factory, tokenizer):
    """One `pdserve up --models-file` under Ray at --quantization exact (default routing: a
    decode worker prefills a prompt of at most 64 tokens itself): SmolLM2 with one prefill and
    one decode worker of 2 stages each (--prefill-pp 2 --decode-pp 2 as a file's pools), and a
    tiny Llama (4 heads, 2 KV heads, 4 layers, weights wide enough that greedy has no near-ties;
    saved with the default model's tokenizer) with a prefill worker of one rank and a decode
    worker of 2 stages x 2 TP ranks (--decode-pp 2 --decode-tp 2); 9 worker processes. Each
    single engine's greedy answers are computed while it starts. Its last test stops it."""
    transformers = pytest.importorskip("transformers")
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.engine.model.weights import load_model

    cfg = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5 if "embed" in name else p.shape[-1] ** -0.5)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    tokenizer._tok.save(str(path / "tokenizer.json"))
    models = path.parent / "models.toml"
    models.write_text(f'[[model]]\nname = "{SMOLLM}"\npath = "default"\n[model.prefill]\npp = 2\n[model.decode]\n'
                      f'pp = 2\n\n[[model]]\nname = "llama"\npath = "{path}"\n[model.decode]\npp = 2\ntp = 2\n')
    port = free_port()
    up = Proc("up", "--port", str(port), "--models-file", str(models), "--prefill", "1", "--decode", "1",
              "--prefill-cpus", "0.5", "--decode-cpus", "0.5", "--ray-cpus", "5", "--quantization", "exact",
              "--kv-cache-memory", "64MiB", "--cluster-token", "pp-token", "--shutdown-grace", "3")
    try:
        llama = LLMEngine(load_model(str(path), quantization="exact"), EngineConfig(quantization="exact"))
        llama_want = llama.generate(LLAMA_PROMPTS, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
        smollm = LLMEngine(load_model(quantization="exact"), EngineConfig(quantization="exact"), tokenizer)
        smollm_want = [tokenizer.decode(t, skip_special_tokens=True) for t in smollm.generate(
            [tokenizer.encode(p) for p in SMOLLM_PROMPTS], SamplingParams(max_tokens=SMOLLM_N, temperature=0))]
        del llama, smollm
        line = up.ready_line("curl ")  # the curl line: printed once the router can serve
        yield PPCluster(up, f"http://127.0.0.1:{port}", llama_want, smollm_want, descendants(up.p.pid))
    finally:
        if up.p.poll() is None:
            stop(up, 90)


@pytest.mark.slow
@pytest.mark.ray
def test_up_with_a_pp_x_tp_decode_pool(pp_cluster, tokenizer):
    """Two greedy completions at once to the Llama are the single engine's tokens: the long
    prompt prefilled by the prefill worker, its KV cut by the decode worker's KV address and
    pushed to each of its 4 ranks, each serving its own layers' KV head (P(PP=1) -> D(PP=2 x
    TP=2) by parts: rank 0's receiver refuses any layer or head it does not hold);
    the short one prefilled by the decode worker. Every KV block is back in its pool after."""
    c = pp_cluster
    r = httpx.post(c.url + "/v1/completions", timeout=120, json={
        "model": "llama", "prompt": LLAMA_PROMPTS, "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    got = sorted(r.json()["choices"], key=lambda ch: ch["index"])
    assert [ch["text"] for ch in got] == [tokenizer.decode(w, skip_special_tokens=True) for w in c.llama_want]
    _remote_and_local(c.url, "llama")  # the long prompt's KV crossed, the short one's did not
    ranks = _ranks(c.up, "llama-decode-0")
    wait_kv_back(c.url, 4)
    c.procs |= descendants(c.up.p.pid)
    assert len(ranks) == 3, ranks  # the decode worker's ranks 1-3: processes of its actor


@pytest.mark.slow
@pytest.mark.ray
def test_a_ray_cluster_of_two_stage_workers_answers_as_one_engine(pp_cluster):
    """SmolLM2's workers: each one's second stage is a process of its actor; the long prompt
    is prefilled remotely, so its KV leaves the prefill pipeline by parts (each stage pushes its
    own layers from its own process straight to the decode stage that holds them, which serves
    and writes them: P(PP=2) -> D(PP=2), no stage gathering; the prefill worker's bytes pushed
    are the decode worker's received); the
    short one is prefilled by the decode pipeline; the greedy answers are the single engine's.
    Then Ctrl-C: exit code 0, and nothing of the cluster (either model's workers) is left."""
    c = pp_cluster
    try:
        r = httpx.post(c.url + "/v1/completions", timeout=120, json={
            "model": SMOLLM, "prompt": SMOLLM_PROMPTS, "max_tokens": SMOLLM_N, "temperature": 0})
        assert r.status_code == 200, r.text
        _remote_and_local(c.url, SMOLLM)
        pushed = _kv_bytes_alike(c.url, SMOLLM)
        stages = [_ranks(c.up, f"{SMOLLM}-{role}-0") for role in ("prefill", "decode")]
        wait_kv_back(c.url, 4)
        c.procs |= descendants(c.up.p.pid)
    finally:
        rc = stop(c.up, 90)
    assert rc == 0, c.up.text()
    assert [len(s) for s in stages] == [1, 1], stages  # stage 1 of each worker: a process of its actor
    assert len(pushed) == 2 and pushed[0] == pushed[1] > 0, pushed  # its prefill and its decode worker
    got = sorted(r.json()["choices"], key=lambda ch: ch["index"])
    assert [ch["text"] for ch in got] == c.smollm_want
    wait_until(lambda: not [p for p in c.procs if alive(p)], 30, "every process of the cluster to exit")


@pytest.mark.slow
def test_a_decode_stage_killed_mid_stream_moves_the_stream(smollm):
    """A stage of the decode pipeline serving a stream is killed: the pipeline goes down (its
    other stage gone, every block back) and the router moves the stream to the other decode
    worker, where it continues with exactly the tokens of an uninterrupted run, within a bound."""
    import json
    import time

    import httpx

    from pdserve.deploy.local import LocalCluster
    from tests.helpers.clusters import MODEL, local_config

    loaded, tok = smollm
    config = local_config()
    config = type(config)(**{**config.__dict__, "decode": PoolConfig(replicas=2, pp=2, max_queue=0)})
    body = {"model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    c = LocalCluster(loaded, tok, config).start()
    texts, killed_at, victim = [], None, None
    try:
        whole = httpx.post(c.url + "/v1/completions", timeout=120, json=body).json()["choices"][0]["text"]
        with httpx.stream("POST", c.url + "/v1/completions", timeout=120, json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                texts += [ch["text"] for ch in event.get("choices", [])]
                if len(texts) == 5:
                    victim = next(e for e in c.engines() if e.tp and e.has_unfinished_requests())
                    os.kill(victim.tp.procs[0].pid, signal.SIGKILL)  # stage 1 of 2
                    killed_at = time.monotonic()
        done = time.monotonic()
        metrics = httpx.get(c.url + "/metrics", timeout=10).text
        engines = c.engines()
    finally:
        c.stop()
    assert killed_at is not None and done - killed_at < 60
    assert "error" not in event and "".join(texts) == whole, (texts, whole)
    assert "pdserve_migrations_total 1.0" in metrics
    assert victim.tp.pipeline and all(p.poll() is not None for p in victim.tp.procs)  # the pipeline is down
    assert all(e.blocks.num_used_blocks == 0 for e in engines)
