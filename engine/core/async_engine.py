"""AsyncEngine: one LLMEngine driven by its own thread, used from asyncio services.

The engine is not thread-safe, so every mutation (add, abort, KV import/export) is a command
that the engine thread runs between two steps; outputs travel back to per-request asyncio
queues. The step loop sleeps when there is nothing to do and wakes on the next command.
"""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from concurrent.futures import Future
from operator import methodcaller
from typing import AsyncIterator, Callable, TypeVar

from pdserve.common.outputs import EngineStats, RequestOutput, TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.core.held_commands import Command, HeldCommands
from pdserve.engine.core.kv_hooks import StepStopped, StopWord
from pdserve.engine.parallel.cores import CHECK_INTERVAL_S, CoreShare

T = TypeVar("T")


def _most_urgent(urgency: int | None, commands: list[Command]) -> int | None:
    """The most urgent of `urgency` (the engine's, None: none) and the priorities `commands` are for."""
    for cmd in commands:
        if cmd.priority is not None and (urgency is None or cmd.priority < urgency):
            urgency = cmd.priority
    return urgency


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a bug or shutdown); requests in flight fail with this."""


URGENT_PEER_WAIT_S = 0.05  # an urgent step waits this long at most for a less urgent peer to lend its cores
# the GIL's switch interval while an engine thread runs: back from each C call (the step, the LM
# head, sampling) the engine thread waits for the event loop's thread to hand over the GIL, by
# default up to 5 ms; at 1 ms the time between two decode steps at 32 streams fell from 3.7-4.7
# to 2.7-3.1 ms (bench/NOTES.md)
SWITCH_INTERVAL_S = 0.001


class AsyncEngine:

    def __init__(self, engine: LLMEngine, cores: CoreShare | None = None):
        """`cores`: this process's share of the host's cores; each step with work then runs
        on the threads it lends (engine/parallel/cores.py)."""
        self.engine = engine
        self.cores = cores
        self._commands: queue.Queue = queue.Queue()
        self.held = HeldCommands()  # less urgent commands waiting out a more urgent request's steps
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        # its threshold: the most urgent priority of the step in flight; its word: the most urgent
        # priority added since that step began (read by the native step at each layer's end)
        self.stop_word = StopWord()
        engine.between_layers = self._between_layers
        engine.stop_word = self.stop_word

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abort everything in flight and stop the engine thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(None)
        self._thread.join()
        self._thread = None

    # ---- API (any thread / event loop) ----------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], T], priority: int | None = None,
             request_id: str | None = None) -> "Future[T]":
        """Run `fn(engine)` on the engine thread between steps. `priority`: the request's it
        works for, if it may wait while the engine steps for more urgent work (HeldCommands);
        `request_id`: the request it concerns (it keeps its place among that one's commands)."""
        fut: Future = Future()
        if self._thread is None or self.error is not None:
            fut.set_exception(EngineDeadError(f"engine is not running: {self.error!r}"))
            return fut
        self._commands.put(Command(fn, fut, priority, request_id, time.monotonic()))
        return fut

    async def run(self, fn: Callable[[LLMEngine], T], priority: int | None = None,
                  request_id: str | None = None) -> T:
        """`fn(engine)` on the engine thread (`call`); a cancel while it waits its turn drops it."""
        return await asyncio.wrap_future(self.call(fn, priority, request_id))

    async def run_always(self, fn: Callable[[LLMEngine], T], request_id: str | None = None) -> T:
        """Like `run`, but `fn` still runs if the caller is cancelled while it waits its turn
        (the engine thread may be seconds into a prefill chunk): for cleanup, such as freeing
        a request's blocks, that must not be lost to a client that went away at that moment."""
        return await asyncio.shield(asyncio.wrap_future(self.call(fn, request_id=request_id)))

    # ---- named engine calls (each runs on the engine thread between two steps) -------------
    def note_arrival(self, priority: int) -> None:
        """A request of `priority` is about to be added (by a command queued next): a long step
        of less urgent work in flight stops at its next layer's end (`_between_layers`, or the
        native step's own look at `stop_word`)."""
        self.stop_word.note(priority)

    async def add_request(self, request_id: str, prompt, params: SamplingParams, **kw) -> None:
        self.note_arrival(params.priority)
        await self.run(methodcaller("add_request", request_id=request_id, prompt=prompt, params=params, **kw),
                       params.priority, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was here."""
        return await self.run(methodcaller("abort", request_id=request_id), request_id=request_id)

    async def abort_always(self, request_id: str) -> bool:
        """`abort`, run even if the caller is cancelled meanwhile (cleanup that must not be lost)."""
        return await self.run_always(methodcaller("abort", request_id=request_id), request_id)

    def abort_soon(self, request_id: str) -> None:
        """Queue an abort without waiting for it (from a `finally` that cannot await)."""
        self.call(methodcaller("abort", request_id=request_id), request_id=request_id)

    async def stats(self) -> EngineStats:
        return await self.run(methodcaller("stats"))

    async def load_lora(self, name: str, path: str):
        """Load a LoRA adapter on the engine thread (between two steps); returns its LoRAInfo."""
        return await self.run(methodcaller("load_lora", name=name, path=path))

    async def unload_lora(self, name: str) -> None:
        await self.run(methodcaller("unload_lora", name=name))

    async def loras(self) -> list:
        """The engine's adapters (LoRAInfo each), as the engine thread sees them."""
        return await self.run(lambda e: e.loras.adapters())

    async def cached_blocks(self) -> tuple[list[int], int]:
        """The cached blocks' hashes and the KV-event number they agree with."""
        return await self.run(methodcaller("cached_blocks"))

    async def stream_kv_layers(self, request_id: str, on_layers, group: int, first_block: int) -> None:
        await self.run(methodcaller("stream_kv_layers", request_id=request_id, on_layers=on_layers,
                                    group=group, first_block=first_block), request_id=request_id)

    async def stop_kv_stream(self, request_id: str) -> None:
        await self.run_always(methodcaller("stop_kv_stream", request_id=request_id), request_id)

    async def export_kv(self, request_id: str):
        return await self.run(methodcaller("export_kv", request_id=request_id), request_id=request_id)

    async def release_kv(self, request_id: str) -> None:
        await self.run_always(methodcaller("release_kv", request_id=request_id), request_id)

    async def import_kv(self, request_id: str, kv, first_token: int, logprob: TokenLogprobs | None,
                        prompt_logprobs: list[TokenLogprobs] | None = None, priority: int | None = None) -> None:
        """Land a prompt's KV with its first token (and the prompt's logprobs, computed where
        the KV was), and publish that token from the engine thread before it can step again:
        it always reaches the stream ahead of the ones the batch produces next. `priority`:
        the request's (the copy waits while the engine steps for more urgent work)."""
        def land(e: LLMEngine) -> None:
            self.publish([e.import_kv(request_id, kv, first_token, logprob, prompt_logprobs)])
        await self.run(land, priority, request_id)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Register for `request_id`'s outputs (call before the request is added)."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def generate(self, request_id: str, prompt, params: SamplingParams,
                       hold_kv: bool = False) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving early (cancel, disconnect) aborts it,
        also when the cancel lands while the engine thread is adding it (the abort is queued
        behind the add: commands run in order)."""
        q = self.open_stream(request_id)
        streaming = False
        try:
            await self.add_request(request_id, prompt, params, hold_kv=hold_kv)
            streaming = True
            async for out in self.stream(request_id, q):  # aborts it if left before the end
                yield out
        finally:
            if not streaming:
                self.abort_soon(request_id)
            self.close_stream(request_id)

    async def stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_soon(request_id)

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            idle = True
            while not self._stopping:
                # nothing ran last time (no requests, or all waiting on remote KV or memory):
                # only a command can change that, so sleep until one arrives, never spin
                if idle and self.cores is not None:
                    self.cores.idle()
                # cleared before the drain: a request added after it is either drained (then the
                # step's urgency counts it) or not (then the step may stop for it)
                self.stop_word.clear()
                ran = self._drain(block=idle and not self.held)  # held commands run before it sleeps
                if self._stopping:
                    break
                # "nothing it can step" is as of the last step: a command that ran since (an
                # urgent add) may have given it work, and the held ones must not all run before it
                for cmd in self.held.due(self.engine.most_urgent_priority(), time.monotonic(), idle and not ran):
                    self._execute(cmd)
                idle = True
                if self.engine.has_unfinished_requests():
                    urgency = self.engine.most_urgent_priority()
                    self.stop_word.threshold = 0 if urgency is None else urgency
                    if self.cores is not None and self._stand_aside(urgency):
                        idle = False
                        continue
                    self._publish(self.engine.step())
                    idle = not self.engine.last_step_progress
        except BaseException as e:  # noqa: BLE001 - report to every waiter, then stop
            self.error = e
        finally:
            self._shutdown()

    def _stand_aside(self, urgency: int | None) -> bool:
        """Before a step: if a peer on this host steps for more urgent work than any here, lend
        it the cores and wait for a command (or the next look at the peers) instead of stepping;
        True then. Otherwise take the cores for the step. `urgency`: the most urgent priority
        here (None: none needs compute)."""
        stands_aside = urgency is not None and self.cores.yields_to_peer(urgency)
        peer, window = self.cores.peer_urgency, self.cores.peer_window
        if peer is not None and (urgency is None or peer < urgency):
            self.engine.scheduler.note_urgency_elsewhere(peer)  # short chunks: stand aside again soon
        if window is not None and (urgency is None or window[0] < urgency):
            # its next urgent request must find this worker in a short step, not in a 512-token
            # chunk (0.75 s on one core of a 2-core Zen 4), busy here or not when it comes
            self.engine.scheduler.note_urgency_elsewhere(*window)
        if stands_aside:
            self.cores.idle(pending=True)
            t0 = time.monotonic()
            self._drain(block=True, timeout=CHECK_INTERVAL_S)
            self.cores.yielded_s += time.monotonic() - t0
            return True
        self.cores.step_threads(self.cores.urgency if urgency is None else urgency, self.engine.scheduler.own_window())
        if urgency is not None and peer is not None and peer > urgency:  # a peer busy with less urgent work
            self.cores.wait_for_peers(URGENT_PEER_WAIT_S)
        return False

    def _between_layers(self, may_stop: bool) -> None:
        """At a layer's end of a long step: a peer on this host stepping for more urgent work
        gets the cores until it is done (`pause_for_peers`), and the step's next ops take the
        threads the peers' states leave it (`retune`); a request more urgent than any
        here that came since the step began stops it (StepStopped, if it `may_stop`), so the
        request waits for one layer of the step, not for all of it."""
        word = self.stop_word
        if self.cores is not None:
            self.cores.pause_for_peers(word.threshold)
            self.cores.retune()
        if may_stop and word.stops():
            raise StepStopped(f"a request of priority {word.word.value} came during a step for {word.threshold}")

    def _drain(self, block: bool, timeout: float | None = None) -> int:
        """Run the queued commands (waiting up to `timeout` for the first if `block`), but hold
        those less urgent than the work the engine steps for, or than a command queued with
        them (HeldCommands): a flood's KV imports queued just ahead of an urgent request's add
        wait for its steps instead of running before its first (5-14 ms each, on its TTFT).
        Returns how many ran."""
        ran = 0
        while True:  # until the queue is empty (commands that come meanwhile too) or a stop
            queued: list[Command] = []
            try:
                cmd = self._commands.get(block=block, timeout=timeout)
                while cmd is not None:  # None: stop
                    queued.append(cmd)
                    cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = False
            block = False
            for i, queued_cmd in enumerate(queued):
                if not self.held.hold(queued_cmd, _most_urgent(self.engine.most_urgent_priority(), queued[i:])):
                    self._execute(queued_cmd)
                    ran += 1
            if cmd is None or not queued:
                return ran

    def _execute(self, cmd: Command) -> None:
        if cmd.fut.set_running_or_notify_cancel():
            try:
                cmd.fut.set_result(cmd.fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                cmd.fut.set_exception(e)

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Deliver outputs produced outside step() (e.g. by a KV import) to their streams."""
        self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        # one wake-up per event loop and step, not per output: each call_soon_threadsafe
        # writes to the loop's self-pipe (a syscall), 32 per step at 32 streams
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, q = target
                batches.setdefault(loop, []).append((q, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _shutdown(self) -> None:
        self.engine.abort_all()
        err = EngineDeadError(f"engine stopped: {self.error!r}" if self.error else "engine stopped")
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put_nowait, err)
        pending = self.held.drain_all()
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if cmd is not None and cmd.fut.set_running_or_notify_cancel():  # its caller may have gone
                cmd.fut.set_exception(err)
