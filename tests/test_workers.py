"""Prefill and decode services over real gRPC on loopback (tiny model, one process): the
disaggregated path gives the single-engine tokens, failures fall back or fail cleanly, and
every block comes back."""
import asyncio

import grpc
import pytest
import torch

from pdserve.decode_worker.service import DecodeWorker
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer.senders import SchemeKVSender
from pdserve.prefill_worker.service import PrefillWorker
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.convert import params_to_proto
from pdserve.kv_transfer.config import TransferConfig
from pdserve.protos.security import SecurityConfig, stats_request

PROMPTS = [[(11 * i + j) % 500 + 3 for j in range(18 + 21 * i)] for i in range(3)]
PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=9, temperature=1.0, seed=11, ignore_eos=True)]


class Cluster:
    def __init__(self, make_engine, token="", policy="recompute", threshold=0, decode_kv=4 << 20, kv_transport="grpc",
                 decode_block_size=16, layer_group=0, prefill_budget=512, kv_cache_dtype="auto",
                 decode_kv_cache_dtype="", wire_dtype="auto", convert_kv=True):
        self.prefill_engine = make_engine(max_num_batched_tokens=prefill_budget, kv_cache_dtype=kv_cache_dtype)
        self.decode_engine = make_engine(kv_cache_memory=decode_kv, block_size=decode_block_size,
                                         kv_cache_dtype=decode_kv_cache_dtype or kv_cache_dtype)
        transfer = TransferConfig(transport=kv_transport, layer_group=layer_group, policy=policy,
                                  local_prefill_threshold=threshold, wire_dtype=wire_dtype,
                                  kv_dtype_mismatch="convert" if convert_kv else "refuse")
        security = SecurityConfig(cluster_token=token)
        self.prefill = PrefillWorker(AsyncEngine(self.prefill_engine), SchemeKVSender("prefill-0", token), "prefill-0",
                                     transfer=transfer, security=security)
        self.decode = DecodeWorker(AsyncEngine(self.decode_engine), "decode-0", transfer=transfer, security=security)
        self.token = token

    async def __aenter__(self):
        await self.prefill.start()
        await self.decode.start()
        self.channel = grpc.aio.insecure_channel(self.decode.address)
        self.stub = pb_grpc.DecodeServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.decode.stop()
        await self.prefill.stop()

    async def generate(self, rid, prompt, params, prefill=True, token=None):
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params),
                                 prefill_address=self.prefill.address if prefill is True else (prefill or ""),
                                 cluster_token=self.token if token is None else token)
        tokens, last = [], None
        async for msg in self.stub.Generate(req):
            tokens += list(msg.token_ids)
            last = msg
        return tokens, last


