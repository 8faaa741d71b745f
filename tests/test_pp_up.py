"""Pipeline parallelism through `pdserve up` (engine/parallel/pp.py, deploy/up.py): a degree
above the layers, a pipeline with expert parallelism, or PP x TP whose TP degree does not
divide the heads, is refused before Ray starts, naming the flag and what fits; a pipeline's
stages count as ranks when the pools are placed; and a Ray cluster of 2-stage prefill and
decode workers answers greedily as the single engine; a decode stage killed mid-stream moves
the stream to another worker, token-exact."""
import os
import re
import signal
import subprocess
import sys

import pytest

from pdserve.config import ClusterConfig, PoolConfig
from pdserve.deploy.placement import RayResources, cluster_demands, placement_shortfall
from pdserve.engine.config import EngineConfig
from tests.helpers.procs import ENV


def test_up_refuses_a_pipeline_that_does_not_fit_before_starting_ray():
    for flags, why in ((["--decode-pp", "31"], "--decode-pp: pipeline-parallel degree 31: this model has 30 layers: "
                        "use 1 to 30"),
                       (["--pp", "2", "--decode-ep", "2"], "--decode-pp 2 with an expert-parallel degree above 1 "
                        "(ep 2): stages split by experts are not implemented"),
                       (["--decode-pp", "2", "--decode-tp", "2"], "--decode-tp: tensor-parallel degree 2 does not "
                        "divide this model's 9 attention heads (3 KV heads): use one of 1, 3, 9")):
        r = subprocess.run([sys.executable, "-m", "pdserve", "up", *flags], capture_output=True, text=True,
                           timeout=120, env=ENV, check=False)
        assert r.returncode != 0 and why in r.stderr, r.stderr
        assert "Ray" not in r.stderr  # refused before a local Ray started
    with pytest.raises(ValueError, match=r"a pool's pp \(2\) cannot be above 1 with ep \(3\)"):
        PoolConfig(pp=2, ep=3)


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


@pytest.mark.slow
@pytest.mark.ray
def test_a_ray_cluster_of_two_stage_workers_answers_as_one_engine(tokenizer):
    """`pdserve up --prefill-pp 2 --decode-pp 2 --quantization exact`: each worker's second
    stage is a process of its actor; the prompt is prefilled remotely (no local prefill), so
    its KV leaves the prefill pipeline (its layer streams exported once the pass is through)
    and enters the decode pipeline in the whole model's layout; the greedy answer is the
    single engine's; nothing is left after Ctrl-C."""
    import httpx

    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.engine.model.weights import load_model
    from pdserve.registry.embedded import free_port
    from tests.helpers.procs import alive, descendants
    from tests.helpers.ray_procs import Proc, wait_until

    port = free_port()
    up = Proc("up", "--port", str(port), "--prefill-pp", "2", "--decode-pp", "2", "--prefill-cpus", "0.5",
              "--decode-cpus", "0.5", "--ray-cpus", "2", "--kv-cache-memory", "64MiB", "--cluster-token", "pp-token",
              "--quantization", "exact", "--local-prefill-threshold", "0", "--decode-local-prefill", "0",
              "--no-idle-decode-prefill")
    url, procs, prompt = f"http://127.0.0.1:{port}", set(), "The three primary colours are"
    try:
        up.wait_ready()
        procs = descendants(up.p.pid)
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12, "temperature": 0})
        # the prompt was prefilled remotely: its KV crossed from one pipeline to the other
        remote = r'pdserve_decode_prefills(_total)?\{[^}]*where="remote"[^}]*\} 1\.0'
        wait_until(lambda: re.search(remote, httpx.get(url + "/metrics", timeout=10).text), 30,
                   "the decode worker's remote prefill count")
        stages = {role: descendants(int(up.find(f"{role} worker {role}-0 (pid ").split("(pid ")[1].split(")")[0]))
                  for role in ("prefill", "decode")}
        procs |= descendants(up.p.pid)
    finally:
        up.p.send_signal(signal.SIGINT)
        rc = up.p.wait(90)
    assert rc == 0, up.text()
    assert [len(s) for s in stages.values()] == [1, 1], stages  # stage 1 of each worker: a process of its actor
    assert r.status_code == 200, r.text
    ref = LLMEngine(load_model(quantization="exact"), EngineConfig(quantization="exact"), tokenizer)
    want = tokenizer.decode(ref.generate([tokenizer.encode(prompt)], SamplingParams(max_tokens=12, temperature=0))[0],
                            skip_special_tokens=True)
    assert r.json()["choices"][0]["text"] == want
    wait_until(lambda: not [p for p in procs if alive(p)], 30, "every process of the cluster to exit")


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
