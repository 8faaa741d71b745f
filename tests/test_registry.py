"""Redis registry and KV events with a real embedded redis-server: heartbeats and expiry,
events into the router's prefix index, prefix-aware routing with two prefill workers, and
surviving a Redis restart, a Redis that never answers and a worker whose engine died.
Passwords, TLS URLs and secrets kept out of logs: tests/test_registry_secrets.py."""
import asyncio
import os
import time

import httpx
import pytest
import redis

from pdserve.config import RegistryConfig, TransferConfig
from pdserve.deploy.local import LocalCluster
from pdserve.common.block_hash import hash_blocks
from pdserve.engine.core.block_manager import BlockManager
from pdserve.registry.embedded import EmbeddedRedis
from pdserve.registry.events import EventFollower, EventPublisher
from pdserve.registry.membership import WorkerRecord, WorkerRegistration, list_workers, worker_key
from pdserve.registry.urls import connect
from pdserve.router.prefix_index import PrefixIndex
from tests.helpers.clusters import local_config
from tests.helpers.procs import restart_redis


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


def test_embedded_redis_goes_when_its_starter_is_killed():
    """SIGKILL of the process that started it (no stop() runs): redis-server follows."""
    import signal
    import subprocess
    import sys

    code = ("from pdserve.registry.embedded import EmbeddedRedis; import time; r = EmbeddedRedis().start(); "
            "print(r.pid, flush=True); time.sleep(600)")
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pid = int(starter.stdout.readline())
    os.kill(pid, 0)  # running
    starter.send_signal(signal.SIGKILL)
    starter.wait(10)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # gone, as it should be
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # ours: do not leave it behind
    pytest.fail(f"redis-server {pid} outlived the process that started it")


