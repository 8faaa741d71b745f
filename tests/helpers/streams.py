"""Streams through an in-process cluster (`pdserve.deploy.local.LocalCluster`)."""
from __future__ import annotations

import json

import httpx


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
