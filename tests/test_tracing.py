"""OpenTelemetry traces: one tree per request across the router, the prefill and the decode
worker, received here by a real OTLP/HTTP endpoint from the real exporter."""
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.config import TracingConfig
from pdserve.deploy.local import LocalCluster
from pdserve.protos.tracing import Tracer, traces_url
from tests.helpers.clusters import MODEL, local_config

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402


class Collector:
    """An OTLP/HTTP traces endpoint: every span it is sent, with its service's name."""

    def __init__(self):
        self.spans: list[dict] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            collector.spans.append({
                                "service": resource["service.name"], "name": s.name, "trace": s.trace_id.hex(),
                                "id": s.span_id.hex(), "parent": s.parent_span_id.hex(), "kind": s.kind,
                                "start": s.start_time_unix_nano, "end": s.end_time_unix_nano, "status": s.status.code,
                                "attrs": {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}})
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_tracer_that_is_off_imports_nothing_and_hands_out_no_op_spans():
    # (FastAPI and redis-py import parts of OpenTelemetry themselves when it is installed; the
    # tracing SDK and the exporter are pdserve's)
    code = ("import sys; import pdserve.router.app, pdserve.deploy.local; from pdserve.protos.tracing import OFF, NO_SPAN; "
            "s = OFF.start('x', kind='server'); s.set_attribute('a', 1); s.end(); OFF.record('y', s, 0.0, 1.0); "
            "assert s is NO_SPAN and OFF.metadata(s) == () and OFF.extract([('traceparent', 'x')]) is None; "
            "assert not [m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_endpoint_must_be_an_http_url():
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://otel.example/v1/traces") == "https://otel.example/v1/traces"
    for bad in ("127.0.0.1:4318", "grpc://x:4317", "http://"):
        with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
            Tracer(bad, "pdserve-router")


def _children(spans, parent):
    return [s for s in spans if s["parent"] == parent["id"]]


def _one(spans, name, parent=None):
    found = [s for s in spans if s["name"] == name and (parent is None or s["parent"] == parent["id"])]
    assert len(found) == 1, (name, [(s["name"], s["service"]) for s in spans])
    return found[0]


def test_one_trace_per_request_joined_across_router_prefill_and_decode(smollm):
    loaded, tok = smollm
    collector = Collector()
    c = LocalCluster(loaded, tok, local_config(64 << 20, tracing=TracingConfig(collector.url))).start()
    try:
        r = httpx.post(c.url + "/v1/completions", timeout=60, headers={"X-PDServe-Timing": "1"}, json={
            "model": MODEL, "prompt": "Tracing joins the hops of one request: " * 6, "max_tokens": 5,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        timing = r.json()["timing"]
        ids = [r.json()["id"]]
        with httpx.stream("POST", c.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "A second request, a second trace."}],
                "max_tokens": 4, "stream": True, "stream_options": {"include_timing": True}}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        ids.append(events[0]["id"])
    finally:
        c.stop()  # flushes every process's spans
        collector.close()
    for eng in c.engines():
        assert eng.blocks.num_used_blocks == 0
    roots = {s["attrs"]["pdserve.request_id"]: s for s in collector.spans if not s["parent"]}
    assert set(roots) == set(ids)
    assert len({s["trace"] for s in roots.values()}) == 2  # a trace each
    root = roots[ids[0]]
    spans = [s for s in collector.spans if s["trace"] == root["trace"]]
    by_id = {s["id"]: s for s in spans}
    assert all(s["parent"] in by_id for s in spans if s is not root)  # one tree, nothing dangling

    # the tree: router -> decode -> prefill, each span reported by the process of its role
    admission, call = _one(spans, "router.admission", root), _one(spans, "router.generate", root)
    decode = _one(spans, "decode", call)
    prefill_call = _one(spans, "prefill.call", decode)
    prefill = _one(spans, "prefill", prefill_call)
    assert {s["service"] for s in (root, admission, call)} == {"pdserve-router"}
    assert {s["service"] for s in [decode, prefill_call] + _children(spans, decode)} == {"pdserve-decode"}
    assert {s["service"] for s in [prefill] + _children(spans, prefill)} == {"pdserve-prefill"}
    assert {s["name"] for s in _children(spans, decode)} == {"decode.blocks_wait", "prefill.call", "kv.import",
                                                             "decode.generation"}
    assert {s["name"] for s in _children(spans, prefill)} == {"prefill.queue", "prefill.compute", "kv.push"}

    # what the spans say
    assert root["attrs"]["pdserve.completion_tokens"] == 5 and root["attrs"]["pdserve.finish_reason"] == "length"
    assert root["attrs"]["pdserve.prompt_tokens"] == decode["attrs"]["pdserve.prompt_tokens"] > 40
    assert call["attrs"]["pdserve.decode_worker"] == "decode-0" and call["attrs"]["pdserve.prefill_worker"] == "prefill-0"
    assert decode["attrs"]["pdserve.prefilled_remotely"] is True
    push, landed = _one(spans, "kv.push", prefill), _one(spans, "kv.import", decode)
    assert push["attrs"]["pdserve.kv_bytes"] == landed["attrs"]["pdserve.kv_bytes"] > 0
    assert _one(spans, "decode.generation", decode)["attrs"]["pdserve.completion_tokens"] == 5
    assert all(s["status"] != 2 for s in spans)  # STATUS_CODE_ERROR: none on a request that went well

    # when: a child starts within its parent; the work timed inside a process ends within it;
    # the hand-off's steps come in order and fit inside the time to the first token
    slack = 2_000_000  # ns: spans timed on the engine thread are placed from perf_counter readings
    for s in spans:
        if s is not root:
            p = by_id[s["parent"]]
            assert s["start"] >= p["start"] - slack, (s["name"], p["name"])
            if s["kind"] == 1:  # SPAN_KIND_INTERNAL
                assert s["end"] <= p["end"] + slack, (s["name"], p["name"])
    queue, compute = _one(spans, "prefill.queue", prefill), _one(spans, "prefill.compute", prefill)
    assert queue["end"] <= compute["start"] + slack and compute["end"] <= push["start"] + slack
    assert push["end"] <= landed["start"] + slack
    assert compute["end"] - compute["start"] > 0
    ttft_ns = root["attrs"]["pdserve.ttft_s"] * 1e9
    assert landed["end"] - admission["start"] <= ttft_ns + slack

    # the same breakdown in the response, on request: a header, or stream_options in a stream
    assert [t["index"] for t in timing] == [0]
    t = timing[0]
    assert t["prefilled_remotely"] is True and t["decode_worker"] == "decode-0" and t["prefill_worker"] == "prefill-0"
    assert t["kv_bytes"] == push["attrs"]["pdserve.kv_bytes"]
    assert abs(t["prefill_compute_s"] * 1e9 - (compute["end"] - compute["start"])) < slack
    assert abs(t["kv_push_s"] * 1e9 - (push["end"] - push["start"])) < 50 * slack  # push span: the send alone
    assert t["ttft_s"] >= t["queue_s"] + t["blocks_wait_s"] + t["prefill_queue_s"] + t["prefill_compute_s"]
    assert t["ttft_s"] == pytest.approx(root["attrs"]["pdserve.ttft_s"]) and t["e2e_s"] >= t["ttft_s"]
    last = events[-1]
    assert last["choices"] == [] and "usage" not in last and last["timing"][0]["prefilled_remotely"] is True
    assert last["timing"][0]["ttft_s"] > 0 and all("timing" not in e for e in events[:-1])
