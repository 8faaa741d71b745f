"""What tracing costs (`--otlp-traces-endpoint`): the same cluster (in-process, one prefill and
one decode worker, the default model) serving the same load with tracing off and on, the
spans going to a real OTLP/HTTP receiver in this process; rounds interleaved (off, on, off,
on, ...) so the machine's drift falls on both, medians. Each round sends fresh prompts (no
prefix-cache reuse across rounds). Writes bench/experiments/tracing-results.json.

    . .venv/bin/activate && python bench/experiments/tracing_overhead.py
"""
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kv_quant import cpu_name  # noqa: E402  (a sibling script)

from pdserve.config import TracingConfig  # noqa: E402
from pdserve.deploy.local import LocalCluster  # noqa: E402
from pdserve.common.tokenizer import Tokenizer  # noqa: E402
from pdserve.engine.model.weights import load_model  # noqa: E402
from tests.helpers.clusters import MODEL, local_config  # noqa: E402
from tests.test_tracing import Collector  # noqa: E402

HERE = Path(__file__).resolve().parent
ROUNDS, REQUESTS, CONCURRENCY, OUTPUT = 4, 24, 4, 32


def one_round(url: str, round_id: int) -> dict:
    """REQUESTS streamed requests, CONCURRENCY at a time, each read to its end: requests/s and
    the median TTFT (ms)."""
    def one(k: int) -> float:
        body = {"model": MODEL, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True, "stream": True,
                "prompt": f"Round {round_id}, request {k}: " + "tracing costs what it costs, " * 8}
        t0, ttft = time.perf_counter(), None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - t0
        return ttft
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        ttfts = list(pool.map(one, range(REQUESTS)))
    return {"rps": REQUESTS / (time.perf_counter() - t0), "ttft_p50_ms": 1e3 * statistics.median(ttfts)}


def main() -> None:
    loaded = load_model()
    tok = Tokenizer.from_model_path(loaded.path)
    collector = Collector()
    clusters = {"off": LocalCluster(loaded, tok, local_config(256 << 20)).start(),
                "on": LocalCluster(loaded, tok, local_config(256 << 20, tracing=TracingConfig(collector.url))).start()}
    rows = {name: [] for name in clusters}
    try:
        for r in range(ROUNDS):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rows[name].append(one_round(clusters[name].url, r * 2 + (name == "on")))
                print(name, rows[name][-1], flush=True)
    finally:
        for c in clusters.values():
            c.stop()
        collector.close()
    summary = {name: {k: statistics.median(x[k] for x in runs) for k in ("rps", "ttft_p50_ms")}
               for name, runs in rows.items()}
    out = {"cpu": cpu_name(), "rounds": ROUNDS, "requests_per_round": REQUESTS, "concurrency": CONCURRENCY,
           "output_tokens": OUTPUT, "spans_received": len(collector.spans), "runs": rows, "median": summary,
           "on_over_off": {k: summary["on"][k] / summary["off"][k] for k in ("rps", "ttft_p50_ms")}}
    (HERE / "tracing-results.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["median"]), json.dumps(out["on_over_off"]), out["spans_received"], "spans")


if __name__ == "__main__":
    main()
