"""`pdserve bench`: the metric computations and workload generators as pure functions, the
async shell against a fake OpenAI server (httpx.MockTransport: no network), and one small
run against a live in-process pdserve cluster."""
import argparse
import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from pdserve.bench import serving as bench_serving
from pdserve.bench.metrics import (
    RequestResult,
    format_breakdown,
    format_table,
    meets_slo,
    parse_prefix_cache,
    percentile,
    prefix_cache_delta,
    summarize,
    ttft_breakdown,
)
from pdserve.bench.serving import add_bench_serving_args, bench, cap_requests, load_points, parse_endpoints
from pdserve.bench.workloads import (
    Session,
    Vocabulary,
    arrival_offsets,
    load_trace,
    multi_turn_workload,
    parse_range,
    random_workload,
    shared_prefix_workload,
    trace_offsets,
    trace_workload,
)


def ok(ttft=0.1, e2e=1.0, out=10, itl=(), input_len=8):
    return RequestResult("ok", 0.0, input_len, out, ttft=ttft, e2e=e2e, itl=list(itl), output_tokens=out)


def bench_args(*argv):
    p = argparse.ArgumentParser()
    add_bench_serving_args(p)
    return p.parse_args(list(argv))


# ---- metrics ----------------------------------------------------------------------------------
def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 101):
        xs = list(rng.exponential(size=n))
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([], 50) is None


def test_tpot_is_decode_time_per_token_after_the_first():
    assert ok(ttft=0.2, e2e=1.2, out=11).tpot == pytest.approx(0.1)
    assert ok(out=1).tpot is None  # one token: no decode step
    assert RequestResult("429", 0, 8, 10, e2e=0.01).tpot is None


