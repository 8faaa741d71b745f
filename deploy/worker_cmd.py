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

from pdserve.config import WorkerConfig

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


def run_worker(config: WorkerConfig) -> int:
    """Serve until Ctrl-C or SIGTERM, then drain for up to `config.drain_timeout_s` and exit."""
    import torch

    from pdserve.common.threads import in_fresh_thread, single_threaded_here

    from .router_server import make_logger
    from .worker_host import HostedWorker, load_worker_model

    log = make_logger(time.monotonic())
    if config.engine.num_threads:
        torch.set_num_threads(config.engine.num_threads)

    def build() -> HostedWorker:
        return HostedWorker(config, *load_worker_model(config.engine), exit_on_engine_death=True)

    host = in_fresh_thread(build)  # the engine thread's OpenMP team is then the only one (common/threads.py)

    async def main():
        single_threaded_here()  # this loop's tensor ops (KV landing) must not open a 2nd OpenMP team
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, stop)
        record = await host.start()
        log(f"{config.role} worker {config.worker_id} (pid {os.getpid()}) on {record.address}"
            + (f", KV on {record.kv_address}" if record.kv_address else ""))
        print(f"ready {record.address}", flush=True)
        await stop.wait()
        drain_timeout_s = config.drain_timeout_s
        shutdown_watchdog(drain_timeout_s + STOP_GRACE_S)
        log(f"draining (up to {drain_timeout_s:g}s)")
        if not await host.drain(drain_timeout_s):
            log(f"requests still in flight after {drain_timeout_s:g}s: {host.describe_busy()}; stopping anyway")
        await host.stop()
        log("stopped")

    asyncio.run(main())
    # Everything this process holds is released above (registry key, gRPC, engine thread, KV).
    # Interpreter teardown would only add waits on library threads and C++ destructors
    # (torch, gRPC, libgomp) that no watchdog covers: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
