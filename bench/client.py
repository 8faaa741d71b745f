"""The benchmark lab's HTTP client side: one streaming request as a client sees it (TTFT,
every inter-token gap, usage), the server's model id, and the tokenizer prompt lengths are
counted in."""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from .metrics import RequestResult
from .workloads import Turn


def resolve_tokenizer(spec: str, model_id: str):
    """(tokenizer or None, its name). auto: pdserve's default model's tokenizer when the model
    id names SmolLM2 (the whole family shares it) and it is installed; otherwise words."""
    if spec == "words" or (spec == "auto" and "smollm2" not in model_id.lower()):
        return None, "words"
    from pdserve.common.tokenizer import Tokenizer
    if spec == "auto":
        from pdserve.common.errors import PdserveError
        from pdserve.engine.model.weights import default_model_path
        try:
            path = default_model_path()
        except PdserveError:
            return None, "words"
    else:
        path = Path(spec)
    return Tokenizer.from_model_path(path), str(path)


# ---- the async shell ---------------------------------------------------------------------------


async def send_one(client, url: str, path: str, body: dict, turn: Turn, t0: float) -> tuple[RequestResult, str]:
    """One streaming request -> (its record, the reply text)."""
    import httpx

    start = time.perf_counter()
    r = RequestResult("ok", start - t0, turn.input_len, turn.output_len)
    stamps, text, usage, done = [], [], {}, False
    try:
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                r.status = str(resp.status_code)
                r.error = (await resp.aread()).decode(errors="replace")[:300]
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # after the first byte a server can only report in-band
                        r.status, r.error = "stream_error", json.dumps(chunk["error"])[:300]
                        break
                    for c in chunk.get("choices") or []:
                        piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                        if piece:
                            stamps.append(time.perf_counter())
                            text.append(piece)
                    usage = chunk.get("usage") or usage
                    r.timing = (chunk.get("timing") or [r.timing])[0]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.status, r.error = type(e).__name__, str(e)[:300]
    r.e2e = time.perf_counter() - start
    if r.ok and not (done and stamps):  # cut off, or no text at all: no latency to report
        r.status = "incomplete_stream" if not done else "empty_stream"
    if r.ok:
        r.ttft = stamps[0] - start
        r.itl = [b - a for a, b in itertools.pairwise(stamps)]
        # without usage (a server ignoring stream_options) each content chunk counts as one token
        r.output_tokens = int(usage.get("completion_tokens", len(stamps)))
        r.prompt_tokens = int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None
    return r, "".join(text)


async def first_model(client, url: str) -> str:
    resp = await client.get(url + "/v1/models", timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]
