"""The operator's keys file through `pdserve up --keys-file` under Ray: a key is its tenant and
its priority ceiling whatever its client sends, and its own priority when the client sends none (read back from the router's own per-tenant,
per-band series), a key may be refused a priority or a model, only a trusted key reaches the
admin endpoints, and the file is reloaded on change and on SIGHUP, adding and revoking keys
while a stream runs, keeping the keys in force when the new file is bad. Rate limits per key
and per tenant (requests, concurrency, queued tokens) answer 429 while others are served, and
hold across two routers; usage on /metrics and at GET /admin/usage (kept in the cluster's
Redis, read the same by both routers) is what the responses reported."""
import re
import signal
import threading
import time

import httpx
import pytest

from pdserve.registry.embedded import free_port
from pdserve.router.keys import digest
from tests.helpers.procs import Proc, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MODEL = "SmolLM2-135M-Instruct"
A, B, C, D, E, F, G, H, I, J, K, OP = (f"sk-{n}-{n * 8}" for n in ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j",
                                                                     "k", "operator"))


def key(k: str, tenant: str, extra: str = "") -> str:
    return f'[[key]]\ndigest = "{digest(k)}"\ntenant = "{tenant}"\n{extra}\n'


FILE = (key(A, "team-a") + key(B, "team-b", "priority_ceiling = -10")
        + key(C, "team-c", 'over_ceiling = "refuse"') + key(D, "team-d", 'models = ["another-model"]')
        + key(F, "team-f", "requests_per_minute = 3") + key(G, "team-g", "max_concurrent = 1") + key(J, "team-g")
        + key(H, "team-h") + key(I, "team-h") + key(K, "team-k", "priority = 5") + "[tenants.team-h]\nrequests_per_minute = 3\n"
        + "[tenants.team-g]\nmax_queued_tokens = 4\n")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(FILE)
    port = free_port()
    up = Proc("up", "--port", str(port), "--cluster-token", "test-token", "--shutdown-grace", "3",
              "--keys-file", str(path), "--api-key", OP, "--cluster-name", "keys", "--redis-password", "keys-redis")
    try:
        line = up.ready_line("curl ")
        yield f"http://127.0.0.1:{port}", path, up
    finally:
        rc = stop(up, 90)
    assert rc == 0, up.text()


def complete(url: str, k: str | None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {k}"} if k else {}
    headers |= body.pop("headers", {})
    return httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                      json={"model": MODEL, "prompt": "Say hi", "max_tokens": 4, "temperature": 0} | body)


