"""Cores lent between the worker processes of one machine.

A disaggregated cluster on one host gives each worker its own cores (one each on a 2-core
machine), so a lone request's prefill runs on one core while the decode worker's sits idle,
and its decode on one core while the prefill worker's does. Two threads for every worker
would cost more than it gains: when both are busy, a thread team whose thread waits for a
core holds up every parallel region of the step (measured on 2 cores: 32 streams 48.7 ->
33.6 tok/s).

So each worker steps with its own threads while another worker on the host is busy, and with
its own plus every idle peer's threads while none is. "Busy" is an exclusive `flock` a worker
holds on its file in a directory shared by the cluster's workers on this host, from its first
step with work until it has none; a peer that cannot take that lock for a moment knows the
owner is busy. A dead worker's lock goes with its process. The file holds the owner's own
thread count, so a borrower takes only what idle peers own.

Priorities reach across workers the same way. The file also holds the most urgent request
priority the owner is stepping for (lower is more urgent, as a request's `priority`). A worker
whose own work is all less urgent than a busy peer's yields: it stops stepping and lets its
cores go to that peer until the urgent work is done (on 2 cores the urgent stream then decodes
on both, as if it were alone). Equal priorities, the default, never yield.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

CHECK_INTERVAL_S = 0.02  # peers are looked at most this often (two syscalls per peer)
PAUSE_CHECK_S = 0.002  # mid-step (within a layer or at its end), at most this often
# an urgent step waiting for a peer to reach a pause point looks this often: the wait is a few
# milliseconds (a part of a layer), and each look ~20 us
WAIT_POLL_S = 0.0005
PAUSE_MAX_S = 10.0  # a pause for a peer's urgent work ends after this at the latest
# a paused worker looks again after 1 ms, then ever less often, up to every 16 ms: each look
# wakes a process on a core the urgent peer's thread team steps on, and a team waits for its
# slowest thread (2-core Xeon: a look every 1 ms made a one-row step 20-50% slower, every 16 ms
# not measurably); the peer's next request waits for none of this, only the pause's end does
PAUSE_POLL_S = (0.001, 0.016)


class CoreShare:
    def __init__(self, directory: str | Path, name: str, own_threads: int,
                 max_threads: int | None = None, set_threads=None):
        """`directory`: shared by the workers of one cluster on one host; `name`: this worker's
        (its file); `own_threads`: what it runs with while a peer is busy; `max_threads`: the
        most it may use (default: the CPUs this process may run on); `set_threads(n)`: applies a
        thread count (default torch.set_num_threads), on the engine thread."""
        if own_threads < 1:
            raise ValueError(f"own_threads must be >= 1, got {own_threads}")
        self.dir = Path(directory)
        self.path = self.dir / f"{name}.busy"
        self.own = own_threads
        self.max = max_threads or len(os.sched_getaffinity(0))
        self._set = set_threads or _torch_set_threads
        self._fd = _create(self.path)
        self.busy = False
        self.threads = own_threads
        self.urgency = 0
        self.window = NO_WINDOW
        self.pending = False  # idle with work: standing aside for a more urgent peer
        self._write()
        self._checked = float("-inf")  # the first call looks (a monotonic clock may start near 0)
        self._peer_urgency: int | None = None  # the most urgent busy peer's, at the last look
        self._peer_window: tuple[int, float] | None = None  # the most urgent open window of a peer, at the last look
        self._wait_ran_out = False  # wait_for_peers timed out and no look has seen the peer stop since
        self._idle_threads = 0  # owned by idle peers, at the last look
        self._paused_look = float("-inf")
        self.yielded_s = 0.0
        """Seconds this worker has stood aside for a more urgent peer (between steps and within)."""
        self.pauses = 0
        """Times a step of this worker paused at a layer's end for a more urgent peer."""
        self.peer_wait_s = 0.0
        """Seconds this worker's urgent steps waited for less urgent peers to lend their cores."""
        self.peer_waits_out = 0
        """Times such a wait ran out (the urgent step then ran on this worker's own threads)."""

    def _write(self) -> None:
        # fixed width: a peer reading while it is rewritten never sees a short record
        os.pwrite(self._fd, _record(self.own, self.urgency, self.window, self.pending), 0)

    def step_threads(self, urgency: int = 0, window: tuple[int, float] | None = None) -> int:
        """Called before each step with work: mark this worker busy, stepping for requests whose
        most urgent priority is `urgency`, and return (and apply) the thread count for the step.
        `window`: the most urgent priority this worker stepped for lately and until when (its
        scheduler's urgent window, monotonic seconds): peers keep their prompt chunks short
        until then, busy or not here, so that the next urgent request finds them in a short step."""
        urgency, window = _clamp(urgency), window or self.window
        if urgency != self.urgency:
            self._checked = float("-inf")  # which paused peers' threads it may take depends on it
        if urgency != self.urgency or window != self.window or self.pending:
            self.urgency, self.window, self.pending = urgency, window, False
            self._write()
        if not self.busy:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # a peer's probe holds it for microseconds at most
            self.busy = True
        # from the latest look, whoever took it: `yields_to_peer` looks just before this call,
        # and a fresh look must still apply here (a stale count kept the owner's own threads)
        self._look()
        want = min(self.max, self.own + self._idle_threads)
        if want != self.threads:
            self._set(want)
            self.threads = want
        return self.threads

    def retune(self) -> int:
        """Within a step (at a pause point), from a look at most CHECK_INTERVAL_S old: the
        threads for the step's next ops, applied. A peer that became busy since the step began
        gets back the cores this worker borrowed from it, and a peer gone idle lends its own: a
        512-token chunk (0.5-0.9 s) otherwise ran on three threads for two cores to its end
        (burst of 32 prompts on a 2-core Zen 4: its first tokens 0.96 s after the start, not 0.6)."""
        if self.busy and self._look():
            want = min(self.max, self.own + self._idle_threads)
            if want != self.threads:
                self._set(want)
                self.threads = want
        return self.threads

    def wait_for_peers(self, timeout_s: float) -> float:
        """After `step_threads` marked this worker busy for its urgent work: wait, at most
        `timeout_s`, while a peer still steps for less urgent work (it stands aside at the end of
        that step, a short one in its urgent window), then take the cores it lends; the seconds
        waited. An urgent step on both cores beats one started at once on this worker's own.
        After a wait that ran out, the peer's step is a long one (a prompt chunk from before
        its window): the next steps do not wait again (on a 2-core Zen 4 each waited 50 ms, 8
        tokens running) until a look finds no less urgent peer busy."""
        start = time.monotonic()
        if self._wait_ran_out:
            return 0.0
        while True:
            urgent = self._scan()[1]
            if urgent is None or urgent <= self.urgency:
                break
            if time.monotonic() - start >= timeout_s:
                self._wait_ran_out = True
                self.peer_waits_out += 1
                break
            time.sleep(WAIT_POLL_S)
        self._checked = float("-inf")  # look again now
        self.step_threads(self.urgency)
        waited = time.monotonic() - start
        self.peer_wait_s += waited
        return waited

    def pause_for_peers(self, urgency: int) -> float:
        """Within a step (at a layer's end): while a busy peer steps for work more urgent than
        `urgency`, lend it this worker's cores and wait, then take them back and go on; the
        seconds paused (0 at once when no peer is more urgent; looks at most every
        PAUSE_CHECK_S). A long prompt chunk then holds an urgent peer's step up for one of
        its layers, not for the whole chunk (0.75 s for 512 tokens on one core of a Zen 4)."""
        start = time.monotonic()
        if start - self._paused_look < PAUSE_CHECK_S:
            return 0.0
        self._paused_look = start
        urgent = self._scan()[1]
        if urgent is None or urgent >= _clamp(urgency):
            return 0.0
        self.idle(pending=True)
        nap = PAUSE_POLL_S[0]
        while time.monotonic() - start < PAUSE_MAX_S:
            time.sleep(nap)
            nap = min(2 * nap, PAUSE_POLL_S[1])
            urgent = self._scan()[1]
            if urgent is None or urgent >= _clamp(urgency):
                break
        self._checked = float("-inf")  # look again now: the peer's threads may be free
        self.step_threads(self.urgency)
        self.pauses += 1
        paused = time.monotonic() - start
        self.yielded_s += paused
        return paused

    def yields_to_peer(self, urgency: int) -> bool:
        """Whether a worker whose most urgent work has priority `urgency` should stand aside
        now: a busy peer steps for more urgent work. The caller then calls `idle()` and waits
        (about CHECK_INTERVAL_S) before it asks again."""
        self._look()
        return self._peer_urgency is not None and self._peer_urgency < _clamp(urgency)

    @property
    def peer_urgency(self) -> int | None:
        """The most urgent priority a busy peer steps for, at the last look (None: none busy)."""
        return self._peer_urgency

    @property
    def peer_window(self) -> tuple[int, float] | None:
        """The most urgent priority a peer stepped for within its urgent window, and when that
        window closes (monotonic), at the last look; None: no peer's is open."""
        return self._peer_window

    def _look(self) -> bool:
        """Look at the peers if the last look is CHECK_INTERVAL_S old; True if it looked."""
        now = time.monotonic()
        if now - self._checked < CHECK_INTERVAL_S:
            return False
        self._checked = now
        self._idle_threads, self._peer_urgency, self._peer_window = self._scan()
        if self._peer_urgency is None or self._peer_urgency <= self.urgency:
            self._wait_ran_out = False  # the long step is over: wait for the next one again
        return True

    def idle_peer_threads(self) -> int:
        """Threads owned by peers that are idle now; 0 as soon as one peer is busy (a busy peer
        needs its cores, and lending to one borrower while another is busy oversubscribes)."""
        return self._scan()[0]

    def idle(self, pending: bool = False) -> None:
        """This worker has nothing to step (`pending`: or stands aside for a more urgent peer,
        with work of its own `urgency`): its cores are free for its peers."""
        if pending != self.pending:
            self.pending = pending
            self._write()
        if self.busy:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.busy = False

    def _scan(self) -> tuple[int, int | None, tuple[int, float] | None]:
        """(threads owned by idle peers, 0 if any peer is busy; the most urgent busy peer's
        priority, None if none is busy; the most urgent open window of any peer, or None)."""
        total, urgent, busy, window, now = 0, None, False, None, time.monotonic()
        for path in self._peer_paths():
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue  # removed as we looked
            try:
                threads, urgency, open_until, pending = _read(fd)
                if open_until[1] > now and (window is None or open_until[0] < window[0]):
                    window = open_until
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    busy = True
                    urgent = urgency if urgent is None else min(urgent, urgency)
                    continue
                fcntl.flock(fd, fcntl.LOCK_UN)
                if not pending or self.urgency < urgency:
                    # a peer standing aside steps again once this worker's work is not more
                    # urgent than its own: its threads would then be wanted twice (a 2-thread
                    # team beside another process's thread on 2 cores: a 72-token step 116 ms)
                    total += threads
            finally:
                os.close(fd)
        return (0 if busy else total), urgent, window

    def _peer_paths(self) -> list[str]:
        """The peers' files (os.listdir: a third of the cost of a pathlib glob, and a step
        looks up to three times a layer)."""
        mine = self.path.name
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return [os.path.join(self.dir, n) for n in names if n.endswith(".busy") and n != mine]

    def close(self) -> None:
        if self._fd >= 0:
            self.idle()
            os.close(self._fd)
            self._fd = -1
            try:
                self.path.unlink()
                self.dir.rmdir()  # the last worker of the host leaves no directory behind
            except OSError:
                pass  # a peer's file is still there: its owner removes the directory


