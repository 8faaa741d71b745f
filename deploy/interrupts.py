"""Ctrl-C and SIGTERM for `pdserve up`, in every phase: both raise KeyboardInterrupt where
the process is (a Ray wait, a model load), so that its `finally` stops what it started;
inside a `deferred()` step (Ray or Redis starting: interrupted half-way they leave processes
no handle reaches) the signal waits for the step's end; during the cleanup (`shielded()`,
bounded on its own) further signals are noted and ignored, so that a second Ctrl-C cannot cut
the cleanup short and leave Ray or Redis running. Only the main thread can own signal
handlers; elsewhere (a test calling `run_up` from a thread) these are no-ops."""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """The signal handlers of one `pdserve up`; `install()` them, `restore()` the old ones."""

    def __init__(self, log=lambda msg: None):
        self.log = log
        self._mode = "raise"  # or "defer", "ignore"
        self._pending: int | None = None
        self._old: dict = {}

    def _active(self) -> bool:
        return threading.current_thread() is threading.main_thread()

    def install(self) -> "Interrupts":
        """Take SIGINT and SIGTERM (again, after a library replaced a handler; the handlers
        `restore` puts back are those found the first time)."""
        if self._active():
            for s in SIGNALS:
                old = signal.signal(s, self._handle)
                self._old.setdefault(s, old)
        return self

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if self._mode == "raise":
            raise KeyboardInterrupt(signal.Signals(signum).name)
        if self._pending is None:
            self._pending = signum
            self.log(f"{signal.Signals(signum).name}: stopping as soon as "
                     + ("this step ends" if self._mode == "defer" else "the cleanup is done (it is bounded)"))

    @contextlib.contextmanager
    def deferred(self):
        """A step that must not be cut half-way: a signal during it is raised at its end."""
        self._mode, self._pending = "defer", None
        try:
            yield
        finally:
            self._mode = "raise"
        if self._pending is not None:
            raise KeyboardInterrupt(signal.Signals(self._pending).name)

    @contextlib.contextmanager
    def shielded(self):
        """The cleanup: signals during it are ignored (it ends on its own)."""
        self._mode, self._pending = "ignore", None
        try:
            yield
        finally:
            self._mode = "raise"
