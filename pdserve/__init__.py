"""pdserve: a disaggregated prefill/decode LLM serving cluster.

The layers, bottom up (each imports only those below it; docs/architecture.md):
`pdserve.engine` (the model, KV cache, scheduler), `pdserve.protos` (the wire contracts),
`pdserve.kv_transfer` and `pdserve.registry` (KV hand-off, Redis membership and events),
`pdserve.prefill_worker`, `pdserve.decode_worker` and `pdserve.router` (the services),
`pdserve.deploy` (starting and scaling them), `pdserve.bench` (the benchmark lab) and
`pdserve.cli` (the `pdserve` command).
"""
__version__ = "0.1.0"
