"""Isolation through `pdserve up` under Ray, started as a user starts it (no flags; the one
tests/test_up.py uses too, tests/helpers/shared_up.py), read from the
decode worker's own step-time series (`pdserve:step_seconds` on its /metrics, not wall-clock):
beside a 24-stream flood at the default priority, an urgent client's (priority -10) steps stay
within the step budget of its steps alone, and the flood's steps between its chats are window
steps of at most about `window_step_s`; with two tenants and no priority anywhere, the tenant
with less in flight is served as the more urgent one (its steps are the contended, bounded
ones), not behind the other's backlog; less urgent requests that come during an urgent stream
have their commands held on its decode worker; every KV block is back in its pool after."""
import asyncio
import json
import math
import os
import random
import re

import httpx
import pytest

from pdserve.engine.core.step_cost import BUCKETS
from tests.helpers.procs import OtherLoad, wait_kv_back
from tests.helpers.ray_procs import slowness

pytestmark = [pytest.mark.slow, pytest.mark.ray]

FLOOD, FLOOD_PROMPT, FLOOD_TOKENS, CHAT_TOKENS = 24, 64, 256, 24  # a decode-heavy flood: its streams decode beside B


@pytest.fixture
def url(default_up):
    """The router of the shared `pdserve up` (tests/helpers/shared_up.py)."""
    return default_up.url


def step_series(url: str) -> dict:
    """The decode worker's pdserve:step_seconds buckets, {kind: [(le, cumulative count)]}: kinds
    "true" (contended), "window" and "false" (neither); and "computed": {prompt, decode: the
    tokens its steps computed}."""
    worker = next(w for w in httpx.get(url + "/admin/workers", timeout=10).json()["workers"] if w["role"] == "decode")
    text = httpx.get(f"http://{worker['address'].rpartition(':')[0]}:{worker['metrics_port']}/metrics", timeout=10).text
    out: dict = {"true": [], "false": [], "window": [], "computed": {k: float(v) for k, v in re.findall(
        r'^pdserve:computed_tokens_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', text, re.M)}}
    for labels, value in re.findall(r'^pdserve:step_seconds_bucket\{([^}]*)\} (\S+)$', text, re.M):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out["window" if kv["window"] == "true" else kv["contended"]].append((float(kv["le"]), float(value)))
    return out


def load_buckets() -> int:
    """Buckets a step may move up by the machine's other load (0 on an idle machine): a step's
    time stretches with the cores' other users, each bucket sqrt(2) wider than the last.
    Measured while the test's own load is not running (before it and after it: another
    process's load may start or end in between)."""
    return max(0, round(2 * math.log2(slowness())))


def other_buckets(other: OtherLoad) -> int:
    """Buckets a step may move up by the cores other work kept busy over a window (another
    pytest worker's tests, measured while the flood runs: `load_buckets` samples before and
    after it): a team on n cores stretches by n / (n - other)."""
    n = os.cpu_count() or 2
    return max(0, round(2 * math.log2(n / (n - min(other.cores(), n - 0.25)))))


def median_step(before: dict, after: dict, *kinds: str) -> tuple[int, int]:
    """(the bucket the median step of the steps of `kinds` between the two readings falls in,
    each bucket sqrt(2) wider than the last; how many steps). No steps: (0, 0)."""
    counts = [sum(after[k][i][1] - before[k][i][1] for k in kinds) for i in range(len(after[kinds[0]]))]
    return next(i for i, n in enumerate(counts) if n >= counts[-1] / 2), int(counts[-1])


async def _flood(client: httpx.AsyncClient, url: str, rng: random.Random) -> None:
    while True:  # its next request as soon as the last one ends, until cancelled
        prompt = [rng.randrange(1000, 40000) for _ in range(FLOOD_PROMPT)]
        async with client.stream("POST", url + "/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": FLOOD_TOKENS, "stream": True,
                "ignore_eos": True}) as r:
            async for _ in r.aiter_lines():
                pass


async def _chats(url: str, n: int, priority: int | None, tenant: str | None, rng: random.Random) -> None:
    headers = {"x-pdserve-tenant": tenant} if tenant else {}
    async with httpx.AsyncClient(timeout=300, headers=headers) as client:
        for i in range(n):
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": CHAT_TOKENS, "stream": True, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"chat {rng.random()}: name {i + 2} rivers."}]}
            if priority is not None:
                body["priority"] = priority
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            assert sum(bool(json.loads(x[6:])["choices"][0]["delta"].get("content")) for x in lines) >= CHAT_TOKENS // 2
            await asyncio.sleep(0.2)