def _create(path: Path) -> int:
    """Open (creating) a worker's file, and its directory if need be. A peer's `close` may
    remove the directory between the two: then both are made again."""
    for _ in range(100):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            continue
    raise OSError(f"cannot create {path}: its directory keeps disappearing")


_URGENCY_BOUND = 10 ** 9


def _clamp(urgency: int) -> int:
    return max(-_URGENCY_BOUND, min(_URGENCY_BOUND, int(urgency)))


NO_WINDOW = (_URGENCY_BOUND, 0.0)


def _record(threads: int, urgency: int, window: tuple[int, float] = NO_WINDOW, pending: bool = False) -> bytes:
    return f"{threads:6d} {urgency:+11d} {_clamp(window[0]):+11d} {window[1]:16.3f} {int(pending)}\n".encode()


def _read(fd: int) -> tuple[int, int, tuple[int, float], bool]:
    """(the owner's threads, its urgency, its urgent window: the most urgent priority it
    stepped for lately and until when, monotonic; whether it stands aside with work); zeros
    for a record that cannot be read."""
    try:
        fields = os.pread(fd, 64, 0).split()
        window = (_clamp(int(fields[2])), float(fields[3])) if len(fields) > 3 else NO_WINDOW
        pending = len(fields) > 4 and fields[4] == b"1"
        return max(int(fields[0]), 0), _clamp(int(fields[1])) if len(fields) > 1 else 0, window, pending
    except (ValueError, IndexError):
        return 0, 0, NO_WINDOW, False


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)