def test_embedded_redis_runs_no_python_in_a_forked_copy_of_its_starter():
    """Starting redis-server runs none of the starter's at-fork handlers in the child (a
    `preexec_fn` would: OpenTelemetry's, registered once tracing is set up, hung there at 100%
    CPU in the suite). A handler that ends any forked copy at once must not stop it."""
    import subprocess
    import sys

    code = ("import os; os.register_at_fork(after_in_child=lambda: os._exit(3)); "
            "from pdserve.registry.embedded import EmbeddedRedis; import redis; r = EmbeddedRedis().start(); "
            "print(redis.Redis.from_url(r.url).ping(), flush=True); r.stop()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


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


def test_malformed_registry_entries_and_events_are_skipped_and_counted(redis_server):
    """Redis is input: whatever is written under the cluster's keys, the router's sync goes
    on with the well-formed workers and events and counts the rest."""
    import json

    import redis.asyncio as aioredis

    from pdserve.router.cluster import ClusterClient
    from pdserve.router.discovery import RegistryDiscovery

    good = WorkerRecord("d0", "decode", "127.0.0.1:1", incarnation="a")
    bad = {"not-json": b"{", "a-list": b"[1, 2]", "no-address": json.dumps({"worker_id": "x", "role": "decode"}),
           "a-number": json.dumps({"worker_id": "x", "role": "decode", "address": 5}),
           "unknown-role": json.dumps({"worker_id": "x", "role": "boss", "address": "h:1"}),
           "extra-field": json.dumps({"worker_id": "x", "role": "decode", "address": "h:1", "admin": "yes"}),
           "huge": json.dumps({"worker_id": "x" * 5000, "role": "decode", "address": "h:1"})}

    async def main():
        db = aioredis.from_url(redis_server.url)
        await db.set(worker_key("mal", "d0"), json.dumps(good.__dict__))
        for name, raw in bad.items():
            await db.set(worker_key("mal", name), raw)
        stream = "pdserve:mal:events:d0"
        await db.delete(stream)
        for fields in ({"seq": 1, "type": "stored", "hash": 7, "parent": 0}, {"seq": "x", "type": "stored"},
                       {"type": "removed"}, {"seq": 2, "type": "stored", "hash": 2**70}, {"seq": 3, "type": "boom"},
                       {"seq": 4, "type": "stored"}, {"seq": 5, "type": "removed", "hash": 7}):
            await db.xadd(stream, fields)
        disc = RegistryDiscovery(redis_server.url, "mal", ClusterClient())
        try:
            await disc.sync()
            return list(disc.client.workers), disc.malformed_records, disc.follower.malformed, disc.client.index
        finally:
            await disc.close()
            await db.aclose()

    workers, records, events, index = asyncio.run(main())
    assert workers == ["d0"] and records == len(bad)
    assert events == 5  # the stored and removed events of block 7 applied, in order: nothing held
    assert index.match([7]) == {}


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
    # peer pulls off: they would give round robin's second worker the system prompt's blocks
    # too (tests/test_kv_peer.py); here the router's choice alone is measured
    cfg = local_config(32 << 20, prefill=2, router={"routing": policy},
                       registry=RegistryConfig(redis_url=redis_url, cluster_name=f"c-{policy}"),
                       transfer=TransferConfig(peer_pull="off"))
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
    cfg = local_config(32 << 20, registry=RegistryConfig(redis_url=r.url, cluster_name="restart"))
    c = LocalCluster(loaded, tok, cfg).start()
    # prompts of more than one block, so that each request emits KV events
    body = {"model": MODEL, "prompt": "The weather today is sunny with a light breeze from the west, and "
                                      "the forecast for the rest of the week says", "max_tokens": 4, "temperature": 0}
    try:
        r.stop()
        # Redis is down: routing continues on the last known workers
        assert httpx.post(c.url + "/v1/completions", json=body, timeout=60).status_code == 200
        r = restart_redis("127.0.0.1", port)  # on its old port, as an operator would
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


def test_a_registry_that_never_answers_times_out_instead_of_hanging():
    """A partitioned Redis drops packets: the connection opens (here: a listener that never
    replies) and no answer comes. Heartbeats and shutdown must give up, not wait forever."""
    import socket

    with socket.socket() as black_hole:
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(8)
        url = f"redis://127.0.0.1:{black_hole.getsockname()[1]}/0"

        async def main():
            client = connect(url, timeout_s=0.3)
            t = time.monotonic()
            with pytest.raises(redis.exceptions.RedisError):
                await client.set("k", "v")
            await client.aclose()
            reg = WorkerRegistration(url + "?socket_timeout=0.3", "partition", WorkerRecord("w", "decode", "x:1"))
            assert await reg.beat() is False  # logged, and the heartbeat loop goes on
            await reg.stop()
            return time.monotonic() - t

        took = asyncio.run(asyncio.wait_for(main(), 30))
    assert took < 20, took  # redis-py's own retries (with backoff) included; without a timeout: forever


@pytest.mark.redis
def test_embedded_redis_says_why_it_could_not_start():
    import socket

    from pdserve.registry.embedded import EmbeddedRedis
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = EmbeddedRedis("127.0.0.1", taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="(?i)address already in use"):
            r.start()
        assert r.proc is None and r._dir is None  # nothing left behind


@pytest.mark.slow
def test_a_worker_whose_engine_died_leaves_the_registry(smollm, redis_server):
    """The engine thread of the decode worker dies (a bug in a step): the worker leaves the
    registry within a second, instead of heartbeating while every request it gets fails."""
    loaded, tok = smollm
    cfg = local_config(32 << 20, registry=RegistryConfig(redis_url=redis_server.url, cluster_name="c-dead"))
    c = LocalCluster(loaded, tok, cfg).start()
    try:
        async def members():
            return sorted(r.worker_id for r in await list_workers(connect(redis_server.url), "c-dead"))

        assert asyncio.run(members()) == ["decode-0", "prefill-0"]
        decode = c.worker("decode-0")

        def broken_step():
            raise AssertionError("a bug in the step")

        decode.engine.step = broken_step
        r = httpx.post(c.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code >= 500
        deadline = time.time() + 5
        while asyncio.run(members()) != ["prefill-0"] and time.time() < deadline:
            time.sleep(0.1)
        assert asyncio.run(members()) == ["prefill-0"]
        assert decode.registration is None
    finally:
        c.stop()


def test_redis_replies_are_parsed_in_c():
    """The router applies every worker's KV events from Redis on its event loop: redis-py must
    parse the replies with hiredis (a dependency), whose pure-Python fallback held every stream
    there 20-30 ms at a time beside a 48-stream flood."""
    import redis.asyncio.connection
    import redis.utils

    assert redis.utils.HIREDIS_AVAILABLE
    assert "Hiredis" in redis.asyncio.connection.DefaultParser.__name__  # the router's client is asyncio's
