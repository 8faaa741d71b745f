"""Prometheus metrics of one router (its own registry: no process-wide state): the
`pdserve_*` series, and the same meanings under vLLM's names (vllm_metrics.py)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .vllm_metrics import VllmMetrics

_BYTES = tuple(float(1 << n) for n in range(16, 32, 2))  # 64 KiB .. 1 GiB, x4
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, model_name: str = "default"):
        r = self.registry = CollectorRegistry()
        self.vllm = VllmMetrics(r, model_name)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between streamed tokens", registry=r, buckets=_LATENCY)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Mean time per output token after the first",
                              registry=r, buckets=_LATENCY)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request latency", registry=r, buckets=_LATENCY)
        self.queue = Histogram("pdserve_request_queue_seconds", "Time from arrival to being routed", registry=r,
                               buckets=_LATENCY)
        self.requests = Counter("pdserve_requests", "Requests by status", ["status"], registry=r)
        self.rejected = Counter("pdserve_rejected_requests", "Requests refused with 429, by reason "
                                "(router_inflight: --max-inflight; pool_full: every worker of a pool at its queue limit)",
                                ["reason"], registry=r)
        self.stalled_streams = Counter("pdserve_stalled_streams", "Streams cut off and aborted: the client read "
                                       "nothing for --stream-stall-timeout", registry=r)
        self.migrations = Counter("pdserve_migrations", "Requests moved to another decode worker after a failure",
                                  registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", registry=r)
        self.kv_usage = Gauge("pdserve_kv_usage_ratio", "KV blocks in use", ["worker", "role"], registry=r)
        self.prefix_queries = Gauge("pdserve_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache "
                                    "by the worker that computes the prompt",
                                    ["worker", "role"], registry=r)
        self.prefix_hits = Gauge("pdserve_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache",
                                 ["worker", "role"], registry=r)
        self.running = Gauge("pdserve_running_requests", "Requests running on a worker", ["worker", "role"], registry=r)
        self.waiting = Gauge("pdserve_waiting_requests", "Requests queued on a worker", ["worker", "role"], registry=r)
        self.kv_bytes = Gauge("pdserve_kv_transfer_bytes", "KV bytes pushed (prefill) or received (decode) by a "
                              "worker since it started", ["worker", "role"], registry=r)
        self.kv_seconds = Gauge("pdserve_kv_transfer_seconds", "Time a prefill worker spent pushing KV since it "
                                "started (rate of bytes / rate of seconds: transfer GB/s)", ["worker", "role"], registry=r)
        self.decode_prefills = Gauge("pdserve_decode_prefills", "Prompts a decode worker took since it started, by where "
                                     "they were prefilled (remote: a prefill worker; local: itself)",
                                     ["worker", "where"], registry=r)
        self.kv_request_bytes = Histogram("pdserve_kv_transfer_request_bytes", "KV bytes a remotely prefilled "
                                          "request's prompt arrived with (its blocks not cached on the decode worker)",
                                          registry=r, buckets=_BYTES)
        self.kv_cache_info = Gauge("pdserve_kv_cache_info", "1 per worker, labelled with the dtype its KV cache holds",
                                   ["worker", "role", "kv_cache_dtype"], registry=r)
        # where a remotely prefilled request's time to first token went, as the workers measured it
        self.handoff_seconds = {
            field: Histogram(f"pdserve_{field.removesuffix('_s')}_seconds", doc, registry=r, buckets=_LATENCY)
            for field, doc in (("blocks_wait_s", "Time a request waited on its decode worker for free KV blocks"),
                               ("prefill_queue_s", "Time a prompt queued on its prefill worker"),
                               ("prefill_compute_s", "Time a prefill worker computed a prompt"),
                               ("kv_push_s", "Time a prefill worker pushed a prompt's KV after computing it"))}
        self.kv_failures = Gauge("pdserve_kv_transfer_failures", "Failed KV hand-offs seen by a worker since it started",
                                 ["worker", "role"], registry=r)

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.vllm.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.itl.observe(seconds)

    def finished(self, e2e_s: float, ttft_s: float, completion_tokens: int, status: str) -> None:
        self.e2e.observe(e2e_s)
        self.vllm.e2e.observe(e2e_s)
        self.generation_tokens.inc(completion_tokens)
        self.vllm.generation_tokens.inc(completion_tokens)
        if completion_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1))
        self.requests.labels(status).inc()

    def handoff(self, timing) -> None:
        """A remotely prefilled request's HandoffTiming (from its first response)."""
        for field, hist in self.handoff_seconds.items():
            hist.observe(getattr(timing, field))

    def observe_workers(self, stats: dict) -> None:
        self.vllm.observe_workers(stats)
        for wid, s in stats.items():
            labels = (wid, s.role)
            self.kv_usage.labels(*labels).set(s.kv_usage)
            self.prefix_queries.labels(*labels).set(s.prefix_queries)
            self.prefix_hits.labels(*labels).set(s.prefix_hits)
            self.running.labels(*labels).set(s.running)
            self.waiting.labels(*labels).set(s.waiting)
            self.kv_bytes.labels(*labels).set(s.kv_bytes)
            self.kv_seconds.labels(*labels).set(s.kv_seconds)
            self.kv_failures.labels(*labels).set(s.transfer_failures)
            if s.kv_cache_dtype:
                self.kv_cache_info.labels(*labels, s.kv_cache_dtype).set(1)
            if s.role != "prefill":
                self.decode_prefills.labels(wid, "remote").set(s.remote_prefills)
                self.decode_prefills.labels(wid, "local").set(s.local_prefills)

    def render(self) -> bytes:
        return generate_latest(self.registry)
