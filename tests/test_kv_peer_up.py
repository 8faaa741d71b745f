"""Peer prefix pulls through `pdserve up` under Ray: two aggregated workers behind a round-robin
router, so the same prompt alternates between them; the router names the worker that holds its
prefix (from its KV events) and the other pulls it. The answer equals the one computed, and
/admin/workers and /metrics show the pull (blocks pulled by one worker, served by the other);
every block is back in its pool after."""
import time

import httpx
import pytest

from pdserve.registry.embedded import free_port
from tests.helpers.procs import Proc, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PROMPT = "The committee met on a grey morning to review the harbour plans, item by item. " * 8


def pulls(url: str) -> list[dict]:
    return [w["peer_pulls"] for w in httpx.get(url + "/admin/workers", timeout=10).json()["workers"]
            if w.get("peer_pulls")]


def test_up_pulls_a_prefix_from_the_peer_that_holds_it():
    port = free_port()
    up = Proc("up", "--port", str(port), "--mode", "aggregated", "--decode", "2", "--routing", "round_robin",
              "--kv-peer-pull", "always", "--kv-cache-memory", "64MiB", "--cluster-token", "test-token",
              "--shutdown-grace", "3")
    url = f"http://127.0.0.1:{port}"
    try:
        line = up.ready_line("curl ")
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        answers = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # round robin: the next one goes to the other worker
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
            time.sleep(1.0)  # the first worker's KV events reach the router's prefix index
            if sum(p["blocks_pulled"] for p in pulls(url)) > 0 and len(answers) >= 2:
                break
        assert len(set(answers)) == 1, answers  # pulled or computed: the same tokens
        view = pulls(url)
        assert sum(p["blocks_pulled"] for p in view) >= 8, view
        assert sum(p["blocks_served"] for p in view) == sum(p["blocks_pulled"] for p in view), view
        assert sum(p["failures"] for p in view) == 0, view
        metrics = httpx.get(url + "/metrics", timeout=10).text
        pulled = [x for x in metrics.splitlines() if x.startswith("pdserve_kv_peer_blocks_total{")
                  and 'direction="pulled"' in x]
        assert len(pulled) == 2 and sum(float(x.split()[-1]) for x in pulled) >= 8, metrics
        assert [x for x in metrics.splitlines() if x.startswith("pdserve_kv_peer_pulls_total{")
                and 'outcome="done"' in x and float(x.split()[-1]) >= 1], metrics
        wait_kv_back(url, 2)  # every KV block back in its pool, in both workers
    finally:
        rc = stop(up)
    assert rc == 0, up.text()
