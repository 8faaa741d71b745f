"""Usage for charge-back (router/usage.py) and the tenant and queued-token limits
(router/keys.py, router/ratelimit.py): the stores' buckets and windows exactly, a tenant's limits
counted across its keys, and against a real Redis that is started and killed: usage that outlives
the router that wrote it, a Redis outage that fails one key closed (503) and serves another, and
requests at once and queued tokens that no lost count-out holds for good (retried, or leased)."""
from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from pdserve.registry.embedded import EmbeddedRedis
from pdserve.registry.urls import connect
from pdserve.router.errors import APIError
from pdserve.router.keys import KeysFileError, Limits, digest, parse
from pdserve.router.ratelimit import LEASE_S, MemoryCounts, RateLimiter, RedisCounts
from pdserve.router.usage import BUCKET_S, MemoryUsage, Meter, RedisUsage, UsageWindowError, parse_time, report, window
from tests.helpers.procs import restart_redis
from tests.test_keys import entry

A, A2, B = "sk-a-one-0123456789", "sk-a-two-0123456789", "sk-b-0123456789"
T0 = 1_764_871_200.0  # 2025-12-04T18:00:00Z, a minute's start


def meter(*rows: tuple) -> Meter:
    m = Meter()
    for row in rows:
        m.add(*row)
    return m


def test_a_meter_sums_its_generations_and_names_the_default_tenant_and_no_key():
    m = meter(("team-a", "batch", "m", 10, 4, 5, 1), ("team-a", "batch", "m", 0, 0, 7, 0), ("", "", "m", 3, 0, 1, 1))
    assert m.rows == {("team-a", "batch", "m"): [10, 4, 12, 1], ("default", "-", "m"): [3, 0, 1, 1]}
    assert m.tokens == 10 + 12 + 3 + 1  # prompt and completion: the key's tokens-per-minute count


def test_the_memory_store_reads_whole_minutes_of_a_window_grouped_as_asked():
    store = MemoryUsage()

    async def run():
        await store.record(meter(("a", "k1", "m", 10, 2, 5, 1)), T0 + 5)
        await store.record(meter(("a", "k2", "lora", 20, 0, 1, 1), ("b", "k3", "m", 7, 7, 3, 1)), T0 + 65)
        await store.record(meter(("a", "k1", "m", 1000, 0, 0, 1)), T0 + 185)  # minute 3: outside below
        by_tenant = await report(store, str(T0), str(T0 + 119), "tenant", now=T0 + 200)
        assert (by_tenant["since"], by_tenant["until"]) == (T0, T0 + 2 * BUCKET_S)
        assert by_tenant["data"] == [
            {"tenant": "a", "prompt_tokens": 30, "cached_tokens": 2, "completion_tokens": 6, "requests": 2,
             "total_tokens": 36},
            {"tenant": "b", "prompt_tokens": 7, "cached_tokens": 7, "completion_tokens": 3, "requests": 1,
             "total_tokens": 10}]
        assert by_tenant["total"]["total_tokens"] == 46 and by_tenant["total"]["requests"] == 3
        by_model = await report(store, "2025-12-04T18:00:30Z", "2025-12-04T18:01:30", "tenant,model", now=T0 + 200)
        assert [(d["tenant"], d["model"], d["prompt_tokens"]) for d in by_model["data"]] == [
            ("a", "lora", 20), ("a", "m", 10), ("b", "m", 7)]
        one = await report(store, str(T0 + 60), str(T0 + 60), "key", now=T0 + 200)
        assert [d["key"] for d in one["data"]] == ["k2", "k3"]
        assert (await report(store, None, None, "tenant", now=T0 + 200))["total"]["prompt_tokens"] == 1037
    asyncio.run(run())