def test_goodput_counts_only_requests_meeting_both_slos_and_failures_are_misses():
    rs = [ok(ttft=0.1, e2e=1.0, out=10),            # TPOT 0.1: good
          ok(ttft=0.1, e2e=0.1, out=1),             # one token: TTFT alone decides: good
          ok(ttft=3.0, e2e=3.9, out=10),            # TTFT over the SLO
          ok(ttft=0.1, e2e=3.1, out=11),            # TPOT 0.3: over the SLO
          RequestResult("429", 0.0, 8, 10, e2e=0.01),
          RequestResult("ReadTimeout", 0.0, 8, 10, e2e=5.0)]
    assert [meets_slo(r, 2.0, 0.15) for r in rs] == [True, True, False, False, False, False]
    m = summarize(rs, duration=2.0, slo_ttft=2.0, slo_tpot=0.15)
    assert m["requests"] == 6 and m["completed"] == 4 and m["failed"] == 2
    assert m["failed_by_status"] == {"429": 1, "ReadTimeout": 1}
    assert m["goodput"] == pytest.approx(2 / 2.0) and m["request_throughput"] == pytest.approx(4 / 2.0)
    assert m["slo_attainment"] == pytest.approx(2 / 6)
    assert m["output_tokens"] == 32 and m["output_throughput"] == pytest.approx(16.0)
    assert m["total_token_throughput"] == pytest.approx((32 + 4 * 8) / 2.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(100.0) and m["ttft_ms"]["mean"] == pytest.approx(1e3 * 3.3 / 4)
    # TPOT only from requests with 2+ tokens: 0.1, 0.1, 0.3
    assert m["tpot_ms"]["mean"] == pytest.approx(1e3 * 0.5 / 3)
    assert m["e2e_ms"]["p99"] == pytest.approx(1e3 * percentile([1.0, 0.1, 3.9, 3.1], 99))
    # no SLO: every completed request is good
    assert summarize(rs, 2.0)["goodput"] == m["request_throughput"]


def test_ttft_breakdown_splits_the_servers_parts_and_says_what_the_tail_waited_on():
    def timed(ttft, compute, wait=0.0, remote=True):
        r = ok(ttft=ttft)
        r.timing = {"queue_s": 0.001, "prefilled_remotely": remote, "ttft_s": ttft} | (
            {"blocks_wait_s": wait, "prefill_queue_s": 0.002, "prefill_compute_s": compute, "kv_push_s": 0.003}
            if remote else {})
        return r
    # nine quick requests, one slow because it waited for decode blocks; one prefilled locally
    rs = [timed(0.1, 0.05) for _ in range(8)] + [timed(1.0, 0.05, wait=0.8), timed(0.2, 0, remote=False)]
    b = ttft_breakdown(rs + [RequestResult("429", 0.0, 8, 10), ok()])  # failed and untimed: not counted
    assert b["requests"] == 10 and b["prefilled_remotely"] == pytest.approx(0.9)
    assert b["parts_ms"]["prefill_compute_s"]["p50"] == pytest.approx(50.0)
    assert b["parts_ms"]["blocks_wait_s"]["p50"] == 0 and b["parts_ms"]["blocks_wait_s"]["mean"] == pytest.approx(80.0)
    # the rest of a quick remote request's TTFT: 100 - 1 - 2 - 50 - 3 ms; a local prefill is all rest
    assert b["parts_ms"]["rest_s"]["p50"] == pytest.approx(44.0)
    assert b["tail_mean_ms"]["blocks_wait_s"] == pytest.approx(800.0)  # the slowest tenth: the one that waited
    assert "blocks wait 0/" in format_breakdown("pd", "rate inf", b) and "90% prefilled remotely" in \
        format_breakdown("pd", "rate inf", b)
    assert ttft_breakdown([ok(), ok()]) is None and summarize([ok()], 1.0)["ttft_breakdown"] is None


def test_itl_pools_every_gap_and_empty_runs_give_none():
    m = summarize([ok(itl=[0.01, 0.03]), ok(itl=[0.02])], duration=1.0)
    assert m["itl_ms"]["mean"] == pytest.approx(20.0) and m["itl_ms"]["p50"] == pytest.approx(20.0)
    m = summarize([RequestResult("500", 0, 8, 8, e2e=0.1)], duration=0.0)
    assert m["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    assert m["goodput"] == 0.0 and m["request_throughput"] == 0.0
    assert "-" in format_table([["e", "rate 1/s", "0/1", 0.0, 0.0, 0.0] + [None] * 8 + ["-"]])


METRICS = """# HELP pdserve_prefix_cache_queries_tokens Prompt tokens looked up in the prefix cache
# TYPE pdserve_prefix_cache_queries_tokens counter
pdserve_prefix_cache_queries_tokens_total{role="prefill",worker="prefill-0"} %s
pdserve_prefix_cache_queries_tokens_total{role="prefill",worker="prefill-1"} 100.0
pdserve_prefix_cache_queries_tokens_total{role="decode",worker="decode-0"} 500.0
pdserve_prefix_cache_hits_tokens_total{role="prefill",worker="prefill-0"} %s
pdserve_prefix_cache_hits_tokens_total{role="prefill",worker="prefill-1"} 0.0
pdserve_prefix_cache_hits_tokens_total{role="decode",worker="decode-0"} 50.0
pdserve_kv_usage_ratio{role="decode",worker="decode-0"} 0.5
"""


def test_prefix_cache_hit_rate_from_metrics_deltas():
    before = parse_prefix_cache(METRICS % ("100.0", "0.0"))
    assert before == {"prefill": {"queries": 200.0, "hits": 0.0}, "decode": {"queries": 500.0, "hits": 50.0}}
    after = parse_prefix_cache(METRICS % ("1100.0", "600.0"))
    assert prefix_cache_delta(before, after) == {"role": "prefill", "queries_tokens": 1000.0, "hits_tokens": 600.0,
                                                 "hit_rate": 0.6}
    # no prefill pool: aggregated workers; nothing looked up or another server's metrics: None
    agg = {"aggregated": {"queries": 10.0, "hits": 5.0}}
    assert prefix_cache_delta({}, agg) is None and prefix_cache_delta(None, agg) is None
    assert prefix_cache_delta({"aggregated": {"queries": 0.0, "hits": 0.0}}, agg)["hit_rate"] == 0.5
    assert prefix_cache_delta(before, before) is None
    # a decode worker that prefilled some prompts itself: each prompt counted once, where computed
    both = {"prefill": {"queries": 1200.0, "hits": 600.0}, "decode": {"queries": 800.0, "hits": 250.0}}
    assert prefix_cache_delta(before, both) == {"role": "prefill+decode", "queries_tokens": 1300.0,
                                                "hits_tokens": 800.0, "hit_rate": 800.0 / 1300.0}
    assert prefix_cache_delta(both, before) is None  # counters went back: a worker restarted
    assert parse_prefix_cache("vllm:prefix_cache_hits_total 5\n") == {}


# ---- workloads ----------------------------------------------------------------------------------
def test_shared_prefix_prompts_share_exactly_the_system_prompt_tokens(tokenizer):
    vocab = Vocabulary(tokenizer)
    S, Q = 48, 12
    sessions = shared_prefix_workload(vocab, 3, 4, S, Q, (5, 5), seed=1)
    assert len(sessions) == 12 and sorted(s.group for s in sessions) == [0] * 4 + [1] * 4 + [2] * 4
    ids = {}
    for s in sessions:
        (t,) = s.turns
        toks = tokenizer.encode(t.prompt)
        assert len(toks) == t.input_len == S + Q and t.output_len == 5
        ids.setdefault(s.group, []).append(toks)
    for group in ids.values():
        assert all(x[:S] == group[0][:S] for x in group)               # the system prompt: shared
        assert len({tuple(x[S:]) for x in group}) == len(group)        # the questions: not
    firsts = {tuple(group[0][:16]) for group in ids.values()}
    assert len(firsts) == 3  # groups differ from their first KV block on
    # interleaved, not group after group
    assert [s.group for s in sessions] != sorted(s.group for s in sessions)


def test_random_lengths_within_bounds_exact_in_tokens_and_seeded(tokenizer):
    vocab = Vocabulary(tokenizer)
    a = random_workload(vocab, 50, (10, 40), (1, 8), seed=7)
    for s in a:
        (t,) = s.turns
        assert 10 <= t.input_len <= 40 and 1 <= t.output_len <= 8
        assert len(tokenizer.encode(t.prompt)) == t.input_len
    assert len({t.input_len for s in a for t in s.turns}) > 10
    assert random_workload(vocab, 50, (10, 40), (1, 8), seed=7) == a
    assert random_workload(vocab, 50, (10, 40), (1, 8), seed=8) != a
    fixed = random_workload(Vocabulary(), 5, (16, 16), (4, 4), seed=0)  # no tokenizer: words stand in
    assert all(len(s.turns[0].prompt.split()) == 16 and s.turns[0].output_len == 4 for s in fixed)


def test_multi_turn_and_length_ranges():
    convs = multi_turn_workload(Vocabulary(), 3, 4, (5, 9), (2, 2), system_len=6, seed=0)
    assert len(convs) == 3 and all(len(c.turns) == 4 and c.api == "chat" for c in convs)
    assert all(len(c.system.split()) == 6 and all(5 <= t.input_len <= 9 for t in c.turns) for c in convs)
    assert cap_requests(convs, 6) == [convs[0], Session(convs[1].turns[:2], "chat", convs[1].system, None, 1)]
    assert parse_range("128") == (128, 128) and parse_range("64:256") == (64, 256) and parse_range(3) == (3, 3)
    for bad in ("0", "9:3", "a", "1:2:3"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_trace_replay_shares_hash_id_blocks(tmp_path, tokenizer):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 10.0, "input_len": 40, "output_len": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 10.5, "input_length": 35, "output_length": 4, "hash_ids": [1, 2, 9]},
        {"timestamp": 12.0, "input_len": 5, "output_len": 2, "prompt": "Hello there, how are you?"}]) + "\n")
    records = load_trace(path)
    sessions = trace_workload(Vocabulary(tokenizer), records, seed=0, block_size=16)
    assert [s.arrival for s in sessions] == [0.0, 0.5, 2.0]
    a, b = (tokenizer.encode(s.turns[0].prompt) for s in sessions[:2])
    assert len(a) == 40 and len(b) == 35 and a[:32] == b[:32] and a[32:35] != b[32:35]
    assert sessions[2].turns[0].prompt == "Hello there, how are you?"
    assert trace_offsets([0.0, 0.5, 2.0], None) == [0.0, 0.5, 2.0]
    assert trace_offsets([0.0, 0.5, 2.0], 2.0) == pytest.approx([0.0, 0.25, 1.0])  # 3 arrivals at 2/s: 1 s
    assert trace_offsets([0.0, 0.5, 2.0], math.inf) == [0.0] * 3
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_have_mean_gap_one_over_rate(burstiness):
    rate, n = 5.0, 20000
    t = arrival_offsets(n, rate, burstiness, seed=3)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # gamma: coefficient of variation 1/sqrt(shape) (burstier below 1, regular above)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert arrival_offsets(n, rate, burstiness, seed=3) == t
    assert arrival_offsets(4, math.inf, 1.0, seed=0) == [0.0] * 4


