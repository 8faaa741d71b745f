"""A mixture-of-experts model through `pdserve up` under Ray: a small random Qwen3-MoE (built
by transformers, saved as a Hugging Face directory with the default model's tokenizer), one
prefill and one decode worker at --quantization exact. Two greedy completions at once equal
transformers' greedy tokens (the long prompt prefilled by the prefill worker and decoded over
the KV hand-off, the short one prefilled by the decode worker); every KV block is back in its
pool after. The same with the decode pool's experts split over 2 ranks (--decode-ep 2), whose
expert load is on the decode worker's /metrics, and over a pipeline of two such stages
(--decode-pp 2 --decode-ep 2)."""
import re
import time

import httpx
import pytest
import torch

from pdserve.registry.embedded import free_port
from tests.helpers.procs import Proc, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]
transformers = pytest.importorskip("transformers")

N = 8
PROMPTS = [[15, 4000, 977, 31, 12000, 5], list(range(300, 400))]  # the long one is prefilled remotely


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    """A tiny Qwen3-MoE directory (8 experts, top 2, the default tokenizer's vocabulary) and
    transformers' greedy tokens for PROMPTS."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                router = name.endswith("mlp.gate.weight")
                p.normal_(0, 0.5 if "embed" in name else 1.0 if router else p.shape[-1] ** -0.5)
    path = tmp_path_factory.mktemp("qwen3moe")
    hf.save_pretrained(path)
    tokenizer._tok.save(str(path / "tokenizer.json"))
    want = []
    for ids in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
        want.append(out[0, len(ids):].tolist())
    return path, want


def prefill_tokens(url: str, within_s: float = 10.0) -> float:
    """The prompt tokens the prefill worker has looked up in its prefix cache, once nonzero
    (the workers' stats reach the router about every second)."""
    deadline, n = time.monotonic() + within_s, 0.0
    while n == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
        n = sum(float(x.split()[-1]) for x in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                if x.startswith('pdserve_prefix_cache_queries_tokens_total{role="prefill"'))
    return n


def test_up_serves_a_moe_model_as_transformers_computes_it(moe_dir, tokenizer):
    served_as_transformers(moe_dir, tokenizer)


def worker_metrics(url: str, role: str) -> str:
    worker = next(w for w in httpx.get(url + "/admin/workers", timeout=10).json()["workers"] if w["role"] == role)
    return httpx.get(f"http://{worker['address'].rpartition(':')[0]}:{worker['metrics_port']}/metrics", timeout=10).text


def served_as_transformers(moe_dir, tokenizer, *flags: str) -> str:
    """`pdserve up` on the MoE model with a one-rank prefill worker and a decode worker shaped by
    `flags`: both prompts' greedy tokens are transformers' (the long one's KV from the prefill
    worker), every block back after; the decode worker's /metrics, read before the stop."""
    path, want = moe_dir
    port = free_port()
    up = Proc("up", "--port", str(port), "--prefill", "1", "--decode", "1", "--model", str(path), *flags,
              "--ray-cpus", "2", "--quantization", "exact", "--kv-cache-memory", "16MiB", "--cluster-token",
              "test-token", "--shutdown-grace", "3")
    url = f"http://127.0.0.1:{port}"
    try:
        line = up.ready_line("curl ")
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPTS, "max_tokens": N, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        got = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in got] == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
        assert prefill_tokens(url) >= 100  # the long prompt's KV came from the prefill worker
        text = worker_metrics(url, "decode")
        wait_kv_back(url, 2)
    finally:
        rc = stop(up)
    assert rc == 0, up.text()
    return text


def expert_load(text: str) -> dict[tuple[int, int], float]:
    """(expert, rank) -> the (token, expert) pairs routed to it, from a worker's /metrics."""
    return {(int(e), int(r)): float(v) for e, r, v in re.findall(
        r'^pdserve:moe_expert_tokens_total\{[^}]*expert="(\d+)"[^}]*rank="(\d+)"[^}]*\} (\S+)$', text, re.MULTILINE)}


def test_up_with_an_expert_parallel_decode_pool(moe_dir, tokenizer):
    """`--decode-ep 2`: the decode worker's 8 experts over 2 ranks (4 each), attention on both;
    the long prompt's KV, prefilled by the one-rank prefill worker, imported into the group. The
    tokens are transformers'; the decode worker's /metrics counts the pairs routed to each
    expert and rank (each row: 2 experts at each of the 2 layers), both ranks' experts used."""
    text = served_as_transformers(moe_dir, tokenizer, "--decode-ep", "2", "--prefill-cpus", "0.5", "--decode-cpus", "0.5")
    experts = expert_load(text)
    ranks = {int(r): float(v) for r, v in re.findall(
        r'^pdserve:moe_rank_tokens_total\{[^}]*rank="(\d+)"[^}]*\} (\S+)$', text, re.MULTILINE)}
    assert sorted(experts) == [(e, e // 4) for e in range(8)], text
    assert ranks == {r: sum(v for (_, rr), v in experts.items() if rr == r) for r in (0, 1)} and min(ranks.values()) > 0
    rows = sum(ranks.values()) / 4  # top-2 at each of 2 layers
    assert rows == int(rows) and rows >= len(PROMPTS[0]) + 2 * (N - 1)  # the short prompt, both decodes


def test_up_with_a_pipeline_of_expert_parallel_stages(moe_dir, tokenizer):
    """`--decode-pp 2 --decode-ep 2` (PP x EP): the decode worker's 2 layers in 2 stages, each
    stage's 8 experts over its 2 ranks (4 processes); the long prompt's KV, prefilled by the
    one-rank prefill worker, imported stage by stage. The tokens are transformers'; the expert
    load on /metrics (both stages' layers, the later stage's asked for at each scrape) puts 4
    experts on each of a stage's ranks, both used."""
    experts = expert_load(served_as_transformers(moe_dir, tokenizer, "--decode-pp", "2", "--decode-ep", "2",
                                                 "--prefill-cpus", "0.4", "--decode-cpus", "0.4"))
    assert sorted(experts) == [(e, e // 4) for e in range(8)], experts
    assert min(sum(v for (_, r), v in experts.items() if r == rank) for rank in (0, 1)) > 0, experts