def expected(make_engine):
    eng = make_engine()
    return [eng.generate([p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]


@pytest.mark.parametrize("kv_transport", ["grpc", "ucx"])
def test_disaggregated_equals_single_engine(make_engine, kv_transport):
    if kv_transport == "ucx":
        pytest.importorskip("ucxx", reason="the UCX transport needs pdserve[ucx]")
    want = expected(make_engine)

    async def main():
        async with Cluster(make_engine, kv_transport=kv_transport) as c:
            outs = await asyncio.gather(*(c.generate(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))))
            stats = await c.stub.Stats(stats_request(c.token))
            return outs, stats

    outs, stats = asyncio.run(main())
    assert [t for t, _ in outs] == want
    assert all(last.finished and last.finish_reason == "length" and last.prefilled_remotely for _, last in outs)
    assert stats.remote_prefills == 3 and stats.local_prefills == 0 and stats.free_blocks == stats.num_blocks


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("layer_group", [0, 1])
def test_a_low_precision_cache_hands_off_its_blocks_as_they_are(make_engine, layer_group, kv):
    """Both pools with bf16 or 8-bit K/V: the hand-off ships the blocks as stored (8-bit codes
    with their scales: 20 bytes per row of 16 for the tiny model, 64 in fp32; whole or layer
    by layer) and the tokens are the single engine's with that cache."""
    eng = make_engine(kv_cache_dtype=kv)
    want = [eng.generate([p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]

    async def main():
        async with Cluster(make_engine, kv_cache_dtype=kv, layer_group=layer_group) as c:
            outs = [await c.generate(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
            return outs, c.prefill.kv_bytes
    outs, sent = asyncio.run(main())
    assert [t for t, _ in outs] == want and all(last.prefilled_remotely for _, last in outs)
    cache = eng.kv_cache.kv
    per_token = cache.shape[0] * 2 * cache.shape[4] * cache.shape[5] * cache.element_size()  # layers x K/V x heads x row
    assert cache.shape[5] * cache.element_size() == {"bf16": 32, "int8": 20, "fp8": 20}[kv]
    assert sent == sum(-(-len(p) // 16) * 16 for p in PROMPTS) * per_token


@pytest.mark.parametrize("wire", ["int8", "fp8"])
def test_wire_only_compression_ships_8_bit_blocks_between_fp32_caches(make_engine, wire):
    """--kv-wire-dtype: fp32 caches on both sides, the KV quantized for the transfer only: a
    third of the bytes of fp32 for the tiny model (20 per row of 16 values, not 64); the first
    token is the fp32 prefill's, the decode side lands the blocks dequantized into its fp32
    cache and every request finishes, every block back."""
    fp32 = make_engine()
    want = [fp32.generate([p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]

    async def main():
        async with Cluster(make_engine, wire_dtype=wire) as c:
            assert c.decode_engine.kv_cache.kv.dtype == torch.float32
            outs = [await c.generate(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
            return outs, c.prefill.kv_bytes
    outs, sent = asyncio.run(main())
    assert [t[0] for t, _ in outs] == [w[0] for w in want]
    assert all(last.prefilled_remotely and last.finished for _, last in outs)
    assert all(len(t) == len(w) for (t, _), w in zip(outs, want))
    cache = fp32.kv_cache.kv
    assert sent == sum(-(-len(p) // 16) * 16 for p in PROMPTS) * cache.shape[0] * 2 * cache.shape[4] * 20


def test_pools_with_different_kv_dtypes_convert_on_the_hand_off(make_engine):
    """An fp32 prefill pool and a bf16 decode pool: the prefill side ships its fp32 blocks, the
    decode side stores them rounded to bf16 and decodes on. Its greedy tokens then follow a
    bf16 decode of the fp32 prompt: the first is the fp32 engine's; each request finishes with
    every block back in both pools."""
    fp32 = make_engine()
    want_first = [fp32.generate([p], [sp])[0][0] for p, sp in zip(PROMPTS, PARAMS)]

    async def main():
        async with Cluster(make_engine, decode_kv_cache_dtype="bf16") as c:
            assert c.decode_engine.kv_cache.kv.dtype == torch.bfloat16
            assert c.prefill_engine.kv_cache.kv.dtype == torch.float32
            outs = [await c.generate(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
            return outs, c.prefill.kv_bytes
    outs, sent = asyncio.run(main())
    assert [t[0] for t, _ in outs] == want_first
    assert all(last.prefilled_remotely and last.finished for _, last in outs)
    assert all(len(t) == sp.max_tokens for (t, _), sp in zip(outs, PARAMS) if sp.ignore_eos)
    kv = fp32.kv_cache.kv
    assert sent == sum(-(-len(p) // 16) * 16 for p in PROMPTS) * kv.shape[0] * 2 * kv.shape[4] * kv.shape[5] * 4


def test_a_decode_pool_that_refuses_other_kv_formats_recomputes_the_prompt(make_engine):
    """--kv-dtype-mismatch refuse: an fp32 prefill pool's push into an int8 decode pool is
    refused, the transfer policy (recompute) prefills on the decode worker: the tokens are the
    single int8 engine's, no KV was imported, every block is back."""
    i8 = make_engine(kv_cache_dtype="int8")
    want = [i8.generate([p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]

    async def main():
        async with Cluster(make_engine, decode_kv_cache_dtype="int8", convert_kv=False) as c:
            outs = [await c.generate(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
            return outs, c.decode.transfer_failures, c.decode.blocks_received
    outs, failures, received = asyncio.run(main())
    assert [t for t, _ in outs] == want
    assert failures == 3 and received == 0 and not any(last.prefilled_remotely for _, last in outs)


@pytest.mark.parametrize("layer_group", [0, 1])
def test_the_first_response_says_where_the_time_to_first_token_went(make_engine, layer_group):
    """A remotely prefilled request's first response carries the workers' own measurements
    (decode blocks wait, prefill queue, prefill compute, KV push after the compute); they sum
    to less than the time to first token the client saw, the compute is most of it, and
    later responses carry none (the queue time itself: test_engine)."""
    import time

    async def main():
        async with Cluster(make_engine, layer_group=layer_group, prefill_budget=16) as c:
            async def timed(i, p):
                t = time.perf_counter()
                req = pb.GenerateRequest(request_id=f"t{i}", prompt_token_ids=p, prefill_address=c.prefill.address,
                                         params=params_to_proto(PARAMS[0]), cluster_token=c.token)
                msgs = [m async for m in c.stub.Generate(req)]
                return msgs, msgs and time.perf_counter() - t
            long_prompt = [(7 * j) % 500 + 3 for j in range(200)]  # 13 steps of 16 tokens
            return await asyncio.gather(timed(0, long_prompt), timed(1, PROMPTS[1]))
    runs = asyncio.run(main())
    for msgs, elapsed in runs:
        first = msgs[0]
        assert first.prefilled_remotely and first.HasField("timing")
        t = first.timing
        parts = (t.blocks_wait_s, t.prefill_queue_s, t.prefill_compute_s, t.kv_push_s)
        assert all(x >= 0 for x in parts) and t.prefill_compute_s > 0 and t.kv_push_s > 0
        assert sum(parts) < elapsed
        assert not any(m.HasField("timing") for m in msgs[1:])



def test_under_kv_pressure_requests_wait_for_blocks_not_prefill_locally(make_engine):
    """The decode worker's KV (8 blocks) holds one 70+40-token request at a time: the second
    waits for blocks and still gets its prompt from the prefill worker (prefilling it on the
    decode worker would stall the batch)."""
    prompt, params = PROMPTS[2] + PROMPTS[1][:10], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = make_engine().generate([prompt], params)[0]

    async def main():
        async with Cluster(make_engine, decode_kv=8 * 8192) as c:  # 8 blocks of 16 tokens (tiny model, fp32)
            assert c.decode_engine.blocks.num_blocks == 8
            outs = await asyncio.gather(c.generate("a", prompt, params), c.generate("b", prompt + [7], params))
            return outs, await c.stub.Stats(stats_request(c.token))

    outs, stats = asyncio.run(main())
    assert outs[0][0] == want and len(outs[1][0]) == 40
    assert stats.remote_prefills == 2 and stats.local_prefills == 0


def test_a_prefix_the_decode_worker_caches_is_not_sent_again(make_engine):
    """Same prompt twice (n > 1 choices, a shared system prompt): the second hand-off sends
    only the blocks after the prefix the decode worker already caches, which it shares by
    reference count; the outputs are those of a single engine."""
    prompt = PROMPTS[2] + PROMPTS[1]  # 99 tokens: 6 full blocks of 16 and a partial one
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    want = [make_engine().generate([prompt], [p])[0] for p in params]

    async def main():
        async with Cluster(make_engine) as c:
            first = await c.generate("a", prompt, params[0])
            after_first = c.decode.blocks_received
            second = await c.generate("b", prompt, params[1])
            return [first[0], second[0]], after_first, c.decode.blocks_received - after_first

    outs, first_blocks, second_blocks = asyncio.run(main())
    assert outs == want
    assert first_blocks == 7 and second_blocks == 1  # only the partial last block travels again


@pytest.mark.parametrize("decode_block_size", [8, 32])
def test_pools_with_different_block_sizes(make_engine, decode_block_size):
    """Prefill pages its cache in blocks of 16 tokens, decode in 8 or 32: the KV is re-blocked
    on arrival, also when the decode worker already holds a cached prefix (then the prefill
    worker sends from the block holding the first token it awaits)."""
    prompt = PROMPTS[2] + PROMPTS[1]  # 99 tokens
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    want = [make_engine().generate([prompt], [p])[0] for p in params]
    want += [make_engine().generate([p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]

    async def main():
        async with Cluster(make_engine, decode_block_size=decode_block_size) as c:
            outs = [(await c.generate(f"x{i}", prompt, p))[0] for i, p in enumerate(params)]  # 2nd: prefix cached
            outs += [t for t, _ in await asyncio.gather(*(c.generate(f"r{i}", p, sp)
                                                          for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))))]
            return outs, await c.stub.Stats(stats_request(c.token))

    outs, stats = asyncio.run(main())
    assert outs == want
    assert stats.remote_prefills == 5 and stats.local_prefills == 0 and stats.transfer_failures == 0


@pytest.mark.parametrize("decode_block_size", [16, 8])
def test_layer_wise_streaming_gives_the_same_tokens(make_engine, decode_block_size):
    """KV pushed layer by layer while the prompt computes (the tiny model has 2 layers: 2
    pushes per request), also chunked prefill, a cached prefix and another block size."""
    prompt = PROMPTS[2] + PROMPTS[1]
    prompts, params = PROMPTS + [prompt, prompt], PARAMS + [PARAMS[0], PARAMS[1]]
    want = [make_engine().generate([p], [sp])[0] for p, sp in zip(prompts, params)]

    async def main():
        # a 32-token step budget: the longer prompts are prefilled in chunks, the last one streams
        async with Cluster(make_engine, layer_group=1, decode_block_size=decode_block_size, prefill_budget=32) as c:
            outs = [(await c.generate(f"l{i}", p, sp))[0] for i, (p, sp) in enumerate(zip(prompts, params))]
            return outs, c.prefill.stream_pushes, await c.stub.Stats(stats_request(c.token))

    outs, pushes, stats = asyncio.run(main())
    assert outs == want and pushes == 2 * len(prompts)
    assert stats.remote_prefills == len(prompts) and stats.transfer_failures == 0


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
            async with Cluster(make_engine) as c:
                c.decode.transfer_timeout_s = 0.5
                out = await c.generate("h", PROMPTS[1], PARAMS[1], prefill=f"127.0.0.1:{port}")
                return out, await c.stub.Stats(stats_request(c.token)), c.decode.receiver.pending()
        finally:
            await server.stop(0)

    (tokens, last), stats, pending = asyncio.run(main())
    assert tokens == want[1] and not last.prefilled_remotely
    assert stats.transfer_failures >= 1 and pending == [] and stats.free_blocks == stats.num_blocks


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

    from pdserve.prefill_worker.service import PrefillServicer

    async def main():
        async with Cluster(make_engine) as c:
            eng, ae = c.prefill_engine, c.prefill.engine
            in_step, go_on = threading.Event(), threading.Event()
            export = eng.export_kv

            def export_then_stall(rid):  # engine thread: the next command in line is a long "step"
                out = export(rid)
                ae.call(lambda e: (in_step.set(), go_on.wait(10)))
                return out
            eng.export_kv = export_then_stall
            req = pb.PrefillRequest(request_id="p", prompt_token_ids=PROMPTS[1], kv_address="127.0.0.1:1",
                                    params=params_to_proto(PARAMS[0]), dest_block_ids=[0, 1, 2])
            task = asyncio.ensure_future(PrefillServicer(c.prefill).Prefill(req, None))
            await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 10)
            for _ in range(500):  # the handler has queued the release behind the stall
                if ae._commands.qsize():
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            go_on.set()
            assert await ae.run(lambda e: (e.blocks.num_used_blocks, dict(e._held))) == (0, {})

    asyncio.run(main())
