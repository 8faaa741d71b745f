"""Commands held back while the engine thread steps for more urgent work.

Every mutation of the engine (an add, a KV import, a hand-off's ask for blocks, an abort) is a
command that the engine thread runs between two steps (engine/core/async_engine.py). While a
request more urgent than a command's own is on the engine, that command waits here instead of
running between the urgent request's steps: a KV import of a flood's 1,000-token prompt takes
4-14 ms, an add that compiles a JSON schema's grammar up to 0.2 s, and each is a gap in the
urgent stream's tokens. Held commands run once nothing on the engine is more urgent than them,
when the engine has nothing it can step, or after `max_wait_s` (then one per gap, so a long
urgent stream delays them a bounded time and stalls for at most one of them per token).

Commands of one request keep their order: a command naming a request of which a command is
held waits behind it (the abort of a request whose add is held comes after the add). Commands
that name no priority (stats, frees, aborts) are never held for their own sake."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_WAIT_S = 0.25  # about one urgent chat of 32 tokens beside a flood; then one held command a gap


@dataclass
class Command:
    """One call for the engine thread: `fn(engine)`, its result to `fut`. `priority`: the
    request's it is for (None: no request's, or one that must not wait); `request_id`: the
    request it concerns, for its order among that request's commands."""
    fn: Callable
    fut: Any
    priority: int | None = None
    request_id: str | None = None
    queued_at: float = 0.0


@dataclass
class HeldCommands:
    """The held commands, oldest first, and what they cost: `held` commands in all and
    `held_s` seconds they waited."""
    max_wait_s: float = MAX_WAIT_S
    held: int = 0
    held_s: float = 0.0
    _queue: deque = field(default_factory=deque)
    _ids: Counter = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self._queue)

    def hold(self, cmd: Command, urgency: int | None) -> bool:
        """Keep `cmd` if it must wait (True), given the most urgent priority the engine steps
        for (`urgency`, None: none): it is less urgent than that, or its request has a command
        held already."""
        outranked = cmd.priority is not None and urgency is not None and cmd.priority > urgency
        if not outranked and (cmd.request_id is None or cmd.request_id not in self._ids):
            return False
        self._queue.append(cmd)
        if cmd.request_id is not None:
            self._ids[cmd.request_id] += 1
        self.held += 1
        return True

    def due(self, urgency: int | None, now: float, idle: bool) -> list[Command]:
        """The held commands to run now, oldest first: all of them if the engine is `idle` (it
        has nothing it can step); else those at the head that nothing on the engine outranks,
        and at most one that is outranked but has waited `max_wait_s`."""
        out: list[Command] = []
        overdue_taken = False
        while self._queue:
            head = self._queue[0]
            free = idle or head.priority is None or urgency is None or head.priority <= urgency
            if not free:
                if overdue_taken or now - head.queued_at < self.max_wait_s:
                    break
                overdue_taken = True
            self._queue.popleft()
            if head.request_id is not None:
                self._ids[head.request_id] -= 1
                if not self._ids[head.request_id]:
                    del self._ids[head.request_id]
            self.held_s += max(0.0, now - head.queued_at)
            out.append(head)
        return out

    def drain_all(self) -> list[Command]:
        """Every held command (at shutdown: each caller gets its answer)."""
        out = list(self._queue)
        self._queue.clear()
        self._ids.clear()
        return out