def test_the_memory_store_forgets_buckets_past_its_retention():
    store = MemoryUsage(retention_s=600)

    async def run():
        await store.record(meter(("a", "k", "m", 1, 0, 0, 1)), T0)
        await store.record(meter(("a", "k", "m", 2, 0, 0, 1)), T0 + 900)
        assert (await store.read(int(T0 // 60), int((T0 + 900) // 60)))[("a", "k", "m")] == [2, 0, 0, 1]
    asyncio.run(run())


@pytest.mark.parametrize("since,until,by,match", [
    ("yesterday", None, "tenant", "since must be unix seconds or an ISO 8601 time"),
    (str(T0 + 10), str(T0), "tenant", "is after until"),
    (str(T0 - 30 * 86400), str(T0), "tenant", "longer than the 8 days"),
    ("-5", None, "tenant", "after 1970"),
    ("nan", None, "tenant", "after 1970"),
    (None, None, "team", "group_by must be one or more of tenant, key, model"),
    (None, None, "tenant,tenant", "group_by"),
])
def test_a_bad_window_or_grouping_is_refused_by_name(since, until, by, match):
    with pytest.raises(UsageWindowError, match=match):
        asyncio.run(report(MemoryUsage(), since, until, by, now=T0))


def test_a_window_is_the_whole_minutes_that_cover_it():
    m = int(T0 // 60)
    assert window(str(T0 + 59), str(T0 + 60), T0) == (m, m)  # until is not in it
    assert window(str(T0 + 59), str(T0 + 61), T0) == (m, m + 1)
    assert window(str(T0 + 5), str(T0 + 5), T0) == (m, m)  # at least since's minute
    assert window(None, None, T0) == (m - 1440, m - 1)
    assert parse_time("2025-12-04T18:00:00+01:00", "since") == T0 - 3600


TENANT_A = "[tenants.team-a]\nrequests_per_minute = 3\nmax_queued_tokens = 100\n"


def test_a_tenant_table_gives_its_keys_its_limits():
    keys = parse(entry(A, "team-a", requests_per_minute=10) + entry(A2, "team-a") + entry(B, "team-b") + TENANT_A)
    a, a2, b = keys[digest(A)], keys[digest(A2)], keys[digest(B)]
    assert a.tenant_limits == a2.tenant_limits == Limits(requests_per_minute=3, max_queued_tokens=100)
    assert a.limits == Limits(requests_per_minute=10) and a2.limited and not b.limited


@pytest.mark.parametrize("tail,line,match", [
    ("[tenants.team-a]\ncolour = 1\n", 9, "tenant 'team-a'.*unknown field 'colour'"),
    ("[tenants.team-a]\ntokens_per_minute = -1\n", 9, "tokens_per_minute must be an integer >= 0"),
    ("[tenants.team-a]\nmax_queued_tokens = 1\n[tenants.nobody]\nmax_concurrent = 1\n", 11, "no key stands for"),
    ("[tenants.team-a]\ntenant = \"x\"\n", 9, "unknown field 'tenant'"),
])
def test_a_bad_tenant_table_is_refused_with_its_line(tail, line, match):
    with pytest.raises(KeysFileError, match=rf"keys\.toml line {line} .*{match}"):
        parse(entry(A, "team-a") + entry(B, "team-b") + tail, "keys.toml")


def test_a_negative_queued_tokens_limit_is_refused_with_its_line():
    with pytest.raises(KeysFileError, match=r"line 1 .*max_queued_tokens must be an integer >= 0"):
        parse(entry(A, "a", max_queued_tokens=-1), "keys.toml")


def test_a_tenants_limits_count_across_its_keys_and_queued_tokens_until_requests_end():
    now = [600.0]
    lim = RateLimiter(MemoryCounts(clock=lambda: now[0]), clock=lambda: now[0])
    keys = parse(entry(A, "team-a", max_queued_tokens=80) + entry(A2, "team-a") + entry(B, "team-b") + TENANT_A)
    a, a2, b = keys[digest(A)], keys[digest(A2)], keys[digest(B)]

    async def run():
        t1 = await lim.enter("a", a)
        assert t1.headers["x-ratelimit-remaining-requests"] == "2"  # the tenant's figure: the key has none
        await lim.admit(t1, 70)
        t2 = await lim.enter("a2", a2)
        with pytest.raises(APIError) as e:
            await lim.admit(t2, 40)  # 110 of the tenant's 100 queued
        assert e.value.status == 429 and e.value.code == "rate_limit_queued_tokens"
        assert "tenant 'team-a'" in e.value.message
        await lim.admit(t2, 30)  # 100: at the limit, let in
        t3 = await lim.enter("a2", a2)
        with pytest.raises(APIError) as e:
            await lim.enter("a", a)  # the tenant's fourth request this minute, by either key
        assert e.value.code == "rate_limit_requests" and "tenant 'team-a'" in e.value.message
        await lim.leave(t1, 0)  # its 70 queued tokens go
        await lim.admit(t3, 60)
        assert await lim.in_flight("rl:tenant:team-a") == (0, 90)
        t4 = await lim.enter("b", b)  # another tenant: unlimited, untouched
        assert not t4.counted and t4.headers == {}
        for t in (t2, t3):
            await lim.leave(t, 0)
        assert await lim.in_flight("rl:tenant:team-a") == (0, 0) and await lim.in_flight("rl:a") == (0, 0)
        now[0] = 700.0  # the next minute: the tenant's requests count again
        lone = await lim.enter("a2", a2)
        await lim.admit(lone, 500)  # alone and longer than the limit: it could never pass, let in
        await lim.leave(lone, 0)
    asyncio.run(run())


@pytest.fixture()
def redis_server():
    r = EmbeddedRedis().start()
    try:
        yield r
    finally:
        r.stop()


def test_usage_in_redis_outlives_the_router_that_wrote_it_and_sums_routers(redis_server):
    async def run():
        first, second = (RedisUsage(connect(redis_server.url), "pdserve:u") for _ in range(2))
        await first.record(meter(("a", "k", "m", 10, 3, 4, 1)), T0 + 1)
        await second.record(meter(("a", "k", "m", 5, 0, 6, 1), ("b", "k2", "m", 1, 0, 1, 1)), T0 + 2)
        await first.redis.aclose()
        await second.redis.aclose()
        restarted = RedisUsage(connect(redis_server.url), "pdserve:u")
        got = await report(restarted, str(T0), str(T0 + 59), "tenant", now=T0 + 60)
        assert got["data"][0] == {"tenant": "a", "prompt_tokens": 15, "cached_tokens": 3, "completion_tokens": 10,
                                  "requests": 2, "total_tokens": 25}
        assert 8 * 86400 < await restarted.redis.ttl(f"pdserve:u:usage:{int(T0 // 60)}") <= 8 * 86400 + 60
        await restarted.redis.aclose()
    asyncio.run(run())


def test_a_redis_outage_fails_a_closed_key_with_503_and_serves_an_open_one(redis_server, tokenizer, tmp_path):
    """The router's app (router/app.py) on a Redis that is killed, then started again on its port:
    meanwhile the key with on_redis_error = "closed" is refused 503, the open one served
    uncounted, and the usage endpoint answers 503; afterwards both are counted again."""
    from fastapi.testclient import TestClient

    from pdserve.config import RouterConfig, SecurityConfig
    from pdserve.router.app import create_app
    from pdserve.router.cluster import ClusterClient
    from pdserve.router.discovery import RegistryDiscovery
    from pdserve.router.router import Router

    path = tmp_path / "keys.toml"
    path.write_text(entry(A, "team-a", requests_per_minute=100, on_redis_error="closed", trusted=True)
                    + entry(B, "team-b", requests_per_minute=100))
    cluster = ClusterClient()
    router = Router(cluster, tokenizer, RouterConfig(model_name="m"), SecurityConfig(keys_file=str(path)),
                    discovery=RegistryDiscovery(redis_server.url, "outage", cluster))

    def tokenize(key: str):
        return http.post("/tokenize", headers={"Authorization": f"Bearer {key}"}, json={"model": "m", "prompt": "hi"})

    def usage():
        return http.get("/admin/usage", headers={"Authorization": f"Bearer {A}"})
    with TestClient(create_app(router)) as http:
        assert tokenize(A).headers["x-ratelimit-remaining-requests"] == "99" and usage().status_code == 200
        redis_server.stop()
        r = tokenize(A)
        assert r.status_code == 503 and r.json()["error"]["code"] == "rate_limit_unavailable", r.text
        r = tokenize(B)
        assert r.status_code == 200 and "x-ratelimit-remaining-requests" not in r.headers, r.text  # uncounted
        assert usage().status_code == 503 and usage().json()["error"]["code"] == "usage_unavailable"
        back = restart_redis(redis_server.host, redis_server.port)
        try:
            assert tokenize(A).headers["x-ratelimit-remaining-requests"] == "99"  # a new Redis: counts anew
            assert tokenize(B).headers["x-ratelimit-remaining-requests"] == "99"
        finally:
            back.stop()


class Flaky:
    """A store (RedisCounts) whose calls fail as an unreachable Redis's do while
    `down(method, name)` says so."""

    def __init__(self, counts):
        self.counts, self.down = counts, lambda method, name: False

    def __getattr__(self, method):
        call = getattr(self.counts, method)

        async def flaky(name, *args):
            if self.down(method, name):
                raise RedisConnectionError(f"{method} {name}: Redis unreachable")
            return await call(name, *args)
        return flaky


def limiters(redis_url: str, now: list[float], n: int = 2, lease_s: float = 30) -> list[RateLimiter]:
    """`n` routers' limiters on one Redis, on the clock `now`, each store Flaky."""
    return [RateLimiter(Flaky(RedisCounts(connect(redis_url), "pdserve:c")), clock=lambda: now[0], lease_s=lease_s)
            for _ in range(n)]


async def close(*lims: RateLimiter) -> None:
    for lim in lims:
        await lim.counts.counts.redis.aclose()


@pytest.mark.redis
@pytest.mark.parametrize("policy", ["closed", "open"])
def test_a_redis_error_after_a_scope_was_counted_leaves_no_count_once_redis_is_back(redis_server, policy):
    """The key's scope counted, then Redis fails on the tenant's (and for the undo): the
    request is refused 503 or served uncounted, and its place among the key's requests at
    once is released on the router's next request once Redis is back (the key's limit is 1)."""
    now = [T0]
    lim, other = limiters(redis_server.url, now)
    a = parse(entry(A, "team-a", max_concurrent=1, on_redis_error=policy) + "[tenants.team-a]\nmax_concurrent = 5\n"
              )[digest(A)]

    async def run():
        lim.counts.down = lambda method, name: method == "release" or name.startswith("rl:tenant:")
        if policy == "closed":
            with pytest.raises(APIError) as e:
                await lim.enter("a", a)
            assert e.value.status == 503 and e.value.code == "rate_limit_unavailable"
        else:
            assert not (await lim.enter("a", a)).counted
        assert await other.in_flight("rl:a") == (1, 0)  # left behind while Redis fails
        lim.counts.down = lambda method, name: False  # back
        t = await lim.enter("a", a)  # the lost release first: the key's one place is free
        assert t.counted and await other.in_flight("rl:a") == (1, 0)
        await lim.leave(t, 0)
        assert await other.in_flight("rl:a") == (0, 0) and await other.in_flight("rl:tenant:team-a") == (0, 0)
        await close(lim, other)
    asyncio.run(run())


@pytest.mark.redis
def test_a_leave_lost_to_an_outage_frees_its_places_when_retried_or_when_its_lease_ends(redis_server):
    """A leave Redis does not take: the router that lost it releases it on its next request
    once Redis answers; a router that died with it frees the key's place and queued tokens when
    the lease ends (30 s here), however busy the key is meanwhile."""
    now = [T0]
    dead, live = limiters(redis_server.url, now)
    a = parse(entry(A, "team-a", max_concurrent=1, max_queued_tokens=100))[digest(A)]

    async def run():
        for survivor in (True, False):
            t = await dead.enter("a", a)
            await dead.admit(t, 80)
            dead.counts.down = lambda method, name: True  # Redis unreachable for its leave
            await dead.leave(t, 10)
            dead.counts.down = lambda method, name: False
            assert await live.in_flight("rl:a") == (1, 80)
            if survivor:
                await dead.leave(await dead.enter("a", a), 0)  # retried before counting this one in
            else:  # the dead router never retries: the lease ends it, not the traffic
                for _ in range(5):
                    now[0] += 5.8
                    with pytest.raises(APIError) as e:
                        await live.enter("a", a)
                    assert e.value.code == "rate_limit_concurrent"
                now[0] += 1.5  # 30.5 s after its lease began
            t = await live.enter("a", a)
            await live.admit(t, 80)  # with 80 still queued this would pass the 100
            assert await live.in_flight("rl:a") == (1, 80)
            await live.leave(t, 0)
            assert await live.in_flight("rl:a") == (0, 0)
        await close(dead, live)
    asyncio.run(run())


@pytest.mark.redis
def test_requests_at_once_and_queued_tokens_hold_across_routers_sharing_one_redis(redis_server):
    now = [T0]
    r1, r2 = limiters(redis_server.url, now, lease_s=LEASE_S)
    keys = parse(entry(A, "team-a", max_concurrent=2) + entry(A2, "team-a")
                 + "[tenants.team-a]\nmax_concurrent = 3\nmax_queued_tokens = 100\n")
    a, a2 = keys[digest(A)], keys[digest(A2)]

    async def run():
        held = [await r1.enter("a", a), await r2.enter("a", a)]
        for lim in (r1, r2):
            with pytest.raises(APIError) as e:
                await lim.enter("a", a)
            assert e.value.code == "rate_limit_concurrent" and "the key" in e.value.message
        held.append(await r2.enter("a2", a2))
        with pytest.raises(APIError) as e:
            await r1.enter("a2", a2)
        assert e.value.code == "rate_limit_concurrent" and "tenant 'team-a'" in e.value.message
        await r1.admit(held[0], 60)
        with pytest.raises(APIError) as e:
            await r2.admit(held[2], 50)
        assert e.value.code == "rate_limit_queued_tokens"
        assert await r1.in_flight("rl:tenant:team-a") == (3, 60) and await r2.in_flight("rl:a") == (2, 0)
        assert 0 < await r1.counts.counts.redis.ttl("pdserve:c:rl:tenant:team-a:running") <= LEASE_S
        await r1.leave(held.pop(0), 0)
        held.append(await r2.enter("a", a))  # the place r1 freed
        for t in held:
            await r2.leave(t, 0)  # counted out by either router
        assert await r1.in_flight("rl:tenant:team-a") == (0, 0) and await r2.in_flight("rl:a") == (0, 0)
        await close(r1, r2)
    asyncio.run(run())


@pytest.mark.redis
def test_a_long_request_keeps_its_place_past_its_lease_while_its_router_counts_others_in(redis_server):
    """Its router renews its leases (every quarter lease) as it counts other requests in: two
    leases on, the key's one place is still taken, and its queued tokens still count."""
    now = [T0]
    r1, r2 = limiters(redis_server.url, now)
    keys = parse(entry(A, "team-a", max_concurrent=1, max_queued_tokens=100) + entry(B, "team-b", max_concurrent=9))
    a, b = keys[digest(A)], keys[digest(B)]

    async def run():
        long = await r1.enter("a", a)
        await r1.admit(long, 80)
        for _ in range(8):  # 80 s: the lease is 30 s
            now[0] += 10
            await r1.leave(await r1.enter("b", b), 0)
            with pytest.raises(APIError) as e:
                await r2.enter("a", a)
            assert e.value.code == "rate_limit_concurrent"
        assert await r2.in_flight("rl:a") == (1, 80)
        await r1.leave(long, 0)
        await r2.leave(await r2.enter("a", a), 0)
        await close(r1, r2)
    asyncio.run(run())
