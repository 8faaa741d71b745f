"""`pdserve worker` as an SRE stops it: Ctrl-C drains and exits 0, leaving the registry, even
when Redis hangs meanwhile; and whatever a stopping process waits on, it exits in bounded
time and says where it was stuck."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from pdserve.registry.embedded import EmbeddedRedis
from pdserve.registry.membership import worker_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONWARNINGS="ignore")


def test_shutdown_watchdog_dumps_stacks_and_exits():
    code = ("from pdserve.deploy.worker_cmd import shutdown_watchdog; import time\n"
            "def stuck_in_shutdown():\n    time.sleep(120)\n"
            "shutdown_watchdog(0.5); stuck_in_shutdown()")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=ENV)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert time.monotonic() - t < 30
    assert "stuck_in_shutdown" in r.stderr  # where it was stuck


def start_worker(redis_url: str, log_path, role: str = "decode") -> subprocess.Popen:
    log = open(log_path, "w+")
    p = subprocess.Popen([sys.executable, "-m", "pdserve", "worker", "--role", role, "--worker-id", "d-1",
                          "--redis-url", redis_url, "--cluster-name", "wcmd", "--kv-cache-memory", "256MiB",
                          "--threads", "1", "--drain-timeout", "5"],
                         stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=ENV)
    p.log = log
    return p


def log_of(p) -> str:
    p.log.seek(0)
    return p.log.read()[-4000:]


@pytest.mark.slow
@pytest.mark.redis
def test_worker_stops_cleanly_and_leaves_the_registry(tmp_path):
    with EmbeddedRedis() as r:
        p = start_worker(r.url, tmp_path / "w.log")
        try:
            assert p.stdout.readline().startswith("ready "), log_of(p)
            key = worker_key("wcmd", "d-1")
            assert redis.Redis.from_url(r.url).exists(key)
            p.send_signal(signal.SIGINT)
            assert p.wait(60) == 0, log_of(p)
            assert not redis.Redis.from_url(r.url).exists(key)  # left the pool at once, not by expiry
            assert "stopped" in log_of(p)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.redis
def test_worker_stops_while_redis_hangs(tmp_path):
    """SIGSTOP freezes redis-server: connections stay open and nothing answers (a partition or
    a wedged Redis). The worker's Ctrl-C still ends it: its registry calls time out."""
    with EmbeddedRedis() as r:
        p = start_worker(r.url + "?socket_timeout=1&socket_connect_timeout=1", tmp_path / "w.log")
        try:
            assert p.stdout.readline().startswith("ready "), log_of(p)
            os.kill(r.pid, signal.SIGSTOP)
            try:
                t = time.monotonic()
                p.send_signal(signal.SIGINT)
                rc = p.wait(90)
                took = time.monotonic() - t
            finally:
                os.kill(r.pid, signal.SIGCONT)
            assert rc == 0, log_of(p)
            assert took < 60, (took, log_of(p))
            print(f"\nstopped in {took:.1f}s with Redis frozen")
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


def stream_forever(address: str) -> threading.Thread:
    """A generation that outlives the drain timeout, read on a thread until the worker ends it."""
    import grpc

    from pdserve.common.sampling_params import SamplingParams
    from pdserve.protos import worker_pb2 as pb
    from pdserve.protos import worker_pb2_grpc as pb_grpc
    from pdserve.protos.convert import params_to_proto

    started, errors = threading.Event(), []

    def run():
        with grpc.insecure_channel(address) as ch:
            # 4,000 tokens at 5-50 ms each: longer than the 5 s drain timeout on the fastest CPU
            req = pb.GenerateRequest(request_id="long", prompt_token_ids=list(range(100, 140)),
                                     params=params_to_proto(SamplingParams(max_tokens=4000, ignore_eos=True)))
            try:
                for _ in pb_grpc.DecodeServiceStub(ch).Generate(req):
                    started.set()
            except grpc.RpcError as e:
                errors.append(e)  # the worker went away under it
                started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(60) and not errors, errors
    return t


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("signals", [1, 2], ids=["drain-timeout", "second-ctrl-c"])
def test_a_busy_worker_stops_after_its_drain_timeout_or_at_a_second_ctrl_c(tmp_path, signals):
    with EmbeddedRedis() as r:
        p = start_worker(r.url, tmp_path / "w.log", role="aggregated")
        try:
            line = p.stdout.readline()
            assert line.startswith("ready "), log_of(p)
            stream = stream_forever(line.split()[1])
            t = time.monotonic()
            p.send_signal(signal.SIGINT)
            if signals == 2:
                deadline = time.monotonic() + 10
                while "draining" not in log_of(p) and time.monotonic() < deadline:
                    time.sleep(0.05)
                p.send_signal(signal.SIGINT)
            rc = p.wait(60)
            took = time.monotonic() - t
            stream.join(10)
            log = log_of(p)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    if signals == 1:  # 5 s of drain, then it stops anyway and says what was cut off
        assert rc == 0 and 5 <= took < 40, (rc, took, log)
        assert "requests still in flight after 5s: 1 in the engine" in log, log
    else:
        assert rc == 130 and took < 5, (rc, took, log)
        assert "second signal: exiting now" in log
    assert not stream.is_alive()  # the client's stream ended; it did not hang
