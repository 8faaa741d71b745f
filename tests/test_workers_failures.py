"""Prefill and decode services over real gRPC when things go wrong: a dead, hanging or
cancelled prefill, bad requests, impostors; the first token always leads; every block comes back."""
from __future__ import annotations

import asyncio
import time
import grpc
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.convert import params_to_proto
from pdserve.protos.security import stats_request
from tests.helpers.workers import Cluster, PROMPTS, PARAMS, expected


def test_first_token_always_leads_the_stream(make_engine):
    """Regression (seen once in CI over UCX): the first token, sampled by the prefill worker,
    was published from the event loop after the KV import returned, so the engine thread could
    step in between and stream the second token ahead of it. It must be published on the
    engine thread, in the same call as the import, before the batch can step again."""
    import threading

    prompts = [[(13 * i + j) % 500 + 3 for j in range(10 + 5 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = make_engine().generate(prompts, params)
    threads = []

    async def main():
        async with Cluster(make_engine) as c:
            publish = c.decode.engine.publish

            def recording(outputs):
                threads.append(threading.current_thread())
                publish(outputs)
            c.decode.engine.publish = recording
            return await asyncio.gather(*(c.generate(f"f{i}", p, params) for i, p in enumerate(prompts)))

    assert [t for t, _ in asyncio.run(main())] == want
    assert len(threads) == len(prompts) and all(t.name == "engine-loop" for t in threads)


def test_short_prompts_prefill_locally(make_engine):
    async def main():
        async with Cluster(make_engine, threshold=30) as c:
            _, short = await c.generate("s", PROMPTS[0], PARAMS[0])
            _, long = await c.generate("l", PROMPTS[1], PARAMS[0])
            return short, long

    short, long = asyncio.run(main())
    assert not short.prefilled_remotely and long.prefilled_remotely


def test_dead_prefill_worker_recompute_policy_gives_same_tokens(make_engine):
    want = expected(make_engine)

    async def main():
        async with Cluster(make_engine) as c:
            out = await c.generate("r", PROMPTS[1], PARAMS[1], prefill="127.0.0.1:1")
            return out, await c.stub.Stats(stats_request(c.token))

    (tokens, last), stats = asyncio.run(main())
    assert tokens == want[1] and not last.prefilled_remotely
    assert stats.transfer_failures == 1 and stats.free_blocks == stats.num_blocks


def test_dead_prefill_worker_fail_policy_errors_cleanly(make_engine):
    async def main():
        async with Cluster(make_engine, policy="fail") as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate("r", PROMPTS[1], PARAMS[0], prefill="127.0.0.1:1")
            return e.value, await c.stub.Stats(stats_request(c.token))

    err, stats = asyncio.run(main())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "KV hand-off failed" in err.details()
    assert stats.free_blocks == stats.num_blocks and stats.running == 0


@pytest.mark.cancellation
def test_client_cancel_frees_blocks(make_engine):
    async def main():
        async with Cluster(make_engine) as c:
            req = pb.GenerateRequest(request_id="c", prompt_token_ids=PROMPTS[2], prefill_address=c.prefill.address,
                                     params=params_to_proto(SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)))
            call = c.stub.Generate(req)
            async for _ in call:
                break
            call.cancel()
            for _ in range(200):
                stats = await c.stub.Stats(stats_request(c.token))
                if stats.running == 0 and stats.free_blocks == stats.num_blocks:
                    return True
                await asyncio.sleep(0.01)
            return False

    assert asyncio.run(main())


def test_bad_requests_and_tokens_are_refused(make_engine):
    async def main():
        async with Cluster(make_engine, token="t0k") as c:
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await c.generate("b", [], PARAMS[0])
            with pytest.raises(grpc.aio.AioRpcError) as unauth:
                await c.generate("u", PROMPTS[0], PARAMS[0], token="nope")
            ok, _ = await c.generate("ok", PROMPTS[0], PARAMS[0])
            return bad.value, unauth.value, ok

    bad, unauth, ok = asyncio.run(main())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in bad.details()
    assert unauth.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(ok) == 12


class _HangingPrefill(pb_grpc.PrefillServiceServicer):
    async def Prefill(self, request, context):
        await asyncio.sleep(30)  # never answers in time, never pushes KV


def test_hanging_prefill_worker_times_out_and_recomputes(make_engine):
    want = expected(make_engine)

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_PrefillServiceServicer_to_server(_HangingPrefill(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with Cluster(make_engine, prefill_timeout=0.5) as c:
                out = await c.generate("h", PROMPTS[1], PARAMS[1], prefill=f"127.0.0.1:{port}")
                return out, await c.stub.Stats(stats_request(c.token)), c.decode.receiver.pending()
        finally:
            await server.stop(0)

    (tokens, last), stats, pending = asyncio.run(main())
    assert tokens == want[1] and not last.prefilled_remotely
    assert stats.transfer_failures >= 1 and pending == [] and stats.free_blocks == stats.num_blocks


@pytest.mark.parametrize("prefill_timeout", [30.0, 0.3])
def test_a_prompt_queued_past_the_push_timeout_is_not_computed_twice(make_engine, prefill_timeout):
    """The prefill worker's engine is held for 1 s while three prompts arrive: they queue there
    longer than a KV push may take (0.3 s). Waited for (--prefill-timeout 30), each is prefilled
    once, remotely; given up after 0.3 s (the timeout the hand-off had for the whole call before
    it had its own), each is computed again on the decode worker. Same tokens either way, every
    block back."""
    want = expected(make_engine)

    async def main():
        async with Cluster(make_engine, transfer_timeout=0.3, prefill_timeout=prefill_timeout) as c:
            held = asyncio.ensure_future(c.prefill.engine.run(lambda e: time.sleep(1.0)))
            await asyncio.sleep(0.05)
            outs = await asyncio.gather(*(c.generate(f"q{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))))
            await held
            return outs, await c.stub.Stats(stats_request(c.token))

    outs, stats = asyncio.run(main())
    assert [t for t, _ in outs] == want
    assert stats.free_blocks == stats.num_blocks
    if prefill_timeout > 1:
        assert stats.remote_prefills == 3 and stats.transfer_failures == 0 and stats.local_prefills == 0
        assert all(last.prefilled_remotely for _, last in outs)
    else:
        assert stats.transfer_failures == 3 and stats.local_prefills == 3


def test_decode_forwards_the_request_parameters_to_the_prefill_worker_unchanged(make_engine, monkeypatch):
    """The prefill worker receives the very SamplingParams message the router sent the decode
    worker, every field set, not one the decode worker rebuilt from its own reading of it."""
    from pdserve.prefill_worker.service import PrefillServicer

    seen = []
    real = PrefillServicer.Prefill

    async def recording(self, request, context):
        seen.append(pb.SamplingParams.FromString(request.params.SerializeToString()))
        return await real(self, request, context)
    monkeypatch.setattr(PrefillServicer, "Prefill", recording)
    sent = params_to_proto(SamplingParams(
        max_tokens=6, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=2**62 + 1, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=2, logit_bias={5: 3.0, 9: -100.0},
        stop_token_ids=[7], ignore_eos=True, logprobs=3, cache_salt="tenant-b"))

    async def main():
        async with Cluster(make_engine) as c:
            req = pb.GenerateRequest(request_id="fwd", prompt_token_ids=PROMPTS[1], params=sent,
                                     prefill_address=c.prefill.address)
            return [msg async for msg in c.stub.Generate(req)]

    msgs = asyncio.run(main())
    assert msgs[-1].finished and msgs[-1].prefilled_remotely
    assert seen == [sent]


class Impostor(pb_grpc.DecodeServiceServicer):
    """A server registered under a worker's name that does not hold the cluster token: it
    answers every Stats call and would gladly take requests (and the token they carry)."""

    def __init__(self):
        self.generate_calls = 0

    async def Stats(self, request, context):
        return pb.WorkerStats(worker_id="decode-1", role="decode", num_blocks=999, free_blocks=999,
                              max_model_len=8192, proof=b"\0" * 32)

    async def Generate(self, request, context):
        self.generate_calls += 1
        yield pb.GenerateResponse(token_ids=[1], finished=True, finish_reason="stop")


def test_only_workers_that_prove_the_cluster_token_get_traffic(make_engine):
    """Stats carries no token, only an HMAC proof both ways: a registered address that
    answers without proving the token is kept out of routing (and never sees the token); a
    caller without the token is refused by the real worker."""
    from pdserve.router.cluster import ClusterClient, WorkerEndpoint

    async def main():
        fake, server = Impostor(), grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with Cluster(make_engine, token="s3cret") as c:
            client = ClusterClient(cluster_token="s3cret", block_size=16)
            client.set_workers([WorkerEndpoint("decode-0", "decode", c.decode.address),
                                WorkerEndpoint("decode-1", "decode", f"127.0.0.1:{port}")])
            await client.refresh()
            routes = [client.route([i, i + 1, i + 2]) for i in range(4)]
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await c.stub.Stats(stats_request("not-the-token"))
            await client.close()
        await server.stop(0)
        return client, routes, wrong.value.code()
    client, routes, code = asyncio.run(main())
    assert client.healthy == {"decode-0": True, "decode-1": False} and client.impostors == {"decode-1"}
    assert {r.decode.worker_id for r in routes} == {"decode-0"} and "decode-1" not in client.stats
    assert code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.cancellation
def test_a_prefill_cancelled_while_its_blocks_wait_to_be_freed_still_frees_them(make_engine):
    """The prompt is done and its KV exported; freeing its held blocks waits behind a step
    (here a command that blocks the engine thread) when the client goes. The blocks must still
    come back: a cancel may not drop that cleanup."""
    import threading

    async def main():
        async with Cluster(make_engine) as c:
            eng, ae = c.prefill_engine, c.prefill.engine
            in_step, go_on = threading.Event(), threading.Event()
            export = eng.export_kv

            def export_then_stall(request_id):  # engine thread: the next command in line is a long "step"
                out = export(request_id=request_id)
                # held until the test lets it go (the bound only keeps a failed test from hanging)
                ae.call(lambda e: (in_step.set(), go_on.wait(120)))
                return out
            eng.export_kv = export_then_stall
            release, release_asked = ae.release_kv, asyncio.Event()

            async def asked_then_release(request_id):  # the handler's cleanup, seen as it asks
                release_asked.set()
                await release(request_id)
            ae.release_kv = asked_then_release
            req = pb.PrefillRequest(request_id="p", prompt_token_ids=PROMPTS[1], kv_address="127.0.0.1:1",
                                    params=params_to_proto(PARAMS[0]), dest_block_ids=[0, 1, 2])
            channel = grpc.aio.insecure_channel(c.prefill.address)
            task = asyncio.ensure_future(pb_grpc.PrefillServiceStub(channel).Prefill(req))
            # polled on this loop: the stall runs and the handler has asked for the release, which
            # waits behind it (in the queue, or in the batch the engine thread took with the stall)
            for _ in range(6000):
                if in_step.is_set() and release_asked.is_set():
                    break
                await asyncio.sleep(0.005)
            assert in_step.is_set() and release_asked.is_set(), "the release was never asked for behind the stall"
            task.cancel()
            await asyncio.sleep(0.05)  # the cancel reaches the handler while its release waits
            assert eng.blocks.num_used_blocks  # still held, behind the stall
            go_on.set()
            await asyncio.gather(task, return_exceptions=True)
            await channel.close()
            assert await ae.run(lambda e: (e.blocks.num_used_blocks, dict(e._held))) == (0, {})

    asyncio.run(main())
