"""KV block transport between prefill and decode workers.

In: a prefill engine's exported blocks (`LLMEngine.export_kv`) and the destination blocks a
decode engine allocated (`LLMEngine.add_remote_request`). Out: checked arrivals that the decode
worker imports (`LLMEngine.import_kv`). `wire.py` is the format (a `KVHeader` + raw payload in
chunks), `receiver.py` the decode side's leases and checks, `grpc_transport.py`, `local.py` and
`ucx_transport.py` the transports behind the `KVSender` interface (`base.py`), and
`senders.py` picks one by the receiver's address scheme. `stages.py`: a hand-off by parts
between groups of different shapes, each pipeline rank sending or receiving its own layers
and KV heads (a decode pipeline's `stages:` address names each rank's).

Peer prefix pulls (`peer.py`): a worker pulls the KV of a prompt's prefix from another worker
the router names (`KVTransfer.Pull` on that worker's service address, answered as a push and
checked by the same receiver), when `pull_decision.py` expects it to beat computing it.

LoRA adapters (`adapters.py`): the workers' LoadLoRA / UnloadLoRA and the adapters in their
Stats; a push's header names the adapter its KV was computed under and the receiver refuses
another than its request's.
"""
