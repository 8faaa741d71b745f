"""PP x TP through `pdserve up` under Ray: a tiny random Llama (4 heads, 2 KV heads, 4 layers;
saved as a Hugging Face directory with the default model's tokenizer), one prefill worker of
one rank and one decode worker of 2 stages x 2 tensor-parallel ranks (--decode-pp 2
--decode-tp 2: 4 processes, 3 of them the actor's children) at --quantization exact. Two
greedy completions at once are the single engine's tokens: the long prompt prefilled by the
prefill worker, its KV imported into the decode worker's 4 ranks; the short one prefilled by
the decode worker. Every KV block is back in its pool after, and every process exits on Ctrl-C."""
import re
import time

import httpx
import pytest
import torch

from pdserve.registry.embedded import free_port
from tests.helpers.procs import Proc, alive, descendants, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]
transformers = pytest.importorskip("transformers")

N = 8
PROMPTS = [[15, 4000, 977, 31, 12000, 5], list(range(300, 400))]  # the long one is prefilled remotely


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer):
    """A tiny Llama directory (the default tokenizer's vocabulary; weights wide enough that
    greedy has no near-ties) and the single engine's greedy tokens for PROMPTS."""
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.config import EngineConfig
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
    one = LLMEngine(load_model(str(path), quantization="exact"), EngineConfig(quantization="exact"))
    want = one.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    return path, want


def test_up_with_a_pp_x_tp_decode_pool(llama_dir, tokenizer):
    path, want = llama_dir
    port = free_port()
    up = Proc("up", "--port", str(port), "--prefill", "1", "--decode", "1", "--model", str(path),
              "--decode-pp", "2", "--decode-tp", "2", "--prefill-cpus", "0.5", "--decode-cpus", "0.5",
              "--ray-cpus", "3", "--quantization", "exact", "--kv-cache-memory", "16MiB",
              "--cluster-token", "test-token", "--shutdown-grace", "3")
    url, procs = f"http://127.0.0.1:{port}", set()
    try:
        line = up.p.stdout.readline()
        assert line.startswith("curl "), up.text() if up.p.poll() is not None else line
        procs = descendants(up.p.pid)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPTS, "max_tokens": N, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        got = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in got] == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
        remote = r'pdserve_decode_prefills(_total)?\{[^}]*where="remote"[^}]*\} 1\.0'  # the long prompt's KV crossed
        deadline = time.monotonic() + 30
        while not re.search(remote, text := httpx.get(url + "/metrics", timeout=10).text):
            assert time.monotonic() < deadline, text
            time.sleep(0.3)
        decode_pid = int(re.search(r"decode worker decode-0 \(pid (\d+)\)", up.text()).group(1))
        ranks = descendants(decode_pid)
        wait_kv_back(url, 2)
        procs |= descendants(up.p.pid)
    finally:
        rc = stop(up)
    assert rc == 0, up.text()
    assert len(ranks) == 3, ranks  # the decode worker's ranks 1-3: processes of its actor
    deadline = time.monotonic() + 30
    while [p for p in procs if alive(p)]:
        assert time.monotonic() < deadline, "every process of the cluster exits"
        time.sleep(0.5)
