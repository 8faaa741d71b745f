"""The router's metrics under vLLM's names (`vllm:*`, labelled `model_name` as vLLM labels
them), next to the `pdserve_*` ones, so that dashboards, KEDA/HPA rules and aiperf's
server-metrics view written for vLLM read a pdserve cluster unchanged.

Request latencies and token counts are observed here as the router sees them; the per-worker
series (running, waiting, KV usage, prefix-cache queries and hits) come from each worker's
last `Stats`, labelled `engine` (the worker id) and `role`. The prefix-cache series are
counters: the workers count since they started, and a restarted worker resets them, as a
restarted vLLM engine does.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from .worker_metrics import Series, WorkerSeries, field

# vLLM's default buckets for these histograms (vllm/v1/metrics/buckets.py, vLLM 0.32)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
VLLM_WORKER_SERIES = (
    Series("vllm:num_requests_running", "Requests in the worker's running batch", "gauge", field("running")),
    Series("vllm:num_requests_waiting", "Requests waiting on the worker", "gauge", field("waiting")),
    Series("vllm:kv_cache_usage_perc", "KV cache usage of the worker (1 = full)", "gauge", field("kv_usage")),
    Series("vllm:prefix_cache_queries", "Prompt tokens looked up in the worker's prefix cache", "counter",
           field("prefix_queries")),
    Series("vllm:prefix_cache_hits", "Prompt tokens found in the worker's prefix cache", "counter",
           field("prefix_hits")),
    Series("vllm:spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding", "counter",
           lambda s: [((), float(s.spec_proposed))] if s.speculation else []),
    Series("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted", "counter",
           lambda s: [((), float(s.spec_accepted))] if s.speculation else []))


class VllmMetrics:
    """The vLLM-named series in the router's registry `r`."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels, registry=r,
                              buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between streamed tokens", labels, registry=r,
                             buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency", labels, registry=r,
                             buckets=E2E_BUCKETS).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels,
                                         registry=r).labels(model_name)
        self.workers = WorkerSeries(r, VLLM_WORKER_SERIES, ("model_name", "engine", "role"),
                                    lambda wid, s: [model_name, wid, s.role])

    def observe_workers(self, stats: dict) -> None:
        self.workers.observe(stats)
