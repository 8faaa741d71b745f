"""Redis registry and KV events with a real embedded redis-server: heartbeats and expiry,
events into the router's prefix index, prefix-aware routing with two prefill workers, and
surviving a Redis restart."""
import asyncio
import os
import time

import httpx
import pytest
import redis

from deploy.local import LocalCluster, LocalClusterConfig
from deploy.redis_server import EmbeddedRedis
from deploy.registry import EventFollower, EventPublisher, WorkerRecord, WorkerRegistration, list_workers, worker_key
from engine.block_hash import hash_blocks
from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig
from router.prefix_index import PrefixIndex


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as r:
        yield r


def test_embedded_redis_starts_and_stops_by_pid():
    r = EmbeddedRedis().start()
    pid = r.pid
    assert redis.Redis.from_url(r.url).ping()
    r.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_heartbeat_registers_and_a_silent_worker_expires(redis_server):
    async def main():
        import redis.asyncio as aioredis
        rec = WorkerRecord("w1", "decode", "127.0.0.1:1", incarnation="a")
        reg = WorkerRegistration(redis_server.url, "t1", rec, ttl_s=0.5, interval_s=0.1)
        reg.start()
        client = aioredis.from_url(redis_server.url)

        async def wait_for(expected):
            for _ in range(100):  # polled, not slept: the machine may be busy
                if await list_workers(client, "t1") == expected:
                    return expected
                await asyncio.sleep(0.05)
            return await list_workers(client, "t1")

        assert await wait_for([rec]) == [rec]
        reg._task.cancel()  # the worker dies without saying goodbye
        gone = await wait_for([])
        await reg.redis.aclose()
        await client.aclose()
        return gone

    assert asyncio.run(main()) == []


def test_events_flow_into_the_prefix_index(redis_server):
    async def main():
        import redis.asyncio as aioredis
        pub = EventPublisher(redis_server.url, "t2", "p0")
        await pub.reset_stream()
        bm = BlockManager(8, 4, listener=pub)
        prompt = list(range(20))
        bm.allocate("a", 20)
        bm.cache_full_blocks("a", prompt, 20)
        await pub.flush()
        client = aioredis.from_url(redis_server.url)
        index = PrefixIndex()
        follower = EventFollower(client, "t2", index)
        assert await follower.poll(["p0"]) == 5
        held = index.match(hash_blocks(prompt + [1], 4))
        bm.free("a")
        bm.allocate("b", 32)  # evicts everything
        await pub.flush()
        await follower.poll(["p0"])
        after = index.match(hash_blocks(prompt + [1], 4))
        bm.free("b")
        await pub.stop()
        await client.aclose()
        return held, after

    held, after = asyncio.run(main())
    assert held == {"p0": 5} and after == {}


MODEL = "smollm2"
SYSTEM = ("You are a meticulous assistant for a travel agency. Always answer in one short sentence, mention the "
          "city by name, and never invent prices. The agency serves Paris, Rome, Madrid, Lisbon and Vienna.")


def run_cluster(smollm, redis_url, policy, questions):
    loaded, tok = smollm
    cfg = LocalClusterConfig(num_prefill=2, policy=policy, redis_url=redis_url, cluster=f"c-{policy}",
                             model_name=MODEL, engine=EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20)))
    c = LocalCluster(loaded, tok, cfg).start()
    try:
        for q in questions:
            r = httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
            assert r.status_code == 200, r.text
            time.sleep(0.3)  # let KV events reach the router's index
        c.run(c.router.cluster.refresh())
        return {w: (s.prefix_hits, s.remote_prefills) for w, s in c.router.cluster.stats.items() if w.startswith("prefill")}
    finally:
        c.stop()
        for eng in c.engines():
            assert eng.blocks.num_used_blocks == 0


@pytest.mark.slow
def test_prefix_aware_routing_sends_repeats_to_the_holder(smollm, redis_server):
    questions = [f"What is a good museum in {city}?" for city in ("Paris", "Rome", "Madrid", "Lisbon", "Vienna", "Oslo")]
    aware = run_cluster(smollm, redis_server.url, "prefix_aware", questions)
    rr = run_cluster(smollm, redis_server.url, "round_robin", questions)
    # prefix-aware: every request after the first goes to the worker that holds the system prompt
    assert sorted(n for _, n in aware.values()) == [0, 6]
    assert sorted(n for _, n in rr.values()) == [3, 3]
    assert sum(h for h, _ in aware.values()) > sum(h for h, _ in rr.values())


@pytest.mark.slow
def test_router_survives_a_redis_restart(smollm):
    loaded, tok = smollm
    r = EmbeddedRedis().start()
    port = r.port
    cfg = LocalClusterConfig(redis_url=r.url, cluster="restart", model_name=MODEL,
                             engine=EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20)))
    c = LocalCluster(loaded, tok, cfg).start()
    # prompts of more than one block, so that each request emits KV events
    body = {"model": MODEL, "prompt": "The weather today is sunny with a light breeze from the west, and "
                                      "the forecast for the rest of the week says", "max_tokens": 4, "temperature": 0}
    try:
        r.stop()
        # Redis is down: routing continues on the last known workers
        assert httpx.post(c.url + "/v1/completions", json=body, timeout=60).status_code == 200
        r = EmbeddedRedis(port=port).start()
        deadline = time.time() + 15
        while time.time() < deadline:
            keys = redis.Redis.from_url(r.url).keys(worker_key("restart", "*"))
            if len(keys) == 2:
                break
            time.sleep(0.2)
        assert len(keys) == 2, "workers did not re-register"
        resp = httpx.post(c.url + "/v1/completions", json=body | {"prompt": "After the restart, a completely different prompt arrives at the router and "
                                                    "it is long enough to fill a whole KV block"}, timeout=60)
        assert resp.status_code == 200, resp.text
        deadline = time.time() + 5  # events lost during the outage: a gap, then a resync
        while time.time() < deadline and not (c.router.discovery.resyncs and not c.router.cluster.index.needs_resync):
            time.sleep(0.1)
        assert c.router.discovery.resyncs >= 1 and not c.router.cluster.index.needs_resync
        assert httpx.get(c.url + "/health").status_code == 200
    finally:
        c.stop()
        r.stop()
