"""A real `pdserve up` cluster as the Ray tests drive it: the process (ready once it prints its
curl line), its workers as the router's admin API lists them, each worker's own Stats, and
`pdserve scale` against it."""
from __future__ import annotations

import subprocess
import sys
import time

import grpc
import httpx

from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.security import stats_request
from tests.helpers import procs
from tests.helpers.procs import ENV

CHAOS_TOKEN = "chaos-token"  # the cluster token of tests/chaos/test_ray_faults.py, `engine_stats`' default


class Proc(procs.Proc):
    def wait_ready(self) -> float:
        t = time.monotonic()
        line = self.p.stdout.readline()  # the curl line, printed once the router can serve
        assert line.startswith("curl "), self.text()
        return time.monotonic() - t


def get_workers(url: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in httpx.get(url + "/admin/workers", timeout=5).json()["workers"]}


IDLE_LOOP_S = 0.02  # `slowness`' loop on an idle 2-core AMD EPYC (Zen 3)
MAX_SLOWNESS = 10.0


def slowness() -> float:
    """How many times slower than an idle machine this process runs now (1 to MAX_SLOWNESS):
    a short pure-Python loop timed against IDLE_LOOP_S, which a busy machine's shares of the
    cores stretch."""
    t, x = time.perf_counter(), 0
    for i in range(200_000):
        x += i * i
    return min(MAX_SLOWNESS, max(1.0, (time.perf_counter() - t) / IDLE_LOOP_S))


def wait_until(cond, timeout: float, what: str):
    """Wait for `cond()` to be true (returning its value). `timeout`: the bound on an idle
    machine; it stretches with `slowness`, measured as the wait goes (its worst), so a fault
    test proves the recovery, not the machine's speed."""
    start = last_look = time.monotonic()
    factor = slowness()
    while time.monotonic() - start < timeout * factor:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
        if time.monotonic() - last_look > 2.0:
            factor, last_look = max(factor, slowness()), time.monotonic()
    raise AssertionError(f"timed out after {time.monotonic() - start:.1f}s ({timeout}s on an idle machine, "
                         f"x{factor:.1f} for this one's load) waiting for {what}")


def engine_stats(url: str, role: str, token: str = CHAOS_TOKEN) -> dict[str, tuple[dict, object]]:
    """Each `role` worker's registry entry and its Stats, asked of the worker itself: a Stats
    call is answered between engine steps, so what it says is the engine as it is now (the
    router's view is a poll old, and a fast CPU prefills a whole prompt, or ends a short
    stream, between two of its polls). Its wait stretches with the machine's `slowness`."""
    stub = pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub
    out, timeout = {}, 10 * slowness()  # a step of a long prompt on a loaded machine takes a while
    for w in get_workers(url).values():
        if w["role"] == role:
            with grpc.insecure_channel(w["address"]) as ch:
                try:
                    out[w["worker_id"]] = (w, stub(ch).Stats(stats_request(token), timeout=timeout))
                except grpc.RpcError:  # restarting: not seen now
                    continue
    return out


def scale(url: str, **sizes) -> subprocess.CompletedProcess:
    args = [f"--{k}={v}" for k, v in sizes.items()]
    return subprocess.run([sys.executable, "-m", "pdserve", "scale", "--url", url, *args], capture_output=True,
                          text=True, timeout=300, env=ENV)