def test_load_points_and_endpoints():
    assert load_points("0.5,1,inf", None, "", trace=False) == [(0.5, None), (1.0, None), (math.inf, None)]
    assert load_points("", None, "", trace=False) == [(math.inf, None)]
    assert load_points("", None, "", trace=True) == [(None, None)]
    assert load_points("", 2.0, "1,4", trace=False) == [(2.0, 1), (2.0, 4)]
    with pytest.raises(ValueError):
        load_points("0", None, "", trace=False)
    assert parse_endpoints("", "http://h:8000/v1/") == [("h:8000", "http://h:8000")]
    assert parse_endpoints("a=http://x:1, b=http://y:2", "") == [("a", "http://x:1"), ("b", "http://y:2")]
    for bad in ("a=http://x,a=http://y", "http://x"):
        with pytest.raises(ValueError):
            parse_endpoints(bad, "")


# ---- the async shell against a fake server ---------------------------------------------------------
class FakeOpenAI:
    """A streaming OpenAI server in a MockTransport: one content chunk per max_tokens, usage at
    the end (unless not `usage`); request numbers in `refuse` get a 429, those in `cut` a
    stream that stops without [DONE]; pdserve-style prefix counters."""

    def __init__(self, refuse=(), gap_s=0.001, usage=True, cut=()):
        self.calls, self.refuse, self.gap_s, self.usage, self.cut = [], set(refuse), gap_s, usage, set(cut)
        self.inflight = self.max_inflight = 0
        self.queries = self.hits = 0

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=f'pdserve_prefix_cache_queries_tokens{{role="prefill",worker="p"}} '
                                  f'{self.queries}\npdserve_prefix_cache_hits_tokens{{role="prefill",worker="p"}} '
                                  f'{self.hits}\n')
        body = json.loads(request.content)
        self.calls.append(body)
        if len(self.calls) in self.refuse:
            return httpx.Response(429, json={"error": {"message": "busy"}})
        self.queries, self.hits = self.queries + 10, self.hits + 4
        return httpx.Response(200, content=self.events(body, len(self.calls) in self.cut),
                              headers={"content-type": "text/event-stream"})

    async def events(self, body, cut=False):
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        chat = "messages" in body
        for i in range(body["max_tokens"]):
            await asyncio.sleep(self.gap_s)
            choice = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
        self.inflight -= 1  # before the last event: a client stops reading at [DONE]
        if cut:
            return
        if self.usage:
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def run_fake(fake, *argv, endpoints=(("fake", "http://fake"),)):
    args = bench_args(*argv)
    return asyncio.run(bench(args, list(endpoints), transport=httpx.MockTransport(fake.handler)))


