"""`pdserve worker`: one prefill or decode worker as a plain process, without Ray. It loads
the model, serves its gRPC services on --host (the address other hosts reach it at),
registers in Redis and sends its KV events there, until Ctrl-C or SIGTERM. For hosts that
run no Ray (a VM per pool, a network namespace in the tests), next to `pdserve router`."""
from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import time


def add_worker_args(p) -> None:
    p.add_argument("--role", choices=("prefill", "decode", "aggregated"), required=True)
    p.add_argument("--worker-id", required=True, help="unique in the cluster, e.g. prefill-host3")
    p.add_argument("--host", default="127.0.0.1", help="bind and advertise address of its services")
    p.add_argument("--redis-url", default=os.environ.get("PDSERVE_REDIS_URL", ""),
                   help="the cluster's registry (env PDSERVE_REDIS_URL)")
    p.add_argument("--cluster-name", required=True)
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""))
    p.add_argument("--transfer-policy", choices=("recompute", "fail"), default="recompute")
    p.add_argument("--kv-transport", choices=("grpc", "ucx"), default="grpc", help="decode workers: receive KV over")
    p.add_argument("--kv-layer-group", type=int, default=0, help="prefill workers: push KV every N layers (0: at the end)")
    p.add_argument("--max-queue", type=int, default=64, help="requests queued here before it refuses more")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C/SIGTERM: seconds the requests in flight get to finish (then the router migrates them)")
    p.set_defaults(func=cmd_worker)


STOP_GRACE_S = 30.0  # what stopping may take after the drain: gRPC grace, Redis timeouts, engine thread


def on_signal(stop: asyncio.Event) -> None:
    """First Ctrl-C/SIGTERM: drain and stop. A second one: exit now (requests in flight are
    cut off; the router migrates their streams)."""
    if stop.is_set():
        print("second signal: exiting now", file=sys.stderr, flush=True)
        os._exit(130)
    stop.set()


def shutdown_watchdog(timeout_s: float) -> None:
    """A process asked to stop exits within `timeout_s` whatever it is waiting on: past it,
    every thread's stack goes to stderr (what it was stuck on) and the process exits with 1.
    The watchdog is a C thread, so it fires through interpreter shutdown too."""
    faulthandler.dump_traceback_later(timeout_s, exit=True)


def cmd_worker(args) -> int:
    import torch

    from pdserve.engine.threads import in_fresh_thread, single_threaded_here
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.engine.weights import load_for_config

    from .cli import engine_config
    from .router_server import make_logger
    from .worker_host import HostedWorker, WorkerSpec

    if not args.redis_url:
        raise ValueError("pdserve worker needs the cluster's registry: --redis-url (or PDSERVE_REDIS_URL)")
    log = make_logger(time.monotonic())
    cfg = engine_config(args)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    spec = WorkerSpec(args.role, args.worker_id, args.cluster_name, args.redis_url, args.cluster_token, args.host,
                      args.transfer_policy, max_queue=args.max_queue, kv_transport=args.kv_transport,
                      kv_layer_group=args.kv_layer_group, engine=cfg)

    def build() -> HostedWorker:
        loaded = load_for_config(cfg)
        return HostedWorker(spec, loaded, Tokenizer.from_model_path(loaded.path))

    host = in_fresh_thread(build)  # the engine thread's OpenMP team is then the only one (engine/threads.py)

    async def main():
        single_threaded_here()  # this loop's tensor ops (KV landing) must not open a 2nd OpenMP team
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, stop)
        record = await host.start()
        log(f"{args.role} worker {args.worker_id} (pid {os.getpid()}) on {record.address}"
            + (f", KV on {record.kv_address}" if record.kv_address else ""))
        print(f"ready {record.address}", flush=True)
        await stop.wait()
        shutdown_watchdog(args.drain_timeout + STOP_GRACE_S)
        log(f"draining (up to {args.drain_timeout:g}s)")
        if not await host.drain(args.drain_timeout):
            log(f"requests still in flight after {args.drain_timeout:g}s: {host.describe_busy()}; stopping anyway")
        await host.stop()
        log("stopped")

    asyncio.run(main())
    # Everything this process holds is released above (registry key, gRPC, engine thread, KV).
    # Interpreter teardown would only add waits on library threads and C++ destructors
    # (torch, gRPC, libgomp) that no watchdog covers: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