def stream_in_thread(url: str, k: str, tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed completion of `tokens` tokens under key `k`, on a thread; the dict's "started"
    event is set at its first token, its data lines land in "lines" once it ends."""
    done: dict = {"started": threading.Event()}

    def stream():
        with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {k}"}, timeout=120,
                          json={"model": MODEL, "prompt": "Count:", "max_tokens": tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            lines = []
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    lines.append(ln)
                    done["started"].set()
            done["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    return t, done


def waits(url: str, band: str, tenant: str) -> float:
    """The router's count of first tokens for `tenant` in priority band `band`."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for labels, value in re.findall(r"^pdserve_class_wait_seconds_count\{([^}]*)\} (\S+)$", text, re.M):
        if f'priority="{band}"' in labels and f'tenant="{tenant}"' in labels:
            total += float(value)
    return total


def test_a_key_is_its_tenant_and_its_ceiling_whatever_its_client_sends(served):
    url, _, _ = served
    assert complete(url, None).status_code == 401 and complete(url, "sk-nobody").status_code == 401
    posing = {"x-pdserve-tenant": "team-b", "x-pdserve-priority": "-50"}
    assert complete(url, A, priority=-100, headers=posing).status_code == 200
    assert complete(url, B, priority=-5).status_code == 200
    assert waits(url, "default", "team-a") == 1 and waits(url, "high", "team-a") == 0  # clamped to 0, its own tenant
    assert waits(url, "high", "team-b") == 1  # within B's ceiling: urgent
    assert complete(url, K).status_code == 200 and complete(url, K, priority=0).status_code == 200
    assert waits(url, "low", "team-k") == 1 and waits(url, "default", "team-k") == 1  # the key's 5 unless sent
    r = complete(url, C, priority=-1)
    assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed", r.text
    r = complete(url, D)
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed", r.text
    assert httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {A}"}, timeout=10).status_code == 403
    assert httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {OP}"}, timeout=10).status_code == 200
    wait_kv_back(url, 2)


def test_the_file_is_reloaded_on_change_and_sighup_while_a_stream_runs(served):
    url, path, up = served
    t, done = stream_in_thread(url, B, 300)
    path.write_text(key(B, "team-b", "priority_ceiling = -10") + key(E, "team-e"))  # A revoked, E issued
    deadline = time.monotonic() + 10
    while complete(url, E).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert complete(url, E).status_code == 200 and complete(url, A).status_code == 401
    path.write_text(key(B, "team-b") + key(E, "team-e", "colour = 1"))  # bad: the keys in force stay
    up.p.send_signal(signal.SIGHUP)
    time.sleep(1.5)
    assert up.p.poll() is None  # SIGHUP reloads, it does not end the server
    assert complete(url, E).status_code == 200
    assert up.find("keys file not reloaded") and "line 5 (key 2)" in up.find("keys file not reloaded")
    path.write_text(FILE)
    up.p.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while complete(url, A).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert complete(url, A).status_code == 200 and complete(url, E).status_code == 401
    t.join(120)
    assert done["lines"][-1] == "data: [DONE]" and len(done["lines"]) > 300  # B's stream ran through it all
    wait_kv_back(url, 2)


def test_a_bad_keys_file_stops_pdserve_up_before_anything_starts_naming_its_line(tmp_path):
    import subprocess
    import sys

    from tests.helpers.procs import ENV

    path = tmp_path / "keys.toml"
    path.write_text(key(A, "team-a") + f'[[key]]\ndigest = "{digest(B)}"\ntenant = "team-b"\nkey = "{B}"\n')
    r = subprocess.run([sys.executable, "-m", "pdserve", "up", "--port", str(free_port()), "--keys-file", str(path)],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "line 5 (key 2)" in r.stderr and "key in clear" in r.stderr, r.stderr
    assert B not in r.stderr  # the key itself is never echoed


def usage(url: str, tenant: str) -> dict[str, float]:
    """The router's usage series of one tenant, summed over keys and models."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {"prompt": 0.0, "cached": 0.0, "completion": 0.0, "requests": 0.0}
    for name, labels, value in re.findall(r"^pdserve_usage_(tokens|requests)_total\{([^}]*)\} (\S+)$", text, re.M):
        if f'tenant="{tenant}"' in labels:
            kind = re.search(r'kind="(\w+)"', labels).group(1) if name == "tokens" else "requests"
            out[kind] += float(value)
    return out


def admin_usage(url: str, tenant: str, since: float) -> dict[str, int]:
    """GET /admin/usage's totals of one tenant since `since` (the cluster's Redis)."""
    r = httpx.get(url + "/admin/usage", params={"since": str(since), "group_by": "tenant"},
                  headers={"Authorization": f"Bearer {OP}"}, timeout=10)
    assert r.status_code == 200, r.text
    got = next((d for d in r.json()["data"] if d["tenant"] == tenant), {})
    return {k: got.get(k + "_tokens" if k != "requests" else k, 0) for k in ("prompt", "cached", "completion",
                                                                              "requests")}


def settled(read, want, within_s: float = 5.0):
    """`read()` once it equals `want` (a request's usage is recorded once its response is sent)."""
    deadline = time.monotonic() + within_s
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_usage_per_tenant_is_what_the_responses_reported(served):
    url, _, _ = served
    since = time.time() - 3600
    before, other = usage(url, "team-a"), usage(url, "team-b")
    kept = admin_usage(url, "team-a", since)
    reported = {"prompt": 0, "cached": 0, "completion": 0, "requests": 0}
    shared = "You are a helpful assistant for the accounts team. " * 6
    for body in ({"prompt": shared + "Name a colour.", "max_tokens": 9, "n": 2},
                 {"prompt": shared + "Name a fruit.", "max_tokens": 7}):
        r = complete(url, A, **body)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        reported["prompt"] += u["prompt_tokens"]
        reported["completion"] += u["completion_tokens"]
        reported["cached"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        reported["requests"] += 1
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {A}"}, timeout=120,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
    u = r.json()["usage"]
    reported["prompt"] += u["prompt_tokens"]
    reported["completion"] += u["completion_tokens"]
    reported["cached"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reported["requests"] += 1
    after = usage(url, "team-a")
    assert {k: after[k] - before[k] for k in after} == reported
    assert reported["cached"] > 0  # the shared prefix was found again
    assert usage(url, "team-b") == other  # nothing charged to another tenant
    want = {k: kept[k] + n for k, n in reported.items()}
    assert settled(lambda: admin_usage(url, "team-a", since), want) == want  # kept in Redis: the same figures
    r = httpx.get(url + "/admin/usage", params={"since": "last week"}, headers={"Authorization": f"Bearer {OP}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_window", r.text
    assert httpx.get(url + "/admin/usage", headers={"Authorization": f"Bearer {A}"}).status_code == 403


def test_a_keys_rate_limits_answer_429_with_the_headers_while_others_are_served(served):
    url, _, _ = served
    if time.time() % 60 > 45:  # the three requests and the refused one in one minute's window
        time.sleep(61 - time.time() % 60)
    left = [complete(url, F).headers.get("x-ratelimit-remaining-requests") for _ in range(3)]
    assert left == ["2", "1", "0"]
    r = complete(url, F)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_requests", r.text
    assert r.headers["x-ratelimit-remaining-requests"] == "0" and 0 < int(r.headers["retry-after"]) <= 60
    assert complete(url, A).status_code == 200  # another key goes on
    t, done = stream_in_thread(url, G, 1000)  # seconds of tokens: it is still streaming when probed
    assert done["started"].wait(60)
    refused = complete(url, G)
    queued = complete(url, J, prompt="Say hi to everyone in the room, one by one.")  # G's tenant, its stream queued
    running = t.is_alive()
    t.join(120)
    assert running and refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_concurrent"
    assert queued.status_code == 429 and queued.json()["error"]["code"] == "rate_limit_queued_tokens", queued.text
    assert "tenant 'team-g'" in queued.json()["error"]["message"]
    assert done["lines"][-1] == "data: [DONE]"
    assert complete(url, G).status_code == 200  # the stream's end counted it out
    assert complete(url, J, prompt="Say hi to everyone in the room, one by one.").status_code == 200  # alone
    wait_kv_back(url, 2)


def test_two_routers_of_one_cluster_hold_one_limit(served):
    """A second router (`pdserve router` on the cluster's Redis, the same keys file) counts the
    same tenant's requests: 2 through one router and 1 through the other, by two keys, spend a
    3-a-minute tenant's minute, and the next is refused by either. Both routers read the same
    usage, which outlives the router that recorded part of it."""
    from tests.helpers.procs import registry_url
    from tests.helpers.ray_procs import Proc as ReadyProc

    url, path, up = served
    port = free_port()
    second = ReadyProc("router", "--port", str(port), "--redis-url", registry_url(up.text(), "keys-redis"),
                       "--cluster-name", "keys", "--cluster-token", "test-token", "--keys-file", str(path),
                       "--api-key", OP)
    try:
        second.wait_ready()
        other = f"http://127.0.0.1:{port}"
        if time.time() % 60 > 40:  # the four requests in one minute's window
            time.sleep(61 - time.time() % 60)
        since = time.time() - 60
        left = [complete(u, k).headers.get("x-ratelimit-remaining-requests") for u, k in ((url, H), (other, I),
                                                                                          (url, H))]
        assert left == ["2", "1", "0"]
        for u, k in ((other, H), (url, I)):
            r = complete(u, k)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_requests", r.text
            assert "tenant 'team-h'" in r.json()["error"]["message"]
        spent = settled(lambda: admin_usage(url, "team-h", since)["requests"], 3)
        assert spent == 3 and admin_usage(other, "team-h", since) == admin_usage(url, "team-h", since)
    finally:
        rc = stop(second, 60)
    assert rc == 0, second.text()
    assert admin_usage(url, "team-h", since)["requests"] == 3  # the stopped router's share is kept