def test_shell_streams_measures_and_caps_concurrency(monkeypatch):
    monkeypatch.setattr(bench_serving, "METRICS_SETTLE_S", 0.0)
    fake = FakeOpenAI(gap_s=0.002)
    out, samples, rows = run_fake(fake, "--input-len", "6:12", "--output-len", "3:6", "--num-requests", "12",
                                  "--request-rates", "inf,200", "--max-concurrency", "3")
    runs = out["endpoints"]["fake"]["runs"]
    assert [r["label"] for r in runs] == ["rate inf c=3", "rate 200/s c=3"] and len(rows) == 2
    assert fake.max_inflight == 3 and len(fake.calls) == 24
    body = fake.calls[0]
    assert body["model"] == "fake-model" and body["stream"] and body["ignore_eos"]
    assert body["stream_options"] == {"include_usage": True} and 3 <= body["max_tokens"] <= 6
    for run in runs:
        m = run["metrics"]
        assert m["completed"] == 12 and m["failed"] == 0 and m["output_len_mismatches"] == 0
        assert m["output_tokens"] == run["workload"]["output_tokens"] and m["input_tokens"] == 12 * 7
        assert m["ttft_ms"]["p50"] >= 1.0 and m["itl_ms"]["p50"] >= 1.0 and m["tpot_ms"]["p50"] >= 1.0
        assert 0 < m["goodput"] <= m["request_throughput"]
        assert run["prefix_cache"] == {"role": "prefill", "queries_tokens": 120.0, "hits_tokens": 48.0,
                                       "hit_rate": 0.4}
    assert len(samples[("fake", "rate inf c=3")]) == 12
    # sweep points get fresh prompts (no cache hits carried over), the same lengths distribution
    assert {c["prompt"] for c in fake.calls[:12]}.isdisjoint(c["prompt"] for c in fake.calls[12:])


