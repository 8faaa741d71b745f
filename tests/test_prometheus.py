"""The Grafana dashboard and the alert rules against a real Prometheus (Debian's, unpacked by
`make test` under .cache/prometheus) scraping a running cluster under load: every panel's
query returns data, every alert rule loads and evaluates, every series an alert reads exists;
and promtool's unit tests show each alert firing on its condition (tests/data/alerts_test.yaml)."""
from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.deploy.local import LocalCluster
from tests.helpers.clusters import MODEL, local_config
from tests.helpers.promql import promql_metric_names

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/alerts.yaml"
pytestmark = pytest.mark.slow


def _tool(name: str) -> str:
    local = ROOT / ".cache/prometheus/usr/bin" / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (`make test` unpacks Debian's into .cache/prometheus)")
    return found


def test_alert_rules_are_valid_and_fire_as_their_unit_tests_say():
    promtool = _tool("promtool")
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 11 rules found" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=ROOT / "tests/data",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus scraping `target` every second, with pdserve's alert rules, stopped by its PID."""

    def __init__(self, target: str, tmp: Path):
        self.url = f"http://127.0.0.1:{_free_port()}"
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "pdserve", "static_configs": [{"targets": [target]}]}]}))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen([_tool("prometheus"), f"--config.file={config}",
                                      f"--storage.tsdb.path={tmp / 'data'}",
                                      f"--web.listen-address={self.url.split('//')[1]}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            assert self.proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "prometheus did not become ready"
            time.sleep(0.2)

    def query(self, expr: str, at: float) -> list:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr, "time": at}, timeout=30).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _load(url: str, seconds: float) -> None:
    """Requests through both pools for `seconds`: streamed and not, prompts long and short,
    and more at once than the router admits (some get 429)."""
    def one(k: int):
        body = {"model": MODEL, "max_tokens": 4 + k % 5, "temperature": 0, "ignore_eos": True}
        prompt = f"Request {k}: " + "scraped by a real Prometheus while it runs, " * (1 + k % 4)
        if k % 2:
            return httpx.post(url + "/v1/chat/completions", timeout=60, json=body | {
                "messages": [{"role": "user", "content": prompt}], "stream": True}).status_code
        return httpx.post(url + "/v1/completions", timeout=60, json=body | {"prompt": prompt}).status_code
    statuses, k, deadline = [], 0, time.time() + seconds
    with ThreadPoolExecutor(4) as pool:
        while time.time() < deadline:
            statuses += list(pool.map(one, range(k, k + 4)))
            k += 4
    assert 200 in statuses and set(statuses) <= {200, 429}, statuses


def test_every_dashboard_panel_and_alert_reads_data_from_a_live_cluster(smollm, tmp_path):
    loaded, tok = smollm
    cluster = LocalCluster(loaded, tok, local_config(64 << 20, router={"max_inflight": 3, "queue_size": 0})).start()
    prom = None
    try:
        prom = Prometheus(cluster.url.split("//")[1], tmp_path)
        _load(cluster.url, 12.0)
        at = time.time()
        time.sleep(2.5)  # the last scrapes and rule evaluations of the load
        assert prom.query('up{job="pdserve"}', at)[0]["value"][1] == "1"

        dash = json.loads((ROOT / "deploy/grafana/pdserve.json").read_text())
        empty = []
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "10s")
                values = [float(s["value"][1]) for s in prom.query(expr, at)]
                if not any(math.isfinite(v) for v in values):
                    empty.append(f"{panel['title']}: {expr} -> {values}")
        assert not empty, "panels with no data:\n" + "\n".join(empty)

        rules = httpx.get(prom.url + "/api/v1/rules", timeout=30).json()["data"]["groups"][0]["rules"]
        assert len(rules) == 11
        for rule in rules:
            assert rule["health"] == "ok" and not rule.get("lastError"), rule
            for name in promql_metric_names(rule["query"]) - {"up"}:
                assert prom.query(f'count({{__name__="{name}"}})', at), f"{rule['name']}: no series {name}"
        firing = {a["labels"]["alertname"] for a in httpx.get(prom.url + "/api/v1/alerts", timeout=30).json()[
            "data"]["alerts"] if a["state"] == "firing"}
        assert not firing & {"PdserveRouterDown", "PdserveNoDecodeWorker", "PdserveKVTransferFailures"}, firing
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()
    for eng in cluster.engines():
        assert eng.blocks.num_used_blocks == 0 and not eng.has_unfinished_requests()
