"""What a scheduler knows about urgency, and what less urgent work may add to a step.

`UrgencyWindow` keeps the priorities a worker steps for (lower is more urgent, as a request's
`priority`): the most urgent of this step, the most urgent its own requests had within the
urgent window (which its peers read from its core-share record), and the most urgent a peer
on this host stepped for within its window. `Allowance` is one step's room for less urgent
work: beside a more urgent request (contended); in its own window with none here (a window
step, short so that the urgent client's next request does not wait for it); or in a peer's
window (a peer step: prompt chunks of a bounded size, so the step pauses for the peer's urgent
steps at a layer's end within a few milliseconds, engine/core/async_engine.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

# steps of more prompt tokens run layer by layer in Python, which pauses for a peer's urgent step
# or stops at a layer's end when asked (engine/core/kv_hooks.py); shorter ones run as one call
# of the native step, which can stop at a layer's end but not pause
PAUSE_MIN_TOKENS = 64


class UrgencyWindow:
    def __init__(self, window_s: float):
        self.window_s = window_s
        self.now = 0  # the most urgent priority among this step's running and next waiting requests
        self._own: tuple[int, float] | None = None  # the most urgent priority of its own requests lately, when
        self._peer: tuple[int, float] | None = None  # the same for its peers on this host

    def note(self, present: list[int]) -> int:
        """This step's priorities (running requests and the next waiting one): the most urgent
        becomes `now` (0 when none) and refreshes the own window."""
        self.now = min(present, default=0)
        t = time.monotonic()
        if self._own is not None and t - self._own[1] > self.window_s:
            self._own = None
        if present and (self._own is None or self.now <= self._own[0]):
            self._own = (self.now, t)
        return self.now

    def note_elsewhere(self, priority: int, until: float | None = None) -> None:
        """A peer on this host steps for requests of `priority` now, or did within its urgent
        window (open `until`, monotonic)."""
        t = time.monotonic()
        seen = t if until is None else min(t, until - self.window_s)
        if self._peer is None or priority <= self._peer[0] or t - self._peer[1] > self.window_s:
            self._peer = (priority, seen)

    def peer(self) -> int | None:
        """The most urgent priority a peer stepped for within the window (None: none)."""
        if self._peer is None or time.monotonic() - self._peer[1] > self.window_s:
            return None
        return self._peer[0]

    def own_window(self) -> tuple[int, float] | None:
        """The most urgent priority this worker's own requests had within the urgent window,
        and when that window closes (monotonic); None when none was here within it."""
        if self._own is None or time.monotonic() - self._own[1] > self.window_s:
            return None
        return self._own[0], self._own[1] + self.window_s


@dataclass
class Allowance:
    """One step's room for work less urgent than `above` (a request of a higher priority value):
    `rows` decode rows, `seconds` (None: no cost model yet, rows only) and, in a window step,
    `tokens` of prompt chunks. A window step (`window`) always takes its first less urgent
    row or chunk, so the work here moves on however short the step must be."""
    above: int | None = None  # None: nothing here is priced
    rows: int = 0
    seconds: float | None = None
    tokens: int = 0
    window: bool = False
    taken: int = 0  # less urgent rows and chunks in the step so far

    def fits(self, cost: float) -> bool:
        """Whether a row or chunk of `cost` seconds fits; if so it is taken."""
        first = self.window and self.taken == 0
        if not first and (self.rows <= 0 or (self.seconds is not None and cost > self.seconds)):
            return False
        self.rows -= 1
        if self.seconds is not None:
            self.seconds -= cost
        self.taken += 1
        return True