async def _beside_a_flood(url: str, priority: int | None, tenants: bool) -> None:
    rng = random.Random(priority or 7)
    headers = {"x-pdserve-tenant": "A"} if tenants else {}
    async with httpx.AsyncClient(timeout=300, headers=headers, limits=httpx.Limits(max_connections=64)) as client:
        flood = [asyncio.ensure_future(_flood(client, url, random.Random(rng.random()))) for _ in range(FLOOD)]
        try:
            await asyncio.sleep(4.0)  # the flood fills both workers
            await _chats(url, 3, priority, "B" if tenants else None, rng)
        finally:
            for f in flood:  # the flood's client goes away: its requests must stop on the workers
                f.cancel()
            await asyncio.gather(*flood, return_exceptions=True)


def placed_urgent(url: str) -> float:
    """The router's count of prompts computed on their decode worker for being more urgent than
    every stream there (`pdserve_prompt_placements_total{where="decode_urgent"}`)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r'^pdserve_prompt_placements_total\{where="decode_urgent"\} (\S+)$', text, re.M).group(1))


def test_urgent_steps_stay_within_the_budget_of_their_steps_alone(url, default_up):
    rng = random.Random(1)
    load = load_buckets()
    before = step_series(url)
    asyncio.run(_chats(url, 3, -10, None, rng))
    alone = step_series(url)
    # B alone: plain steps, or window steps while an urgent window of the tests before is open
    alone_median, alone_steps = median_step(before, alone, "false", "window")
    assert alone_steps >= 3 * (CHAT_TOKENS - 1) and median_step(before, alone, "true")[1] == 0
    placed = placed_urgent(url)
    other = OtherLoad([default_up.up.p.pid])
    asyncio.run(_beside_a_flood(url, -10, tenants=False))
    # B's short prompts beside the flood are computed on the decode worker, where the flood's
    # steps stop for them, not behind a prefill worker's chunk that streams KV out
    assert placed_urgent(url) - placed >= 3
    flood = step_series(url)
    urgent_median, urgent_steps = median_step(alone, flood, "true")
    assert urgent_steps >= 3 * (CHAT_TOKENS - 1), urgent_steps  # B's steps beside the flood: contended
    # the budget lets the flood's decodes add 30% to B's step; the flood's client and the router
    # take CPU from B's two threads too: at most 2x (two buckets) over B's steps alone (measured:
    # one bucket; with the flood's decodes and chunks in B's steps, three)
    load = max(load, load_buckets(), other_buckets(other))
    assert urgent_median <= alone_median + 2 + load, (urgent_median, alone_median, load)
    # between B's chats the flood's steps are window steps, sized by the learnt cost to 60 ms
    # (the flood's decodes and chunks take turns), which B's next prompt stops at a layer's end;
    # measured: the 23-32 ms bucket; at most 64 ms (`window_step_s`) plus the load
    assert all(flood["computed"][k] > alone["computed"][k] > before["computed"][k] for k in ("prompt", "decode"))
    window_median, window_steps = median_step(alone, flood, "window")
    last_ok = max(i for i, b in enumerate(BUCKETS) if b <= 0.065)
    assert window_steps >= 10 and window_median <= last_ok + load, (window_steps, BUCKETS[window_median], load)
    wait_kv_back(url, 2, within_s=60)  # the flood's cancelled requests freed everything


def test_a_tenant_with_no_priority_is_served_ahead_of_another_tenants_backlog(url, default_up):
    load = load_buckets()
    before = step_series(url)
    asyncio.run(_chats(url, 2, None, "B", random.Random(2)))
    alone = step_series(url)
    # B alone: plain steps, or window steps while an urgent window of the tests before is open
    alone_median, alone_steps = median_step(before, alone, "false", "window")
    assert alone_steps >= 2 * (CHAT_TOKENS - 1), alone_steps
    other = OtherLoad([default_up.up.p.pid])
    asyncio.run(_beside_a_flood(url, None, tenants=True))
    fair = step_series(url)
    median, steps = median_step(alone, fair, "true")
    assert steps >= 3 * (CHAT_TOKENS - 1), steps  # B (less in flight) was the urgent one in its steps
    load = max(load, load_buckets(), other_buckets(other))
    # measured: one or two buckets over B's steps alone (steps that carried the flood's decodes and
    # chunks were three or more)
    assert median <= alone_median + 3 + load, (median, alone_median, load)
    wait_kv_back(url, 2, within_s=60)


def _worker_counters(url: str) -> dict[str, dict[str, float]]:
    """Each worker's {prompt tokens computed, steps stopped for a more urgent request, seconds
    its urgent steps waited for a less urgent peer's cores}, by role."""
    out = {}
    for w in httpx.get(url + "/admin/workers", timeout=10).json()["workers"]:
        text = httpx.get(f"http://{w['address'].rpartition(':')[0]}:{w['metrics_port']}/metrics", timeout=10).text
        out[w["role"]] = {"prompt": sum(map(float, re.findall(
            r'^pdserve:computed_tokens_total\{[^}]*kind="prompt"[^}]*\} (\S+)$', text, re.M)))} | {
            key: sum(map(float, re.findall(rf"^pdserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M)))
            for key, name in (("stopped", "stopped_steps_total"), ("peer_wait", "peer_wait_seconds_total"))}
    return out


def test_an_urgent_request_stops_a_long_step_of_less_urgent_work(url):
    """Four ~2,000-token prompts keep both workers in 512-token steps (~0.5 s each; at priority
    -10, as urgent as the chats of the tests before, so the router lends them to the decode
    worker too); a more urgent request (-20) that comes then stops the step in flight where it
    lands at a layer's end (`pdserve:stopped_steps_total`) instead of waiting for it, and is
    answered before any of the long prompts; all of them complete, every block back."""
    rng = random.Random(11)
    before = _worker_counters(url)

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            async def send(prompt, priority: int, max_tokens: int = 1) -> float:
                r = await client.post(url + "/v1/completions", json={
                    "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "priority": priority})
                assert r.status_code == 200, r.text
                return asyncio.get_running_loop().time()
            longs = [asyncio.ensure_future(send([rng.randrange(1000, 40000) for _ in range(2000)], -10))
                     for _ in range(4)]
            for _ in range(600):  # until both workers compute the long prompts (a 2-core machine under load: slow)
                await asyncio.sleep(0.05)
                now = await asyncio.to_thread(_worker_counters, url)
                if all(now[role]["prompt"] > before[role]["prompt"] for role in now):
                    break
            assert not any(t.done() for t in longs)
            urgent = await send("Name two rivers.", -20, 2)
            assert urgent < min(await asyncio.gather(*longs))
    asyncio.run(main())
    after = _worker_counters(url)
    assert sum(after[r]["stopped"] - before[r]["stopped"] for r in after) >= 1, (before, after)
    # its step on the decode worker waited for the prefill worker, busy with less urgent work, to lend its core
    assert after["decode"]["peer_wait"] > before["decode"]["peer_wait"], (before, after)
    wait_kv_back(url, 2, within_s=60)


def held_commands(url: str) -> float:
    """The decode worker's `pdserve:held_commands_total`."""
    worker = next(w for w in httpx.get(url + "/admin/workers", timeout=10).json()["workers"] if w["role"] == "decode")
    text = httpx.get(f"http://{worker['address'].rpartition(':')[0]}:{worker['metrics_port']}/metrics", timeout=10).text
    return sum(map(float, re.findall(r"^pdserve:held_commands_total\{[^}]*\} (\S+)$", text, re.M)))


def test_less_urgent_requests_wait_out_an_urgent_stream_on_its_decode_worker(url):
    """Requests at the default priority that come while a priority -10 stream decodes have their
    first command on its decode worker (an add, or an ask for their KV's blocks) held until the
    stream ends, not run between its steps; they complete, every block back."""
    before = held_commands(url)

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            async def later(i: int):
                r = await client.post(url + "/v1/completions", json={
                    "model": "SmolLM2-135M-Instruct", "prompt": f"{i} rivers of Europe:", "max_tokens": 4})
                assert r.status_code == 200, r.text
            async with client.stream("POST", url + "/v1/completions", json={
                    "model": "SmolLM2-135M-Instruct", "prompt": "Name many rivers.", "max_tokens": 400,
                    "ignore_eos": True, "stream": True, "priority": -10}) as r:
                lines, others = r.aiter_lines(), None
                async for line in lines:
                    if line.startswith("data: {") and others is None:  # streaming: 399 tokens to go
                        others = asyncio.ensure_future(asyncio.gather(*(later(i) for i in range(3))))
            await others
    asyncio.run(main())
    assert held_commands(url) - before >= 3
    wait_kv_back(url, 2, within_s=60)
