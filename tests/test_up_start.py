"""`pdserve up` as a user runs it, in the phases before it serves: a cluster that cannot be
placed is refused at once (not left pending in Ray for good), and Ctrl-C in any phase stops
the process and everything it started. Each run sits below a parent that adopts orphans
(tests/helpers/adopting.py), so "everything" includes processes whose own parent died."""
import os
import re
import signal

import pytest

from pdserve.registry.embedded import free_port
from tests.helpers.adopting import Adopted

pytestmark = [pytest.mark.slow, pytest.mark.ray]
START_S = 240  # Ray's start on 2 busy cores took 37 s once; a bound, not a speed


def _gone_after(up: Adopted) -> None:
    """Ray's session directory and the embedded redis-server are gone too."""
    ray_line = next((x for x in up.log if "session files in " in x), "")
    if ray_line:
        temp = ray_line.split("session files in ")[1].split(")")[0]
        assert not os.path.exists(temp), temp
    redis = next((x for x in up.log if "embedded redis-server, pid " in x), "")
    if redis:
        pid = int(re.search(r"pid (\d+)", redis).group(1))
        assert not os.path.exists(f"/proc/{pid}"), redis


def test_more_tensor_parallel_ranks_than_cores_is_refused_at_once():
    # the user's case on a 2-core machine: `pdserve up --prefill-tp 3`; one rank more than
    # this machine has cores wherever it runs
    tp = (os.cpu_count() or 1) + 1
    up = Adopted("up", "--port", str(free_port()), "--prefill-tp", str(tp), "--kv-cache-memory", "64MiB")
    rc = up.wait_all_gone(START_S)
    err = up.text()
    assert rc == 2, err
    assert "pdserve: error: the pools do not fit in the local Ray cluster" in err, err
    assert f"1 prefill worker(s) of {tp:g} CPU each ({tp} tensor-parallel ranks packed on one node)" in err, err
    assert f"Ray has {os.cpu_count()} CPU" in err and f"--ray-cpus {tp + 1}" in err and "--prefill-cpus" in err, err
    assert "Traceback" not in err and "not started after" not in err, err  # refused before any worker waits
    _gone_after(up)


def test_a_port_in_use_is_refused_before_anything_starts():
    """The API's port is taken before Ray or a worker starts (so no process it starts can take it
    meanwhile): a port another server holds is refused at once, naming the flag to change."""
    import socket
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        up = Adopted("up", "--port", str(port), "--kv-cache-memory", "64MiB")
        rc = up.wait_all_gone(START_S)
    err = up.text()
    assert rc == 2 and f"--port {port}: cannot listen there" in err and "choose another --port" in err, err
    assert "starting a local Ray" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("phase", ["starting a local Ray", "ray: "])
def test_ctrl_c_during_the_start_stops_everything(phase):
    """SIGINT while Ray starts, and once Ray runs (Redis started, the workers being placed
    and loading their model): the process exits 130 and leaves nothing behind."""
    up = Adopted("up", "--port", str(free_port()), "--kv-cache-memory", "64MiB", "--prefill-cpus", "0.5",
                 "--decode-cpus", "0.5", "--threads", "1")
    try:
        up.wait_for_line(phase, START_S)
    finally:
        up.p.send_signal(signal.SIGINT)
    rc = up.wait_all_gone(120)
    err = up.text()
    assert rc == 130 and "pdserve: interrupted" in err, err
    assert "Traceback" not in err and "ray logs kept" not in err, err
    _gone_after(up)
