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
    p.add_argument("--output", default="bench/transfer-results.json")
    p.set_defaults(func=cmd_bench_transfer)


def _receiver(conn, kind: str) -> None:
    """The decode side, in its own process: a KV server and its receiver, driven over `conn`."""
    from kv_transfer.receiver import KVReceiver

    async def main():
        rx = KVReceiver("bench", LAYOUT)
        if kind == "ucx":
            from kv_transfer.ucx_transport import UcxKVServer
            server = UcxKVServer(rx)
        else:
            from kv_transfer.grpc_transport import GrpcKVServer
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
    from kv_transfer.senders import SchemeKVSender

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


def cmd_bench_transfer(args) -> int:
    sizes = [int(x) for x in args.tokens.split(",")]
    results = {"memcpy": _bench_memcpy(sizes, args.repeats)}
    for kind in args.transports.split(","):
        results[kind] = _bench_wire(kind, sizes, args.repeats)
    print(f"{'tokens':>7} {'MB':>7} " + " ".join(f"{k + ' GB/s':>12}" for k in results))
    for tokens in sizes:
        mb = results["memcpy"][tokens]["bytes"] / 1e6
        print(f"{tokens:7d} {mb:7.0f} " + " ".join(f"{results[k][tokens]['GB_per_s']:12.2f}" for k in results))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.output}")
    return 0
