"""Prometheus metrics of one router (its own registry: no process-wide state): the
`pdserve_*` series, and the same meanings under vLLM's names (vllm_metrics.py)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .vllm_metrics import VllmMetrics
from .worker_metrics import PDSERVE_SERIES, WorkerSeries

_BYTES = tuple(float(1 << n) for n in range(16, 32, 2))  # 64 KiB .. 1 GiB, x4
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, model_name: str = "default", held=None):
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
                                "(router_inflight: past --max-inflight, the router's queue full or waited "
                                "--queue-timeout; pool_full: every worker of a pool at its queue limit)",
                                ["reason"], registry=r)
        self.stalled_streams = Counter("pdserve_stalled_streams", "Streams cut off and aborted: the client read "
                                       "nothing for --stream-stall-timeout", registry=r)
        self.migrations = Counter("pdserve_migrations", "Requests moved to another decode worker after a failure",
                                  registry=r)
        self.placements = Counter("pdserve_prompt_placements", "Prompts computed, by where: prefill_pool; "
                                  "decode_urgent (the decode worker, for a short prompt more urgent than every "
                                  "stream there); decode_load (the decode worker, for a deep prefill queue or an "
                                  "idle decode worker); decode (no prefill pool)", ["where"], registry=r)
        for where in ("prefill_pool", "decode_urgent", "decode_load", "decode"):
            self.placements.labels(where)
        for status in ("stop", "length", "abort", "timeout", "error", "rejected"):  # 0, not "no data", until seen
            self.requests.labels(status)
        for reason in ("router_inflight", "pool_full"):
            self.rejected.labels(reason)
        self.class_waiting = Gauge("pdserve_class_waiting_requests", "Admitted requests without their first token "
                                   "yet, by priority band (high < 0, default 0, low, sheddable) and tenant",
                                   ["priority", "tenant"], registry=r)
        self.router_queue = Gauge("pdserve_router_queue_requests", "Requests waiting in the router's queue "
                                  "(past --max-inflight), by priority band", ["priority"], registry=r)
        self.held_prompts = Gauge("pdserve_held_prompts_now", "Admitted prompts the router holds while every place "
                                  "to compute them is busy (router/holding.py)", registry=r)
        self.held_total = Counter("pdserve_held_prompts", "Prompts the router held (router/holding.py)", registry=r)
        if held is not None:  # the cluster's HeldPrompts
            self.held_prompts.set_function(lambda: len(held))
            held.on_hold = self.held_total.inc
        self.class_wait = Histogram("pdserve_class_wait_seconds", "Time to first token by priority band and tenant",
                                    ["priority", "tenant"], registry=r, buckets=_LATENCY)
        self.usage_tokens = Counter("pdserve_usage_tokens", "Tokens used, for charge-back: prompt (cached ones "
                                    "counted again apart), and completion; by tenant, operator key and model",
                                    ["tenant", "key", "model", "kind"], registry=r)
        self.usage_requests = Counter("pdserve_usage_requests", "Requests served (n choices: one), by tenant, "
                                      "operator key and model", ["tenant", "key", "model"], registry=r)
        self.budget_refusals = Counter("pdserve_budget_refusals", "Requests refused or ended by a budget: "
                                       "tenant_inflight, tenant_tokens (429 for one tenant), shed (a sheddable "
                                       "request while the pool is saturated), prompt_chars (longer than any "
                                       "worker holds, refused before tokenizing)", ["budget"], registry=r)
        for budget in ("tenant_inflight", "tenant_tokens", "shed", "prompt_chars"):
            self.budget_refusals.labels(budget)
        self._tenants: set[str] = set()
        self.model_name = model_name
        self.model_requests = Counter("pdserve_model_requests", "Requests finished by the model they named (the "
                                      "base model, or a LoRA adapter: the first 32 adapter names seen, the rest "
                                      "as 'other') and status", ["model", "status"], registry=r)
        self._adapters: set[str] = set()
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", registry=r)
        self.workers = WorkerSeries(r, PDSERVE_SERIES, ("worker", "role"), lambda wid, s: [wid, s.role])
        self.kv_request_bytes = Histogram("pdserve_kv_transfer_request_bytes", "KV bytes a remotely prefilled "
                                          "request's prompt arrived with (its blocks not cached on the decode worker)",
                                          registry=r, buckets=_BYTES)
        # where a remotely prefilled request's time to first token went, as the workers measured it
        self.handoff_seconds = {
            field: Histogram(f"pdserve_{field.removesuffix('_s')}_seconds", doc, registry=r, buckets=_LATENCY)
            for field, doc in (("blocks_wait_s", "Time a request waited on its decode worker for free KV blocks"),
                               ("prefill_queue_s", "Time a prompt queued on its prefill worker"),
                               ("prefill_compute_s", "Time a prefill worker computed a prompt"),
                               ("kv_push_s", "Time a prefill worker pushed a prompt's KV after computing it"))}

    def usage(self, tenant: str, key: str, lora: str, prompt: int, cached: int, completion: int,
              requests: int) -> None:
        """What a request used, for charge-back: its prompt (cached part apart) and completion
        tokens, and the request, by tenant, operator key and model (bounded label sets)."""
        labels = (self.tenant_label(tenant), key or "-", self.model_label(lora))
        for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            if n:
                self.usage_tokens.labels(*labels, kind).inc(n)
        if requests:
            self.usage_requests.labels(*labels).inc(requests)

    def tenant_label(self, tenant: str, limit: int = 32) -> str:
        """A bounded label set: the first `limit` tenants seen by name, the rest as "other"."""
        if tenant not in self._tenants and len(self._tenants) < limit:
            self._tenants.add(tenant)
        return (tenant or "default") if tenant in self._tenants else "other"

    def model_label(self, lora: str, limit: int = 32) -> str:
        """A bounded label set: the base model's name, the first `limit` adapters seen, "other"."""
        if not lora:
            return self.model_name
        if lora not in self._adapters and len(self._adapters) < limit:
            self._adapters.add(lora)
        return lora if lora in self._adapters else "other"

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.vllm.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.itl.observe(seconds)

    def finished(self, e2e_s: float, ttft_s: float, completion_tokens: int, status: str, lora: str = "") -> None:
        """A request is done (`lora`: the adapter it ran under, "": the base model)."""
        self.e2e.observe(e2e_s)
        self.vllm.e2e.observe(e2e_s)
        self.generation_tokens.inc(completion_tokens)
        self.vllm.generation_tokens.inc(completion_tokens)
        if completion_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1))
        self.requests.labels(status).inc()
        self.model_requests.labels(self.model_label(lora), status).inc()

    def handoff(self, timing) -> None:
        """A remotely prefilled request's HandoffTiming (from its first response)."""
        for field, hist in self.handoff_seconds.items():
            hist.observe(getattr(timing, field))

    def observe_workers(self, stats: dict) -> None:
        """The workers' last Stats, by worker id: the per-worker series of the next scrape."""
        self.vllm.observe_workers(stats)
        self.workers.observe(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
