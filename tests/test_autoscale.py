"""`pdserve up --autoscale` on a real Ray cluster: a prefill pool that keeps refusing prompts
(queue limit 1, three clients) grows; once the load stops it shrinks back, draining the
removed worker. The decode pool, never loaded beyond its targets, is left alone."""
import itertools
import signal
import threading

import httpx
import pytest

from pdserve.registry.embedded import free_port
from tests.helpers.ray_procs import Proc, get_workers, wait_until
from tests.helpers.procs import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_prefill_pool_grows_under_refusals_and_shrinks_when_idle():
    port = free_port()
    up = Proc("up", "--port", str(port), "--kv-cache-memory", "64MiB", "--cluster-name", "autoscale",
              "--prefill-cpus", "0.5", "--decode-cpus", "0.5", "--threads", "1", "--prefill-max-queue", "1",
              "--autoscale", "--autoscale-max", "2", "--autoscale-interval", "1", "--autoscale-up-after", "2",
              "--autoscale-down-after", "6", "--autoscale-cooldown", "3", "--ttft-slo", "30", "--itl-slo", "5")
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    statuses: list[int] = []

    def client(i: int) -> None:
        # a new prompt each time: a repeated one would be held by the decode worker, which
        # prefills a short uncached tail itself (--decode-local-prefill) and spares the pool
        with httpx.Client(timeout=120) as http:
            for n in itertools.count():
                if stop.is_set():
                    break
                body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                        "prompt": f"{i}.{n}: " + "a long prompt keeps the prefill worker busy " * 40}
                statuses.append(http.post(url + "/v1/completions", json=body).status_code)
    procs: set[int] = set()
    try:
        up.wait_ready()
        procs = descendants(up.p.pid)
        clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in clients:
            t.start()
        try:
            wait_until(lambda: up.find("autoscaler: prefill 1 -> 2"), 60, "the prefill pool to grow")
            wait_until(lambda: get_workers(url).get("prefill-1", {}).get("healthy"), 60, "prefill-1 to serve")
            procs |= descendants(up.p.pid)
        finally:
            stop.set()
            for t in clients:
                t.join(120)
        assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses
        wait_until(lambda: up.find("autoscaler: prefill 2 -> 1"), 60, "the prefill pool to shrink when idle")
        wait_until(lambda: up.find("prefill worker prefill-1 removed after draining"), 60, "prefill-1 to drain")
        assert httpx.get(url + "/admin/pools").json()["pools"] == {"prefill": 1, "decode": 1}
        assert not up.find("autoscaler: decode")  # decode never left its targets
        print("".join(line for line in up.log if "autoscaler" in line or "added" in line or "removed" in line))
    finally:
        stop.set()
        procs |= descendants(up.p.pid)
        up.p.send_signal(signal.SIGINT)
        rc = up.p.wait(90)
    assert rc == 0, "".join(up.log)
    wait_until(lambda: not [p for p in procs if alive(p)], 30, "every process to exit")
