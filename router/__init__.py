"""The router: the OpenAI-compatible HTTP API in front of the pools.

In: OpenAI requests (`app.py`, `protocol.py`). Out: JSON or SSE responses (`responses.py`).
The `Router` (`router.py`) admits a request as generations (`generation.py`), routed
(`cluster.py`, `policies.py`) to decode workers over gRPC with a prefill worker chosen by the
global prefix index (`prefix_index.py`), which follows the workers' KV events in Redis
(`discovery.py`). The Responses API (`responses_endpoint.py`) runs as a chat request and
keeps conversations in Redis (`response_store.py`). Operator keys (`keys.py`) set a request's
tenant and priority ceiling; their rate limits are counted in Redis (`ratelimit.py`), and what
each request used is recorded there for charge-back (`usage.py`, `metering.py`: /admin/usage).
"""
