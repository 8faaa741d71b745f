"""`pdserve bench --workload agentic`: agent sessions that resend a growing history (a system
prompt of tools, a task, then tool results), with think time between turns."""
import time

from pdserve.bench import serving as bench_serving
from pdserve.bench.workloads import Vocabulary, agentic_workload
from tests.test_bench_serving import FakeOpenAI, run_fake


def test_agentic_sessions_grow_by_tool_results():
    sessions = agentic_workload(Vocabulary(), 3, 4, system_len=10, result_len=(5, 9), output_len=(2, 3),
                                think_s=0.5, seed=1)
    assert len(sessions) == 3 and all(s.api == "chat" and s.think_s == 0.5 for s in sessions)
    for s in sessions:
        assert s.system.startswith("Tools: ") and len(s.system.split()) == 9  # "Tools:" is two tokens
        assert s.turns[0].prompt.startswith("Task:") and all(t.prompt.startswith("Tool result:") for t in s.turns[1:])
        assert all(7 <= t.input_len <= 11 and 2 <= t.output_len <= 3 for t in s.turns)
    assert agentic_workload(Vocabulary(), 3, 4, 10, (5, 9), (2, 3), 0.5, seed=1) == sessions  # seeded
    assert sessions[0].system != sessions[1].system  # each session its own tools: no shared prefix


def test_agentic_turns_wait_the_think_time_and_resend_everything(monkeypatch):
    monkeypatch.setattr(bench_serving, "METRICS_SETTLE_S", 0.0)
    fake = FakeOpenAI()
    sent = []
    handler = fake.handler

    async def timed(request):
        if request.url.path.endswith("/completions"):
            sent.append(time.perf_counter())
        return await handler(request)

    fake.handler = timed
    out, _, _ = run_fake(fake, "--workload", "agentic", "--num-conversations", "1", "--num-turns", "3",
                         "--system-prompt-len", "6", "--input-len", "4", "--output-len", "2", "--think-time", "0.2")
    m = out["endpoints"]["fake"]["runs"][0]["metrics"]
    assert m["requests"] == 3 and m["completed"] == 3
    roles = [[x["role"] for x in c["messages"]] for c in fake.calls]
    assert roles[-1] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert fake.calls[-1]["messages"][3]["content"].startswith("Tool result:")
    assert all(b - a >= 0.2 for a, b in zip(sent, sent[1:]))  # the agent "runs its tool" between turns


def test_agentic_defaults_outgrow_the_pool_and_report_per_request():
    """bench/agentic.py's defaults: more sessions' histories than the pool holds, session
    starts spread out; hits reported per completed request, per tier and worker role."""
    from pdserve.bench import agentic

    a = agentic.parser().parse_args([])
    history = a.system_len + a.turns * (150 + a.output_len)  # tokens of one session's last prompt
    pool_tokens = 192 * 2**20 // (2 * 30 * 3 * 64 * 4)  # SmolLM2's fp32 KV per token
    assert a.kv_cache_memory == "192MiB" and a.sessions * history > 3 * pool_tokens > 2 * history
    flags = agentic.workload(a, 1)
    assert flags[flags.index("--request-rate") + 1] == "0.5" and flags[flags.index("--think-time") + 1] == "5.0"
    run = {"metrics": {"completed": 4}, "prefix_cache": {"queries_tokens": 4000.0, "hits_tokens": 3000.0}}
    got = agentic.per_request(run, {"prefill": {"host": 2000.0, "disk": 0.0}}, 8.0)
    assert got == {"requests": 4, "queried_tokens": 1000.0, "hit_tokens": 750.0,
                   "tier_hit_tokens": {"prefill": {"host": 500.0, "disk": 0.0}}, "peer_blocks_pulled": 2.0}
