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


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def engine_stats(url: str, role: str, token: str = CHAOS_TOKEN) -> dict[str, tuple[dict, object]]:
    """Each `role` worker's registry entry and its Stats, asked of the worker itself: a Stats
    call is answered between engine steps, so what it says is the engine as it is now (the
    router's view is a poll old, and a fast CPU prefills a whole prompt, or ends a short
    stream, between two of its polls)."""
    stub = pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub
    out = {}
    for w in get_workers(url).values():
        if w["role"] == role:
            with grpc.insecure_channel(w["address"]) as ch:
                out[w["worker_id"]] = (w, stub(ch).Stats(stats_request(token), timeout=10))
    return out


def scale(url: str, **sizes) -> subprocess.CompletedProcess:
    args = [f"--{k}={v}" for k, v in sizes.items()]
    return subprocess.run([sys.executable, "-m", "pdserve", "scale", "--url", url, *args], capture_output=True,
                          text=True, timeout=300, env=ENV)
