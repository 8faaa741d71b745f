"""Several hosts on one machine, for tests of what crosses a network: a network namespace per
host, each joined by a veth pair to a bridge in the test's own namespace. The bridge has an
address too, so the test process reaches every host directly. Programs run inside a host
with `ip netns exec` (the PID held is the program's own) and are stopped by that PID."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class Hosts:
    """`names` as hosts `{subnet}.1`, `{subnet}.2`, ...; the test's side is `{subnet}.254`.
    Names of namespaces and links carry `tag` (e.g. the test's PID), so that two runs at once
    do not meet."""

    def __init__(self, names: list[str], subnet: str, tag: str):
        self.subnet, self.tag = subnet, tag
        self.bridge = f"pb{tag}"
        self.ns = {n: f"pd{n[:3]}{tag}" for n in names}
        self.dev = {n: f"pv{n[:3]}{tag}" for n in names}  # the host's end of its veth pair
        self.address = {n: f"{subnet}.{i}" for i, n in enumerate(names, 1)}
        self.gateway = f"{subnet}.254"

    def create(self) -> None:
        """Skips the test where network namespaces cannot be created (no root)."""
        if shutil.which("ip") is None:
            pytest.skip("no `ip` command")
        first = next(iter(self.ns.values()))
        if ip("netns", "add", first).returncode != 0:
            pytest.skip("network namespaces are not permitted here")
        steps = [("link", "add", self.bridge, "type", "bridge"),
                 ("addr", "add", f"{self.gateway}/24", "dev", self.bridge), ("link", "set", self.bridge, "up")]
        for name, ns in self.ns.items():
            dev, peer = self.dev[name], "b" + self.dev[name][1:]
            steps += [("netns", "add", ns)] if ns != first else []
            steps += [("link", "add", dev, "type", "veth", "peer", "name", peer), ("link", "set", dev, "netns", ns),
                      ("link", "set", peer, "master", self.bridge), ("link", "set", peer, "up"),
                      ("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", dev),
                      ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr}"

    def delete(self) -> None:
        for ns in self.ns.values():  # deleting a namespace removes its veth pair
            ip("netns", "del", ns)
        ip("link", "del", self.bridge)

    def run(self, logs: Path, name: str, *argv: str, env: dict | None = None, stdout_pipe: bool = True
            ) -> subprocess.Popen:
        """`argv` on host `name`: stderr to a file of `logs` (a pipe nobody reads would block the
        program once it filled), stdout a pipe (for a ready line) or, `stdout_pipe` False, that
        file too."""
        err = open(logs / f"{len(list(logs.iterdir()))}-{name}-{Path(argv[0]).name}.log", "w+")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[name], *argv], stderr=err, text=True,
                             stdout=subprocess.PIPE if stdout_pipe else err,
                             env=env or dict(os.environ, PYTHONWARNINGS="ignore"))
        p.log = err
        return p

    def rx_bytes(self, name: str) -> int:
        """Bytes host `name` has received over its link."""
        shown = ip("-n", self.ns[name], "-s", "-j", "link", "show", self.dev[name])
        return json.loads(shown.stdout)[0]["stats64"]["rx"]["bytes"]


def stderr_of(p: subprocess.Popen, last: int = 4000) -> str:
    """The end of what a program started by `Hosts.run` has logged so far."""
    p.log.flush()
    with open(p.log.name) as f:
        return f.read()[-last:]


def stop_all(procs: list[subprocess.Popen], timeout_s: float = 90.0, sig: int = signal.SIGINT) -> list[int]:
    """`sig` to all, newest first; each gets `timeout_s` to exit. One that does not is asked
    for its stacks (SIGUSR1), killed, and its log shown. Returns the exit codes, newest first."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(sig)
    codes, stuck = [], []
    for p in reversed(procs):
        try:
            codes.append(p.wait(timeout_s))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)
            time.sleep(2)
            p.kill()
            codes.append(p.wait())
            stuck.append(f"{p.args[3:]} did not stop within {timeout_s:g}s:\n{stderr_of(p)}")
    assert not stuck, "\n".join(stuck)
    return codes
