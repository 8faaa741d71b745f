"""Prefill and decode services over real gRPC on loopback (tiny model, one process): the
disaggregated path gives the single-engine tokens across transports, KV formats, block sizes
and layer-wise streaming, and every block comes back (failures: test_workers_failures.py)."""
from __future__ import annotations

import asyncio
import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.protos import worker_pb2 as pb
from pdserve.protos.convert import params_to_proto
from pdserve.protos.security import stats_request
from tests.helpers.workers import Cluster, PROMPTS, PARAMS, expected


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


def test_a_hand_off_waiting_for_blocks_asks_less_often_while_more_urgent_work_steps():
    """Each ask for blocks is a command on the engine thread between two steps: while the engine
    steps for more urgent work than the hand-off's, it asks 4x less often; otherwise (as urgent,
    or the hand-off more urgent) as before."""
    from pdserve.decode_worker.service import BLOCKS_RETRY_S, BLOCKS_RETRY_URGENT_S, blocks_retry_s

    assert blocks_retry_s(-10, 0) == BLOCKS_RETRY_URGENT_S == 4 * BLOCKS_RETRY_S
    assert blocks_retry_s(0, 0) == blocks_retry_s(0, -10) == blocks_retry_s(5, 0) == BLOCKS_RETRY_S


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
