"""A command run under a parent that adopts what it leaves orphaned (Linux
PR_SET_CHILD_SUBREAPER): every process the command starts, directly or not, stays below that
parent until it exits, orphans of a killed Ray process included. The parent forwards SIGINT
and SIGTERM to the command, and exits with the command's status only once every process below
it has exited: its exit is the test's condition "everything it started is gone"."""
from __future__ import annotations

import subprocess
import sys
import threading

from tests.helpers.procs import ENV, alive, descendants

ADOPTER = r"""
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
child = subprocess.Popen(sys.argv[1:])
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda n, f: child.send_signal(n))
rc = child.wait()
print(f"adopter: command exited with {rc}", file=sys.stderr, flush=True)
while True:  # reap what the command left: this returns once nothing is left below
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
sys.exit(rc if rc >= 0 else 128 - rc)
"""


class Adopted:
    """`python -m pdserve ARGS` below an adopting parent; stderr collected as it comes."""

    def __init__(self, *args: str):
        self.p = subprocess.Popen([sys.executable, "-c", ADOPTER, sys.executable, "-m", "pdserve", *args],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
        self.log: list[str] = []
        self.new_line = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.p.stderr.readline, ""):
            with self.new_line:
                self.log.append(line)
                self.new_line.notify_all()

    def text(self) -> str:
        return "".join(self.log)

    def wait_for_line(self, needle: str, timeout_s: float) -> str:
        with self.new_line:
            found = self.new_line.wait_for(lambda: any(needle in x for x in self.log) or self.p.poll() is not None,
                                           timeout_s)
        line = next((x for x in self.log if needle in x), None)
        assert found and line, f"no {needle!r} within {timeout_s}s:\n{self.text()}"
        return line

    def wait_all_gone(self, timeout_s: float) -> int:
        """The command's exit status once it and everything it started have exited; fails
        naming what is left after `timeout_s` (and stops it: those processes are this test's)."""
        try:
            return self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            left = {pid: _cmdline(pid) for pid in descendants(self.p.pid) if alive(pid)}
            self.p.kill()
            for pid in left:
                try:
                    import os
                    import signal
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise AssertionError(f"still running {timeout_s}s later: {left}\n{self.text()}") from None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"
