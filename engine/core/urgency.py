"""What a scheduler knows about urgency, and what less urgent work may add to a step.

`UrgencyWindow` keeps the priorities a worker steps for (lower is more urgent, as a request's
`priority`): the most urgent of this step, the most urgent seen within the urgent window
(here, or at a peer on this host), and the same for this worker's own requests (which its
peers read from its core-share record). `Allowance` is one step's room for less urgent work:
beside a more urgent request (contended), or in the window with none here (a window step,
short so that the urgent client's next request does not wait for it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass


class UrgencyWindow:
    def __init__(self, window_s: float):
        self.window_s = window_s
        self.now = 0  # the most urgent priority among this step's running and next waiting requests
        self._recent: tuple[int, float] | None = None  # the most urgent priority seen in the window, when
        self._own: tuple[int, float] | None = None  # the same for this worker's own requests (no peer's)

    def note(self, present: list[int]) -> int:
        """This step's priorities (running requests and the next waiting one): the most urgent
        becomes `now` (0 when none) and refreshes the windows."""
        self.now = min(present, default=0)
        t = time.monotonic()
        if self._recent is not None and t - self._recent[1] > self.window_s:
            self._recent = None
        if present and (self._recent is None or self.now <= self._recent[0]):
            self._recent = (self.now, t)
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
        if self._recent is None or priority <= self._recent[0] or t - self._recent[1] > self.window_s:
            self._recent = (priority, seen)

    def recent(self) -> int | None:
        """The most urgent priority seen here or at a peer within the window (None: none)."""
        if self._recent is None or time.monotonic() - self._recent[1] > self.window_s:
            return None
        return self._recent[0]

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
