"""End to end through HTTP, the requests a router refuses and the clients that go away: a
prefill worker, a decode worker and the router on loopback, the real default model. Bad
requests get OpenAI-style errors; a client that hangs up (streaming or not, or while a batch
starts) leaves no request, no KV block and no load accounting behind."""
import json

import httpx
import pytest

from tests.helpers.clusters import MODEL
from tests.helpers.e2e_cluster import client, cluster  # noqa: F401  (module-scoped: this module's own cluster)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "frobnicate"}}}}, 400, "response_format"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "regex", "regex": "([a-z]"}}, 400, "response_format"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [99999999]}, 400, "prompt"),
    # found by fuzzing: values past int32 used to fail the worker RPC with a 500
    ({"model": MODEL, "prompt": [2**31]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "top_k": 2**31}, 400, "top_k"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [2**31]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2**40}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"the": 5}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": [[12, 13], []]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", [12]]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["hi"] * 33, "n": 2}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "cache_salt": "s" * 1025}, 400, "cache_salt"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"12": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi " * 9000}, 400, "prompt"),  # found on the worker: the field still named
    ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(cluster, body, status, param):
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and (param is None or err["param"] == param)


def test_the_largest_seed_serves_every_choice(cluster):
    """Choice i uses seed + i, wrapping below 2**63: the largest valid seed is served for any
    n (seed + i past it would not fit the wire's int64)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 3, "seed": 2**63 - 1, "temperature": 1.0}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    assert httpx.post(cluster.url + "/v1/completions", json=body, timeout=60).json()["choices"] == r.json()["choices"]


@pytest.mark.parametrize("edge", [{"repetition_penalty": 0.01}, {"repetition_penalty": 10.0},
                                  {"presence_penalty": -2.0, "frequency_penalty": 2.0}, {"temperature": 100.0}])
def test_documented_bounds_are_served(cluster, edge):
    """The ends of each documented range pass the router and the workers alike (the wire
    carries floats as float32)."""
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2} | edge,
                   timeout=60)
    assert r.status_code == 200, r.text


def test_a_prompt_no_worker_can_hold_is_refused_at_once(cluster):
    """1.5 million token ids: a 400 context_length_exceeded from the router, not a retryable
    429 after hashing every block and overrunning the worker RPC's message size."""
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": [12] * 1_500_000, "max_tokens": 1},
                   timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt") and "1500000 tokens" in err["message"]


