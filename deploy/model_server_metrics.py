"""Each worker's own Prometheus `/metrics`: the model-server series of the Gateway API Inference
Extension (what a Kubernetes endpoint picker scores a pod by) under vLLM's names, so that a
picker written for vLLM scores pdserve's pods as they are:

- `vllm:num_requests_waiting`, `vllm:num_requests_running` (gauges, label `model_name`);
- `vllm:kv_cache_usage_perc` (gauge, 0..1 of the KV blocks in use);
- `vllm:cache_config_info` (info gauge, 1: block_size, cache_dtype, num_gpu_blocks);
- `vllm:lora_requests_info` (vLLM's gauge: labels `running_lora_adapters`, `waiting_lora_adapters`
  (comma-separated adapter names), `max_lora`; its value the time of the reading).

and pdserve's own `pdserve:step_threads` (gauge: the threads the engine thread's last step ran
on, its own plus those borrowed from idle peers on its host, engine/parallel/cores.py) and
`pdserve:step_seconds` (histogram of the engine's steps, label `contended`: "true" for a step of
a more urgent request beside less urgent ones here, which the step budget bounds; label
`window`: "true" for a step of less urgent work within the urgent window, which `window_step_s`
bounds; engine/core/step_cost.py), and `pdserve:computed_tokens_total` (counter, label `kind`:
prompt or decode tokens its steps computed, as they run), and `pdserve:yielded_seconds_total`
(counter: seconds the worker stood aside for a peer's more urgent steps on its host, idle
between its steps or paused at a layer's end; engine/parallel/cores.py) and
`pdserve:peer_wait_seconds_total` and `pdserve:peer_waits_out_total` (counters: seconds the
worker's urgent steps waited for less urgent peers to lend their cores, and the waits that ran
out) and `pdserve:stopped_steps_total` (counter: steps of less urgent work stopped at a layer's end for
a more urgent request, long ones in the Python layer loop and short ones in the one-call native
step, engine/core/kv_hooks.py).

A mixture-of-experts model adds its expert load: `pdserve:moe_expert_tokens_total` (counter,
labels `model_name`, `expert`, `rank`: the (token, expert) pairs routed to the expert since
the worker started, summed over the MoE layers, a pipeline's every stage's; `rank` the expert-parallel rank that holds
it, 0 without expert parallelism) and `pdserve:moe_rank_tokens_total` (counter, labels
`model_name`, `rank`: the same summed over each rank's experts). A token counts once for
each of its top-k experts.

A small prometheus_client HTTP server per worker process; its port is in the worker's registry
record (`WorkerRecord.metrics_port`) and its Stats (`/admin/workers`). Each scrape reads the
engine on its own thread between two steps (`AsyncEngine.call`), so the numbers are one
consistent snapshot.
"""
from __future__ import annotations

import time

import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdserve.engine.core.step_cost import BUCKETS
from pdserve.engine.parallel.ep import expert_load

SCRAPE_TIMEOUT_S = 5.0  # a scrape waits for the step in progress (a long prefill chunk), not longer


def _snapshot(engine) -> dict:
    """On the engine thread: the numbers one scrape reports."""
    sched, blocks = engine.scheduler, engine.blocks

    def names(requests) -> str:
        return ",".join(sorted({r.lora.name for r in requests if r.lora is not None}))
    waiting = list(sched.waiting) + list(sched.remote.values())
    return {"running": len(sched.running), "waiting": len(waiting),
            "kv_usage": 1.0 - blocks.num_free_blocks / max(blocks.num_blocks, 1),
            "block_size": blocks.block_size, "num_blocks": blocks.num_blocks,
            "cache_dtype": engine.kv_cache.format.name, "max_lora": engine.config.lora.max_loras,
            "running_loras": names(sched.running), "waiting_loras": names(waiting),
            "threads": torch.get_num_threads(),  # this thread's: what its steps run on
            "computed": dict(sched.computed), "steps": sched.times.snapshot(), "stopped": sched.stopped_steps,
            "experts": expert_load(engine.runner.model, _ep(engine), engine.kv_cache)}


def _cores(async_engine) -> tuple[float, float, int]:
    """(seconds stood aside for peers, seconds urgent steps waited for peers, waits that ran out)."""
    cores = getattr(async_engine, "cores", None)
    return (0.0, 0.0, 0) if cores is None else (cores.yielded_s, cores.peer_wait_s, cores.peer_waits_out)


def _ep(engine) -> int:
    """The engine's expert-parallel degree (1: its experts are all its own)."""
    group = engine.tp
    return group.tp if group is not None and group.expert else 1


