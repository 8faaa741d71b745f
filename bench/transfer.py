"""`pdserve bench-transfer`: KV hand-off throughput, gRPC vs UCX vs a local memory copy, for
prompts of 1k/4k/16k tokens of the default model's KV layout (fp32). The receiver runs in its
own process (a decode worker's KV server with a real lease, header and checksum checks), the
sender in this one; each figure is the median of --repeats pushes. Writes JSON."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

LAYOUT = (30, 2, 16, 3, 64)  # SmolLM2-135M: layers, K/V, block size, KV heads, head dim


def add_bench_transfer_args(p) -> None:
    p.add_argument("--tokens", default="1024,4096,16384", help="prompt lengths (comma-separated)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="grpc,ucx")
    p.add_argument("--layerwise-prompt", type=int, default=2048,
                   help="also time TTFT of a prompt this long with whole vs layer-wise KV pushes (0: skip)")
    p.add_argument("--layer-group", type=int, default=5, help="layers per push when streaming")
    p.add_argument("--output", default="bench/transfer-results.json")
    p.set_defaults(func=cmd_bench_transfer)


def _receiver(conn, kind: str) -> None:
    """The decode side, in its own process: a KV server and its receiver, driven over `conn`."""
    from pdserve.kv_transfer.receiver import KVReceiver

    async def main():
        rx = KVReceiver("bench", LAYOUT)
        if kind == "ucx":
            from pdserve.kv_transfer.ucx_transport import UcxKVServer
            server = UcxKVServer(rx)
        else:
            from pdserve.kv_transfer.grpc_transport import GrpcKVServer
            server = GrpcKVServer(rx)
        conn.send(await server.start())
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "expect":
                rx.expect(msg[1], msg[2], msg[3], timeout_s=600)
                conn.send("ok")
            elif msg[0] == "take":
                arrival = rx.take(msg[1])
                conn.send(None if arrival is None else float(arrival.kv[-1, -1, -1].sum()))
            else:
                break
        await server.stop()
    asyncio.run(main())


def _kv(tokens: int):
    import torch

    blocks = -(-tokens // LAYOUT[2])
    L, two, bs, h, d = LAYOUT
    return torch.randn(L, two, blocks, bs, h, d, generator=torch.Generator().manual_seed(tokens))


def _bench_wire(kind: str, sizes: list[int], repeats: int) -> dict:
    from pdserve.kv_transfer.senders import SchemeKVSender

    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(child, kind), daemon=True)
    proc.start()
    out = {}
    try:
        addr = parent.recv()

        async def run():
            sender = SchemeKVSender("bench-prefill")
            try:
                for tokens in sizes:
                    kv = _kv(tokens)
                    nbytes = kv.numel() * 4
                    times = []
                    for r in range(repeats + 1):  # the first push warms the connection up
                        rid, dest = f"{tokens}-{r}", list(range(kv.shape[2]))
                        parent.send(("expect", rid, dest, tokens))
                        parent.recv()
                        t = time.perf_counter()
                        await sender.push(addr, rid, kv, dest_block_ids=dest, num_tokens=tokens, first_token=1,
                                          model_fingerprint="bench", timeout_s=300)
                        times.append(time.perf_counter() - t)
                        parent.send(("take", rid))
                        assert abs(parent.recv() - float(kv[-1, -1, -1].sum())) < 1e-3, "KV arrived altered"
                    med = statistics.median(times[1:])
                    out[tokens] = {"bytes": nbytes, "seconds": med, "GB_per_s": nbytes / med / 1e9}
            finally:
                await sender.close()
        asyncio.run(run())
    finally:
        parent.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def _bench_memcpy(sizes: list[int], repeats: int) -> dict:
    out = {}
    for tokens in sizes:
        kv = _kv(tokens)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            kv.clone()
            times.append(time.perf_counter() - t)
        med = statistics.median(times[1:])
        out[tokens] = {"bytes": kv.numel() * 4, "seconds": med, "GB_per_s": kv.numel() * 4 / med / 1e9}
    return out


def _bench_layerwise(prompt_len: int, group: int, repeats: int) -> dict:
    """TTFT of one prompt through a real prefill worker and decode worker (gRPC, one engine
    thread each), KV pushed after the whole prompt vs every `group` layers."""
    import grpc

    from pdserve.decode_worker.service import DecodeWorker
    from pdserve.engine.core.async_engine import AsyncEngine
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.model.weights import load_model
    from pdserve.kv_transfer.config import TransferConfig
    from pdserve.kv_transfer.senders import SchemeKVSender
    from pdserve.prefill_worker.service import PrefillWorker
    from pdserve.protos import worker_pb2 as pb
    from pdserve.protos import worker_pb2_grpc as pb_grpc
    from pdserve.protos.convert import params_to_proto

    loaded = load_model()
    cfg = EngineConfig(num_threads=1, cache=CacheConfig(kv_cache_memory=512 << 20))

    async def run():
        workers = {g: (PrefillWorker(AsyncEngine(LLMEngine(loaded, cfg)), SchemeKVSender(f"p{g}"), f"p{g}",
                                     transfer=TransferConfig(layer_group=g)), DecodeWorker(AsyncEngine(LLMEngine(loaded, cfg)), f"d{g}"))
                   for g in (0, group)}
        for p, d in workers.values():
            await p.start()
            await d.start()
        ttft: dict[int, list[float]] = {0: [], group: []}
        try:
            for r in range(repeats + 1):  # interleaved; the first round warms up
                for g, (p, d) in workers.items():
                    prompt = [(r * 7919 + g * 104729 + i * 31) % 40000 + 100 for i in range(prompt_len)]
                    async with grpc.aio.insecure_channel(d.address) as ch:
                        t = time.perf_counter()
                        call = pb_grpc.DecodeServiceStub(ch).Generate(pb.GenerateRequest(
                            request_id=f"lw{r}-{g}", prompt_token_ids=prompt, prefill_address=p.address,
                            params=params_to_proto(SamplingParams(max_tokens=1, temperature=0))))
                        async for _ in call:
                            break
                        if r:
                            ttft[g].append(time.perf_counter() - t)
                        call.cancel()
        finally:
            for p, d in workers.values():
                await d.stop()
                await p.stop()
        return ttft
    ttft = asyncio.run(run())
    whole, streamed = statistics.median(ttft[0]), statistics.median(ttft[group])
    return {"prompt_tokens": prompt_len, "layer_group": group, "ttft_whole_s": whole, "ttft_layerwise_s": streamed,
            "saved_s": whole - streamed, "saved_fraction": (whole - streamed) / whole}


def cmd_bench_transfer(args) -> int:
    sizes = [int(x) for x in args.tokens.split(",")]
    results = {"memcpy": _bench_memcpy(sizes, args.repeats)}
    for kind in args.transports.split(","):
        results[kind] = _bench_wire(kind, sizes, args.repeats)
    print(f"{'tokens':>7} {'MB':>7} " + " ".join(f"{k + ' GB/s':>12}" for k in results))
    for tokens in sizes:
        mb = results["memcpy"][tokens]["bytes"] / 1e6
        print(f"{tokens:7d} {mb:7.0f} " + " ".join(f"{results[k][tokens]['GB_per_s']:12.2f}" for k in results))
    if args.layerwise_prompt:
        lw = results["layerwise"] = _bench_layerwise(args.layerwise_prompt, args.layer_group, args.repeats)
        print(f"TTFT of a {lw['prompt_tokens']}-token prompt: {lw['ttft_whole_s']:.3f} s with the KV pushed at the end, "
              f"{lw['ttft_layerwise_s']:.3f} s pushed every {lw['layer_group']} layers: "
              f"{lw['saved_s'] * 1e3:.0f} ms saved ({lw['saved_fraction']:.1%})")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.output}")
    return 0
