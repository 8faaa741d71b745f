"""A decode worker dies mid-stream: the router moves the request to another decode worker,
which recomputes prompt + the tokens already streamed, and the client's stream continues
with exactly the tokens an uninterrupted run gives. With no other decode worker, the stream
ends with an OpenAI-style error event instead of hanging."""
import httpx
import pytest

from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from tests.helpers.clusters import local_config
from tests.helpers.streams import stream_and_kill

pytestmark = pytest.mark.slow
MODEL = "smollm2"
PROMPT = "The history of the printing press begins"


def start(smollm, num_decode, kv="auto"):
    loaded, tok = smollm
    engine = EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20, kv_cache_dtype=kv))
    return LocalCluster(loaded, tok, local_config(decode=num_decode, engine=engine)).start()


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
