"""A streaming client that stops reading: the router holds a bounded number of its deltas,
then, past the stall timeout, aborts its generations; a reader that keeps up gets all."""
import asyncio

from pdserve.router import responses
from pdserve.router.generation import Delta


class Endless:
    """A Generation's streaming surface, producing as fast as it is asked."""

    def __init__(self, limit: int | None = None, pause_s: float = 0.0):
        self.produced, self.closed, self.limit, self.pause_s = 0, False, limit, pause_s

    async def deltas(self):
        while not self.closed and (self.limit is None or self.produced < self.limit):
            self.produced += 1
            yield Delta(text="x", token_ids=[1])
            await asyncio.sleep(self.pause_s)

    async def close(self):
        self.closed = True


def start(gens, stall_s, stalls):
    return responses.stream(gens, chunk=lambda i, d, off: {"i": i, "t": d.text}, final=lambda i: [], base={},
                            include_usage=False, stall_timeout_s=stall_s, on_stall=lambda: stalls.append(1))


def test_a_reader_that_stops_is_buffered_boundedly_then_cut_off():
    async def main():
        gens, stalls = [Endless(), Endless()], []
        resp = await start(gens, 0.3, stalls)  # held (as the server holds it), never read past its first event
        await asyncio.sleep(0.1)
        assert all(g.produced <= responses.STREAM_BUFFER * 2 + 2 for g in gens)  # bounded, not growing
        await asyncio.sleep(0.5)
        assert all(g.closed for g in gens) and stalls  # aborted on the workers
        produced = [g.produced for g in gens]
        await asyncio.sleep(0.2)
        assert [g.produced for g in gens] == produced and resp is not None
    asyncio.run(main())


def test_a_reader_that_keeps_up_gets_every_delta():
    async def main():
        gens, stalls = [Endless(limit=500)], []
        resp = await start(gens, 0.3, stalls)
        events = [chunk async for chunk in resp.body_iterator]
        assert sum(e.count('"t": "x"') for e in events) == 500 and events[-1] == "data: [DONE]\n\n"
        assert not stalls
    asyncio.run(main())


def test_a_client_that_hangs_up_has_its_generations_closed_at_once():
    """The response run as the server runs it (Starlette, ASGI 2.3): on the client's
    disconnect Starlette cancels the sending task in an anyio scope, which cancels again at
    every await of the cleanup, and leaves the body suspended at a `yield` if the cancel hits
    a send; a pump may be cancelled just as its put completes. However the cancel lands,
    every generation is closed at once, not at the stall timeout. (The workers pace their
    tokens: a producer ready at every loop step would keep anyio from ever delivering the
    cancel, as its target's wait is always already done.)"""
    async def main():
        for after in range(1, 30):
            gens, stalls, hung_up = [Endless(pause_s=0.001), Endless(pause_s=0.001)], [], asyncio.Event()
            resp = await start(gens, 60.0, stalls)
            sent = 0

            async def send(message, n=after):
                nonlocal sent
                sent += 1
                if sent >= n:
                    hung_up.set()
                for _ in range(n % 3):  # the cancel lands in a send, or in the body's wait
                    await asyncio.sleep(0)

            async def receive():
                await hung_up.wait()
                return {"type": "http.disconnect"}
            await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
            for _ in range(100):
                if all(g.closed for g in gens):
                    break
                await asyncio.sleep(0.01)
            assert all(g.closed for g in gens), f"a generation outlived its client (hung up after {after})"
            produced = [g.produced for g in gens]
            await asyncio.sleep(0.05)
            assert [g.produced for g in gens] == produced and not stalls
    asyncio.run(main())