def test_a_body_past_the_limit_gets_413_declared_or_chunked(cluster):
    big = {"model": MODEL, "prompt": "hi", "user": "x" * (33 << 20)}
    r = httpx.post(cluster.url + "/v1/completions", json=big, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "user": "'
        for _ in range(33):
            yield b"x" * (1 << 20)
        yield b'"}'
    r = httpx.post(cluster.url + "/v1/completions", content=chunks(), timeout=120,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    small = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 2}'
    r = httpx.post(cluster.url + "/v1/completions", content=iter([small[:10], small[10:]]), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_chat_past_the_context_length_says_so_as_openai_does(client):
    from openai import BadRequestError
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 9000}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_invalid_json_and_chat_errors(cluster):
    r = httpx.post(cluster.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(cluster.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400


@pytest.mark.cancellation
def test_client_disconnect_aborts_everywhere(cluster):
    """A client that goes away mid-stream: the request is aborted on every worker and its
    blocks are freed within a second."""
    import time

    body = {"model": MODEL, "prompt": "Write a very long story about a dragon. " * 8, "max_tokens": 500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", cluster.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # first token seen: hang up
    deadline = time.time() + 1.0
    while time.time() < deadline:
        if all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in cluster.engines()):
            break
        time.sleep(0.02)
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in cluster.engines())
    assert cluster.router.cluster.pending_prefill == {} and cluster.router.cluster.decode_streams == {}  # its own load accounting too


def test_client_gone_before_the_body_frees_everything(cluster):
    """The client sends a streaming request and hangs up at once, before any byte of the
    response: the router still aborts the request on the workers."""
    import socket
    import time
    from urllib.parse import urlparse

    u = urlparse(cluster.url)
    body = json.dumps({"model": MODEL, "prompt": "Tell me everything about the sea. " * 4, "max_tokens": 800,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.time() + 5
    time.sleep(0.5)
    while time.time() < deadline:
        if cluster.router.inflight == 0 and all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests()
                                                for e in cluster.engines()):
            break
        time.sleep(0.05)
    assert cluster.router.inflight == 0 and cluster.router.cluster.pending_prefill == {}
    assert cluster.router.cluster.decode_streams == {}
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in cluster.engines())


@pytest.mark.parametrize("path,prompt", [
    ("/v1/completions", {"prompt": "Tell me everything about the sea. " * 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me everything about the sea."}]})])
def test_a_client_gone_from_a_non_streaming_request_stops_its_work(cluster, path, prompt):
    """A JSON (non-streaming) request whose client hangs up while it generates is aborted on
    the workers at once, not run to max_tokens for nobody."""
    import socket
    import time
    from urllib.parse import urlparse

    u = urlparse(cluster.url)
    body = json.dumps({"model": MODEL, "max_tokens": 800, "temperature": 0, "ignore_eos": True} | prompt).encode()
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                  + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.time() + 30
        while time.time() < deadline and not any(e.has_unfinished_requests() for e in cluster.engines()):
            time.sleep(0.02)
        assert any(e.has_unfinished_requests() for e in cluster.engines()), "the request never started"
    assert wait_quiescent(cluster, timeout_s=5.0), ([e.blocks.num_used_blocks for e in cluster.engines()],
                                                    cluster.router.inflight)


def quiescent(cluster) -> bool:
    return (cluster.router.inflight == 0 and cluster.router.cluster.decode_streams == {}
            and all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in cluster.engines()))


def wait_quiescent(cluster, timeout_s: float = 5.0) -> bool:
    import time
    deadline = time.time() + timeout_s
    while time.time() < deadline and not quiescent(cluster):
        time.sleep(0.05)
    return quiescent(cluster)


@pytest.mark.cancellation
def test_a_batch_that_fails_or_is_cancelled_while_starting_leaves_nothing(cluster, smollm):
    """One prompt of a batch is refused by the workers (past the context length): the request
    fails with its 400 and the other prompts' started choices are closed. A batch whose
    handler is cancelled while its prompts start (a server shutting down) closes them too."""
    import asyncio

    from pdserve.common.sampling_params import SamplingParams as SP
    tok = smollm[1]
    r = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ["Hello there", "hi " * 9000], "n": 2, "max_tokens": 50, "temperature": 0})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("prompt", "context_length_exceeded"), r.text
    assert wait_quiescent(cluster), ([e.blocks.num_used_blocks for e in cluster.engines()], cluster.router.inflight)
    short, long = tok.encode("Hello"), tok.encode("Tell me everything about the sea. " * 60)

    async def cancel_midway(after_s: float):
        start = asyncio.ensure_future(cluster.router._start_batch([short, long], SP(max_tokens=50), 2, "cmpl"))
        await asyncio.sleep(after_s)
        start.cancel()
        done, _ = await asyncio.wait({start}, timeout=30)
        if start in done and not start.cancelled() and start.exception() is None:
            await asyncio.gather(*(g.close() for g in start.result()))  # it won the race: close as a caller would
    for after_s in (0.05, 0.3, 1.0):  # before, between and after the prompts' first tokens
        cluster.run(cancel_midway(after_s))
        # an abort lands after the step the engine is in (a long prompt's prefill chunk: seconds
        # on a loaded 2-core machine), so quiescence gets longer than elsewhere; what is left
        # is named if it does not come
        assert wait_quiescent(cluster, timeout_s=15.0), (
            after_s, cluster.router.inflight, cluster.router.cluster.decode_streams,
            [(w.config.worker_id, w.engine.blocks.num_used_blocks, list(w.engine.scheduler.requests),
              list(w.engine.blocks._owned), list(w.engine._held)) for w in cluster.workers])
