"""AsyncEngine: the engine on its own thread, driven from asyncio."""
import asyncio
import sys

import pytest

from pdserve.engine.core.async_engine import SWITCH_INTERVAL_S, AsyncEngine, EngineDeadError
from pdserve.common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[3 + i, 40 + i, 77, 5 * i + 9] * (i + 1) for i in range(4)]


def test_concurrent_streams_match_the_sync_engine(make_engine):
    expected = make_engine().generate(PROMPTS, GREEDY)
    ae = AsyncEngine(make_engine())
    ae.start()

    async def one(i):
        return [t async for out in ae.generate(f"r{i}", PROMPTS[i], GREEDY) for t in out.new_token_ids]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        assert asyncio.run(main()) == expected
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S  # the engine thread gets the GIL back soon
    finally:
        ae.stop()


@pytest.mark.cancellation
def test_leaving_a_stream_early_aborts_the_request(make_engine):
    eng = make_engine()
    ae = AsyncEngine(eng)
    ae.start()

    async def main():
        agen = ae.generate("r", PROMPTS[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        async for out in agen:
            break  # the client went away after the first token
        await agen.aclose()
        for _ in range(100):  # the abort runs on the engine thread
            if await ae.run(lambda e: not e.has_unfinished_requests()):
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
        assert asyncio.run(_used_blocks(ae)) == 0
    finally:
        ae.stop()


@pytest.mark.cancellation
def test_a_cancel_that_lands_while_the_engine_thread_adds_the_request_aborts_it(make_engine):
    """The caller is cancelled while its add_request runs on the engine thread: the request
    must not run on for nobody (the abort is queued behind the add)."""
    import threading

    eng = make_engine()
    adding, release = threading.Event(), threading.Event()
    add = eng.add_request

    def slow_add(*a, **kw):  # the engine thread, in the middle of the command
        adding.set()
        release.wait(5)
        return add(*a, **kw)

    eng.add_request = slow_add
    ae = AsyncEngine(eng)
    ae.start()

    async def main():
        async def consume():
            async for _ in ae.generate("r", PROMPTS[1], SamplingParams(max_tokens=100_000, ignore_eos=True)):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.get_running_loop().run_in_executor(None, adding.wait, 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        release.set()
        for _ in range(200):
            if await ae.run(lambda e: not e.has_unfinished_requests() and e.blocks.num_used_blocks == 0):
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
    finally:
        ae.stop()


async def _used_blocks(ae):
    return await ae.run(lambda e: e.blocks.num_used_blocks)


def test_errors_come_back_to_the_caller(make_engine):
    ae = AsyncEngine(make_engine())
    ae.start()

    async def main():
        async for _ in ae.generate("bad", [], GREEDY):
            pass

    try:
        with pytest.raises(Exception, match="empty"):
            asyncio.run(main())
    finally:
        ae.stop()


def test_stop_fails_requests_in_flight(make_engine):
    eng = make_engine()
    ae = AsyncEngine(eng)
    ae.start()

    async def main():
        got = []
        with pytest.raises(EngineDeadError):
            async for out in ae.generate("r", PROMPTS[1], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)):
                got.append(out)
                if len(got) == 2:
                    await asyncio.get_running_loop().run_in_executor(None, ae.stop)
        return got

    assert len(asyncio.run(main())) >= 2
    with pytest.raises(EngineDeadError):
        ae.call(lambda e: None).result()


def test_stop_fails_queued_commands_even_behind_a_cancelled_one(make_engine):
    """Commands still queued when the engine stops get EngineDeadError; one whose caller
    gave up (a cancelled future) is skipped, not an error that kills the shutdown."""
    import threading
    import time

    ae = AsyncEngine(make_engine())
    ae.start()
    busy = ae.call(lambda e: time.sleep(0.3))  # the engine thread is inside this command
    stopper = threading.Thread(target=ae.stop)
    stopper.start()
    time.sleep(0.1)  # stop() has queued its marker: what follows is drained by the shutdown
    gone, waiting = ae.call(lambda e: 1), ae.call(lambda e: 2)
    assert gone.cancel()
    stopper.join(10)
    assert not stopper.is_alive()
    busy.result(1)
    assert isinstance(waiting.exception(timeout=5), EngineDeadError)


def test_stop_frees_blocks_held_for_a_kv_export(make_engine):
    """A prefill worker stopping between a prompt's first token and its KV export (or whose
    handler was cancelled there) must not keep the held blocks."""
    eng = make_engine()
    ae = AsyncEngine(eng)
    ae.start()

    async def main():
        return [out async for out in ae.generate("held", PROMPTS[2], GREEDY, hold_kv=True)]

    assert asyncio.run(main())[-1].finished
    assert eng.blocks.num_used_blocks > 0  # held for the export that never comes
    ae.stop()
    assert eng.blocks.num_used_blocks == 0
