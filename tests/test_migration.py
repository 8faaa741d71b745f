"""A decode worker dies mid-stream: the router moves the request to another decode worker,
which recomputes prompt + the tokens already streamed, and the client's stream continues
with exactly the tokens an uninterrupted run gives. With no other decode worker, the stream
ends with an OpenAI-style error event instead of hanging."""
import json

import httpx
import pytest

from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from tests.clusters import local_config

pytestmark = pytest.mark.slow
MODEL = "smollm2"
PROMPT = "The history of the printing press begins"


def start(smollm, num_decode, kv="auto"):
    loaded, tok = smollm
    engine = EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20, kv_cache_dtype=kv))
    return LocalCluster(loaded, tok, local_config(decode=num_decode, engine=engine)).start()


def stream_and_kill(c, body, kill_after=8):
    """Stream `body`; after `kill_after` chunks, stop the decode worker serving it."""
    texts, events, killed = [], [], False
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", c.url + "/v1/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                events.append(ev)
                if ev.get("choices"):
                    texts.append(ev["choices"][0]["text"])
                if len(texts) == kill_after and not killed:  # once: the error event that follows adds no text
                    # the worker the router streams from (under load, the engine may be far ahead of the client)
                    serving = [wid for wid, n in c.router.cluster.decode_streams.items() if n]
                    assert len(serving) == 1, c.router.cluster.decode_streams
                    c.run(c.worker(serving[0]).worker._server.stop(0))  # its process is gone, as far as gRPC can tell
                    killed = True
    return "".join(texts), events


@pytest.mark.parametrize("sampling,kv", [(dict(temperature=0), "auto"), (dict(temperature=0.9, seed=17), "auto"),
                                         (dict(temperature=0), "int8")], ids=["greedy", "seeded", "greedy-int8-kv"])
def test_migration_continues_the_stream_exactly(smollm, sampling, kv):
    """With an 8-bit cache too: the recomputed prompt and tokens land as the same codes."""
    loaded, tok = smollm
    params = SamplingParams(max_tokens=40, ignore_eos=True, **sampling)
    ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20, kv_cache_dtype=kv)), tok).generate(
        [tok.encode(PROMPT)], params)[0]
    c = start(smollm, num_decode=2, kv=kv)
    try:
        text, events = stream_and_kill(c, {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True,
                                           **sampling})
        metrics = httpx.get(c.url + "/metrics").text
        streams = dict(c.router.cluster.decode_streams)
    finally:
        c.stop()
    assert streams == {}  # the failed worker's stream and the new one: both given back
    assert text == tok.decode(ref, skip_special_tokens=True)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "pdserve_migrations_total 1.0" in metrics
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in c.engines())


def test_no_other_decode_worker_ends_the_stream_with_an_error_event(smollm):
    c = start(smollm, num_decode=1)
    try:
        # long enough that the worker is still generating when it is stopped, however the client lags
        text, events = stream_and_kill(c, {"model": MODEL, "prompt": PROMPT, "max_tokens": 600, "ignore_eos": True,
                                           "temperature": 0})
        streams = dict(c.router.cluster.decode_streams)
    finally:
        c.stop()
    assert streams == {}
    assert text and "error" in events[-1] and events[-1]["error"]["code"] == "worker_failed"
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in c.engines())
