"""Processes the tests start and watch: a `pdserve` subprocess whose stderr is read as it is
written (a pipe nobody reads blocks the writer once it holds 64 KiB: a log-heavy process
would hang at its next line), and the process tree below a PID."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.common.proctree import alive, descendants  # noqa: F401 - the tests take them from here
from pdserve.registry.embedded import EmbeddedRedis

ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore")


class Proc:
    """`python -m pdserve ARGS`: stdout a pipe (for its ready line), stderr collected in
    `log` by a thread."""

    def __init__(self, *args: str, stdout=subprocess.PIPE):
        self.p = subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdout=stdout,
                                  stderr=subprocess.PIPE, text=True, env=ENV)
        self.log: list[str] = []
        self._reader = threading.Thread(target=lambda: self.log.extend(iter(self.p.stderr.readline, "")), daemon=True)
        self._reader.start()

    def text(self) -> str:
        """Its stderr so far; all of it once it has exited."""
        if self.p.poll() is not None:
            self._reader.join(10)
        return "".join(self.log)

    def ready_line(self, prefix: str, exit_within_s: float = 30.0) -> str:
        """Its next stdout line, which must start with `prefix`; else (it closed its stdout,
        exiting, or said something else) an AssertionError with the line and its stderr, once
        it has exited (waited for up to `exit_within_s`)."""
        line = self.p.stdout.readline()
        if not line.startswith(prefix):
            try:
                self.p.wait(exit_within_s)
            except subprocess.TimeoutExpired:
                pass
            raise AssertionError(f"expected a line starting {prefix!r}, got {line!r} (exit code "
                                 f"{self.p.poll()}); its stderr:\n{self.text()}")
        return line

    def find(self, needle: str) -> str | None:
        return next((line for line in self.log if needle in line), None)


def wait_kv_back(url: str, workers: int, within_s: float = 10.0) -> list[str]:
    """Every KV block back in its pool: the router at `url` shows `workers` workers'
    pdserve_kv_usage_ratio, each 0, within `within_s` (their stats refresh every ~1 s); returns
    those lines."""
    import httpx

    deadline, usage = time.monotonic() + within_s, []
    while time.monotonic() < deadline:
        usage = [x for x in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                 if x.startswith("pdserve_kv_usage_ratio{")]
        if len(usage) == workers and all(x.endswith(" 0.0") for x in usage):
            return usage
        time.sleep(0.3)
    raise AssertionError(f"KV blocks still taken after {within_s} s: {usage}")


def stop(proc: Proc, within_s: float = 60.0) -> int:
    """Ctrl-C, as a user stops it; its exit code. Killed (and TimeoutExpired raised) if it has
    not exited within `within_s`."""
    import signal

    proc.p.send_signal(signal.SIGINT)
    try:
        return proc.p.wait(within_s)
    except subprocess.TimeoutExpired:
        proc.p.kill()
        raise


def registry_url(log: str, password: str) -> str:
    """The Redis URL of a `pdserve up` started with `--redis-password PASSWORD`, from its log
    (which shows the password as ***)."""
    from urllib.parse import quote

    line = next(x for x in log.splitlines() if "registry: " in x)
    return line.split("registry: ")[1].split()[0].replace(":***@", f":{quote(password, safe='')}@", 1)


def restart_redis(host: str, port: int, within_s: float = 20.0, password: str = "") -> EmbeddedRedis:
    """On its old port, retrying as an operator would: until the clients' reconnect attempts
    give up on it, one of them can hold the port (a TCP self-connect: the port is in the
    ephemeral range, and a connect to a dead local port can pick it as its own)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return EmbeddedRedis(host, port, password=password).start()
        except RuntimeError as e:
            if time.monotonic() > deadline:
                raise
            print(f"redis restart failed, retrying: {e}")
            time.sleep(0.5)


def _ticks(pid: int) -> int:
    """CPU clock ticks (user + system) process `pid` has run, all its threads; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])


def _busy_ticks() -> int:
    """Ticks the machine's cores were busy so far (/proc/stat: user, nice, system, irq, softirq
    and steal: what the hypervisor gave other guests)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7))


class OtherLoad:
    """How many cores the machine's other work kept busy over a window: every process but
    `roots`, their descendants and this one (another pytest worker's tests, another guest's
    steal), from /proc. A timing check's own load is excluded, so the other load can be read
    while it runs, where a timed loop (ray_procs.slowness) would read the check's own load too."""

    def __init__(self, roots: list[int]):
        self.roots = roots
        self.start = self._read()

    def _read(self) -> tuple[float, int, int]:
        ours = {os.getpid(), *self.roots}
        for root in self.roots:
            ours |= descendants(root)
        return time.monotonic(), _busy_ticks(), sum(_ticks(p) for p in ours)

    def cores(self) -> float:
        """The other work's cores from the start until now (a process of ours that ended within
        the window counts as other work: the cluster's processes outlive it)."""
        (t0, busy0, ours0), (t1, busy1, ours1) = self.start, self._read()
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / os.sysconf("SC_CLK_TCK") / max(t1 - t0, 1e-3)
