"""The Grafana dashboard (deploy/grafana/pdserve.json) against the router's metrics: every
series a panel queries must be one `router.metrics.RouterMetrics` exports, so a renamed or
removed metric breaks this test rather than a dashboard panel in production."""
from __future__ import annotations

import json
from pathlib import Path

from pdserve.router.metrics import RouterMetrics
from tests.helpers.promql import promql_metric_names

ROOT = Path(__file__).resolve().parents[1]

def exported_series() -> set[str]:
    """Series names in the router's exposition: histograms as _bucket/_sum/_count, counters
    with _total."""
    series = set()
    for line in RouterMetrics().render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "histogram":
                series |= {name + s for s in ("_bucket", "_sum", "_count")}
            elif kind == "counter":
                series.add(name if name.endswith("_total") else name + "_total")
            elif not name.endswith("_created"):
                series.add(name)
    return series


def test_promql_metric_names_parser():
    assert promql_metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y"}[5m])))') == {"a_bucket"}
    assert promql_metric_names("sum(rate(b_total[$__rate_interval])) / clamp_min(sum(c), 1e-9)") == {"b_total", "c"}


def test_grafana_dashboard_uses_only_exported_metrics():
    dash = json.loads((ROOT / "deploy/grafana/pdserve.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    series = exported_series()
    assert {"pdserve_time_to_first_token_seconds_bucket", "pdserve_requests_total", "pdserve_kv_usage_ratio"} <= series
    used = set()
    for p in dash["panels"]:
        for t in p.get("targets", []):
            names = promql_metric_names(t["expr"])
            assert names, f"panel {p['title']!r}: no metric in {t['expr']}"
            assert names <= series, f"panel {p['title']!r}: not exported by the router: {names - series}"
            used |= names
    wanted = {"pdserve_rejected_requests_total", "pdserve_migrations_total", "pdserve_waiting_requests",
              "pdserve_running_requests", "pdserve_prefix_cache_hits_tokens_total", "pdserve_prefix_cache_queries_tokens_total",
              "pdserve_generation_tokens_total", "pdserve_prompt_tokens_total", "pdserve_decode_prefills_total"}
    assert wanted <= used
    assert {n[: -len("_bucket")] for n in used if n.endswith("_bucket")} == {
        "pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
        "pdserve_time_per_output_token_seconds", "pdserve_e2e_request_latency_seconds",
        "pdserve_request_queue_seconds", "pdserve_blocks_wait_seconds", "pdserve_prefill_queue_seconds",
        "pdserve_prefill_compute_seconds", "pdserve_kv_push_seconds", "pdserve_kv_transfer_request_bytes"}