class ModelServerCollector:
    """The series above, read from one AsyncEngine at each scrape."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.call(_snapshot).result(timeout=SCRAPE_TIMEOUT_S)
        s["yielded_s"], s["peer_wait_s"], s["peer_waits_out"] = _cores(self.engine)
        held = getattr(self.engine, "held", None)
        s["held"] = (0, 0.0) if held is None else (held.held, held.held_s)
        m = [self.model_name]
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", s["running"]),
                ("vllm:num_requests_waiting", "Requests waiting for a place in the batch or for their KV.",
                 s["waiting"]),
                ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s["kv_usage"])):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                              labels=["block_size", "cache_dtype", "num_gpu_blocks"])
        g.add_metric([str(s["block_size"]), s["cache_dtype"], str(s["num_blocks"])], 1.0)
        yield g
        g = GaugeMetricFamily("pdserve:step_threads", "Threads of the last step (own and borrowed from idle "
                              "peers on this host).", labels=["model_name"])
        g.add_metric(m, s["threads"])
        yield g
        c = CounterMetricFamily("pdserve:computed_tokens", "Tokens the engine's steps have computed: kind prompt "
                                "(chunks of more than one token) or decode.", labels=["model_name", "kind"])
        for kind, n in s["computed"].items():
            c.add_metric([self.model_name, kind], n)
        yield c
        c = CounterMetricFamily("pdserve:yielded_seconds", "Seconds this worker stood aside for a peer's more "
                                "urgent steps on its host (idle between steps, or paused at a layer's end).",
                                labels=["model_name"])
        c.add_metric(m, s["yielded_s"])
        yield c
        c = CounterMetricFamily("pdserve:peer_wait_seconds", "Seconds this worker's urgent steps waited for less "
                                "urgent peers on its host to lend their cores.", labels=["model_name"])
        c.add_metric(m, s["peer_wait_s"])
        yield c
        c = CounterMetricFamily("pdserve:peer_waits_out", "Times such a wait ran out: the urgent step ran on the "
                                "worker's own threads.", labels=["model_name"])
        c.add_metric(m, s["peer_waits_out"])
        yield c
        c = CounterMetricFamily("pdserve:held_commands", "Commands (adds, KV imports, asks for blocks) of less "
                                "urgent requests held back while the engine stepped for more urgent work.",
                                labels=["model_name"])
        c.add_metric(m, s["held"][0])
        yield c
        c = CounterMetricFamily("pdserve:held_command_seconds", "Seconds the held commands waited, in all.",
                                labels=["model_name"])
        c.add_metric(m, s["held"][1])
        yield c
        c = CounterMetricFamily("pdserve:stopped_steps", "Steps of less urgent work stopped at a layer's end "
                                "for a more urgent request (they run again).", labels=["model_name"])
        c.add_metric(m, s["stopped"])
        yield c
        h = HistogramMetricFamily("pdserve:step_seconds", "Seconds of each engine step; contended: a more urgent "
                                  "request's step beside less urgent ones here; window: a step of less urgent work "
                                  "within the urgent window.", labels=["model_name", "contended", "window"])
        for kind, (counts, total) in s["steps"].items():
            h.add_metric([self.model_name, str(kind == "contended").lower(), str(kind == "window").lower()],
                         [(str(edge) if edge != float("inf") else "+Inf", n) for edge, n in zip(BUCKETS, counts)], total)
        yield h
        yield from self._experts(s["experts"])
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                              labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        g.add_metric([s["running_loras"], s["waiting_loras"], str(s["max_lora"])], time.time())
        yield g

    def _experts(self, load: list[tuple[int, int, int]]):
        if not load:
            return
        c = CounterMetricFamily("pdserve:moe_expert_tokens", "(Token, expert) pairs routed to each expert, over "
                                "the MoE layers; rank: the expert-parallel rank that holds it.",
                                labels=["model_name", "expert", "rank"])
        per_rank: dict[int, int] = {}
        for expert, rank, n in load:
            c.add_metric([self.model_name, str(expert), str(rank)], n)
            per_rank[rank] = per_rank.get(rank, 0) + n
        yield c
        c = CounterMetricFamily("pdserve:moe_rank_tokens", "(Token, expert) pairs routed to each expert-parallel "
                                "rank's experts.", labels=["model_name", "rank"])
        for rank, n in sorted(per_rank.items()):
            c.add_metric([self.model_name, str(rank)], n)
        yield c


class ModelServerMetrics:
    """The worker's /metrics server (start / stop); `port` once started."""

    def __init__(self, engine, model_name: str, host: str = "0.0.0.0", port: int = 0):
        """port 0: any free port (several workers on one host); the one taken is `port`."""
        self.registry = CollectorRegistry()
        self.registry.register(ModelServerCollector(engine, model_name))
        self.host, self.port = host, port
        self._server = None

    def start(self) -> int:
        self._server, _ = start_http_server(self.port, self.host, registry=self.registry)
        self.port = self._server.server_address[1]
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
