"""One OpenMP team per worker process (common/threads.py): the engine thread's.

A second team makes libgomp put every worker thread to sleep between parallel regions (it
throttles spinning once its threads outnumber the cores), which halved single-stream decode
speed on 2 cores. Run in a fresh interpreter, so no team from the test session is counted.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, json, os, threading
import torch
torch.set_num_threads(2)
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.threads import in_fresh_thread, openmp_threads_here, single_threaded_here
from pdserve.engine.model.tiny import tiny_llama

def threads():
    return len(os.listdir("/proc/self/task"))

def settled():  # a finished thread's team leaves a moment after the thread: wait for the count to hold
    import time
    n, since = threads(), time.monotonic()
    while time.monotonic() - since < 0.2:
        time.sleep(0.01)
        if threads() != n:
            n, since = threads(), time.monotonic()
    return n

def big_op():
    return float((torch.ones(1 << 22) * 2).sum())  # far above torch's grain size: a parallel region

out = {}

def probe(limit):  # a thread that opens a parallel region, counted while it is alive
    def run():
        if limit:
            single_threaded_here()
        big_op()
        out[f"alive_limit_{limit}"] = threads() - before
        done.wait()
    done = threading.Event()
    before = settled()
    t = threading.Thread(target=run); t.start()
    while f"alive_limit_{limit}" not in out:
        t.join(0.01)
    done.set(); t.join()

probe(False)
probe(True)

n0 = settled()
def build():
    big_op()
    return LLMEngine(tiny_llama(), EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20)))
eng = in_fresh_thread(build)
out["after_load"] = settled() - n0
single_threaded_here()
n1 = threads()
big_op()
out["after_main_op"] = threads() - n1
out["main_openmp"] = openmp_threads_here()
ae = AsyncEngine(eng)
ae.start()
async def main():
    toks = [t async for o in ae.generate("r", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            for t in o.new_token_ids]
    out["tokens"] = len(toks)
    out["engine_openmp"] = await ae.run(lambda e: openmp_threads_here())
asyncio.run(main())
out["engine_alive"] = threads() - n1
ae.stop()
out["used_blocks"] = eng.blocks.num_used_blocks
print(json.dumps(out))
"""


def test_the_engine_thread_owns_the_only_openmp_team():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the probe: a thread's parallel region brings a worker thread with it, unless limited
    assert out["alive_limit_False"] == 2 and out["alive_limit_True"] == 1, out
    assert out["after_load"] == 0, out        # the loader's team left with its thread
    assert out["after_main_op"] == 0 and out["main_openmp"] == 1, out  # the serving thread opens none
    assert out["tokens"] == 4 and out["engine_openmp"] == 2, out  # the engine keeps torch's thread count
    assert out["engine_alive"] == 2, out      # engine thread + the one worker of its team
    assert out["used_blocks"] == 0, out
