"""Per-worker series, built at each scrape from the workers' last `Stats` (a Prometheus custom
collector): gauges for what a worker holds now, counters for what it counted since it
started. A restarted worker resets its counters, which `rate()` and `increase()` expect, and
a worker that has left the cluster leaves with its series (no stale values at its last
reading)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


@dataclass(frozen=True)
class Series:
    name: str
    doc: str
    kind: str  # "gauge" or "counter" (exposed with `_total`)
    values: Callable[[object], Iterable[tuple[tuple[str, ...], float]]]
    """A worker's Stats -> (values of `extra` labels, value) for each of its samples."""
    extra: tuple[str, ...] = ()


def field(name: str) -> Callable[[object], list]:
    """A Series' values: one sample, the Stats field `name`."""
    return lambda s: [((), float(getattr(s, name)))]


class WorkerSeries:
    """`series`, labelled `labels` (the worker's label values: `label_values(worker_id, stats)`),
    registered in `r`; `observe(stats)` replaces the snapshot the next scrape reads."""

    def __init__(self, r: CollectorRegistry, series: tuple[Series, ...], labels: tuple[str, ...],
                 label_values: Callable[[str, object], list[str]]):
        self.series, self.labels, self.label_values = series, labels, label_values
        self._stats: dict = {}
        r.register(self)

    def observe(self, stats: dict) -> None:
        self._stats = dict(stats)

    def collect(self):
        for spec in self.series:
            family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            m = family(spec.name, spec.doc, labels=list(self.labels + spec.extra))
            for wid, s in sorted(self._stats.items()):
                for extra, value in spec.values(s):
                    m.add_metric(self.label_values(wid, s) + list(extra), value)
            yield m

    def describe(self):
        return []  # collected fresh each scrape; nothing to check against other collectors at register time


PDSERVE_SERIES = (
    Series("pdserve_kv_usage_ratio", "KV blocks in use (1 = full)", "gauge", field("kv_usage")),
    Series("pdserve_running_requests", "Requests in a worker's running batch", "gauge", field("running")),
    Series("pdserve_waiting_requests", "Requests queued on a worker", "gauge", field("waiting")),
    Series("pdserve_kv_cache_info", "1 per worker, labelled with the dtype its KV cache holds", "gauge",
           lambda s: [((s.kv_cache_dtype,), 1.0)] if s.kv_cache_dtype else [], ("kv_cache_dtype",)),
    Series("pdserve_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache by the worker "
           "that computes the prompt", "counter", field("prefix_queries")),
    Series("pdserve_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache", "counter",
           field("prefix_hits")),
    Series("pdserve_kv_transfer_bytes", "KV bytes pushed (prefill) or received (decode) by a worker", "counter",
           field("kv_bytes")),
    Series("pdserve_kv_transfer_seconds", "Time a prefill worker spent pushing KV (rate of bytes / rate of "
           "seconds: transfer GB/s)", "counter", field("kv_seconds")),
    Series("pdserve_kv_transfer_failures", "Failed KV hand-offs seen by a worker", "counter",
           field("transfer_failures")),
    Series("pdserve_spec_proposed_tokens", "Tokens proposed by speculative decoding (prompt lookup or the "
           "draft model)", "counter", lambda s: [((s.speculation,), float(s.spec_proposed))] if s.speculation else [],
           ("speculation",)),
    Series("pdserve_spec_accepted_tokens", "Proposed tokens the model's check kept (acceptance rate: rate of "
           "accepted / rate of proposed)", "counter",
           lambda s: [((s.speculation,), float(s.spec_accepted))] if s.speculation else [], ("speculation",)),
    Series("pdserve_preemptions", "Running requests a worker preempted (recomputed later), by cause: memory (blocks "
           "another running request needed) or priority (a waiting request of a higher priority)", "counter",
           lambda s: [(("memory",), float(s.preempted_memory)), (("priority",), float(s.preempted_priority))],
           ("cause",)),
    Series("pdserve_kv_tier_bytes", "KV bytes a worker keeps in each tier under its KV pool", "gauge",
           lambda s: [(("host",), float(s.kv_host_bytes)), (("disk",), float(s.kv_disk_bytes))], ("tier",)),
    Series("pdserve_kv_tier_hits_tokens", "Prompt tokens copied back into the KV pool from each tier (prefix "
           "hits there)", "counter",
           lambda s: [(("host",), float(s.kv_host_hits)), (("disk",), float(s.kv_disk_hits))], ("tier",)),
    Series("pdserve_kv_tier_stored_blocks", "Evicted blocks stored in each tier", "counter",
           lambda s: [(("host",), float(s.kv_host_stored)), (("disk",), float(s.kv_disk_stored))], ("tier",)),
    Series("pdserve_kv_tier_refused_entries", "Disk-tier entries that failed their check (torn or altered): "
           "dropped and recomputed", "counter", field("kv_disk_refused")),
    Series("pdserve_kv_peer_pulls", "Peer prefix pulls by outcome: done (blocks installed), failed (peer gone, "
           "refused, corrupted or late: the prefix computed instead), missed (the peer no longer held the blocks: "
           "computed), skipped (computing was expected to be faster)",
           "counter", lambda s: [(("done",), float(s.peer_pulls)), (("failed",), float(s.peer_pull_failures)),
                                 (("missed",), float(s.peer_pull_misses)), (("skipped",), float(s.peer_pull_skipped))],
           ("outcome",)),
    Series("pdserve_kv_peer_blocks", "KV blocks a worker pulled from peers, and served to pulling peers", "counter",
           lambda s: [(("pulled",), float(s.peer_blocks_pulled)), (("served",), float(s.peer_blocks_served))],
           ("direction",)),
    Series("pdserve_kv_peer_bytes", "KV bytes a worker pulled from peers, and served to pulling peers", "counter",
           lambda s: [(("pulled",), float(s.peer_bytes_pulled)), (("served",), float(s.peer_bytes_served))],
           ("direction",)),
    Series("pdserve_decode_prefills", "Prompts a decode worker took, by where they were prefilled (remote: a "
           "prefill worker; local: itself)", "counter",
           lambda s: [] if s.role == "prefill" else [(("remote",), float(s.remote_prefills)),
                                                     (("local",), float(s.local_prefills))], ("where",)),
)