def test_multi_turn_resends_history_and_a_refusal_aborts_the_conversation(monkeypatch):
    monkeypatch.setattr(bench_serving, "METRICS_SETTLE_S", 0.0)
    fake = FakeOpenAI(refuse={2})
    out, _, _ = run_fake(fake, "--workload", "multi-turn", "--num-conversations", "1", "--num-turns", "3",
                         "--system-prompt-len", "4", "--input-len", "5", "--output-len", "2", "--no-ignore-eos",
                         "--extra-body", '{"top_k": 1}')
    m = out["endpoints"]["fake"]["runs"][0]["metrics"]
    assert m["requests"] == 3 and m["completed"] == 1
    assert m["failed_by_status"] == {"429": 1, "session_aborted": 1}
    first, second = fake.calls
    assert "ignore_eos" not in first and first["top_k"] == 1
    assert [x["role"] for x in first["messages"]] == ["system", "user"]
    assert [x["role"] for x in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"] == " t0 t1"  # the server's own reply goes back


def test_a_cut_stream_fails_and_without_usage_chunks_count_as_tokens(monkeypatch):
    monkeypatch.setattr(bench_serving, "METRICS_SETTLE_S", 0.0)
    fake = FakeOpenAI(usage=False, cut={1})
    out, _, _ = run_fake(fake, "--num-requests", "3", "--input-len", "8", "--output-len", "5", "--max-concurrency", "1")
    m = out["endpoints"]["fake"]["runs"][0]["metrics"]
    assert m["failed_by_status"] == {"incomplete_stream": 1} and m["completed"] == 2
    assert m["output_tokens"] == 10 and m["output_len_mismatches"] == 0
    assert m["input_tokens"] == 16  # no usage: the lengths asked for


def test_endpoints_get_the_same_workload(monkeypatch):
    monkeypatch.setattr(bench_serving, "METRICS_SETTLE_S", 0.0)
    fake = FakeOpenAI()
    out, _, rows = run_fake(fake, "--num-requests", "4", "--input-len", "8", "--output-len", "2",
                            endpoints=(("a", "http://a"), ("b", "http://b")))
    assert list(out["endpoints"]) == ["a", "b"] and [r[0] for r in rows] == ["a", "b"]
    assert [c["prompt"] for c in fake.calls[:4]] == [c["prompt"] for c in fake.calls[4:]]
    assert out["length_unit"].startswith("words")  # "fake-model" is not pdserve's: lengths by words


def test_max_duration_stops_sending(monkeypatch):
    monkeypatch.setattr(bench_serving, "METRICS_SETTLE_S", 0.0)
    fake = FakeOpenAI()
    out, _, _ = run_fake(fake, "--num-requests", "50", "--input-len", "4", "--output-len", "1",
                         "--request-rate", "20", "--max-duration", "0.5")
    m = out["endpoints"]["fake"]["runs"][0]["metrics"]
    assert m["not_sent"] > 20 and m["completed"] + m["not_sent"] == 50


# ---- a live pdserve cluster --------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_against_live_cluster(smollm, tmp_path):
    from pdserve.cli import main
    from pdserve.deploy.local import LocalCluster
    from tests.helpers.clusters import local_config

    loaded, tok = smollm
    cfg = local_config(64 << 20)
    cluster = LocalCluster(loaded, tok, cfg).start()
    out = tmp_path / "results.json"
    try:
        rc = main(["bench", "--base-url", cluster.url, "--workload", "shared-prefix", "--num-groups", "2",
                   "--prompts-per-group", "4", "--system-prompt-len", "64", "--question-len", "8",
                   "--output-len", "2:8", "--request-rates", "inf,8", "--slo-ttft", "30", "--slo-tpot", "5",
                   "--save-requests", "--output", str(out)])
        assert rc == 0

        async def used_blocks():
            for _ in range(50):  # the last releases may trail the last byte of the stream
                if all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in cluster.engines()):
                    return 0
                await asyncio.sleep(0.1)
            return sum(e.blocks.num_used_blocks for e in cluster.engines())
        assert cluster.run(used_blocks()) == 0
    finally:
        cluster.stop()
    res = json.loads(out.read_text())
    assert res["tokenizer"] != "words" and res["length_unit"] == "tokens"
    runs = res["endpoints"][cluster.url.split("://")[1]]["runs"]
    assert [r["label"] for r in runs] == ["rate inf", "rate 8/s"]
    for run in runs:
        m = run["metrics"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(m[key]) == {"mean", "p50", "p90", "p95", "p99"} and all(v is not None for v in m[key].values())
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "goodput", "duration_s"):
            assert m[key] > 0, key
        assert m["completed"] == m["requests"] == 8 and m["failed"] == 0
        assert m["goodput"] <= m["request_throughput"]
        for r in run["requests"]:
            assert r["output_tokens"] == r["output_len"] and r["prompt_tokens"] == r["input_len"] == 72
        assert m["output_len_mismatches"] == 0
        # pdserve's own account of each TTFT (every prompt through the prefill pool here)
        b = m["ttft_breakdown"]
        assert b["requests"] == 8 and b["prefilled_remotely"] == 1.0
        assert b["parts_ms"]["prefill_compute_s"]["p50"] > 0 and b["parts_ms"]["kv_push_s"]["p50"] > 0
        for r in run["requests"]:
            t = r["timing"]
            assert t["prefill_compute_s"] > 0 and t["ttft_s"] <= r["ttft"]
            assert t["queue_s"] + t["blocks_wait_s"] + t["prefill_queue_s"] + t["prefill_compute_s"] <= r["ttft"]
    # requests of a group that arrive after its first one find the system prompt cached
    assert runs[1]["prefix_cache"]["role"] == "prefill" and runs[1]["prefix_cache"]["hit_rate"] > 0

