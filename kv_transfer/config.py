"""The KV hand-off's settings (the cluster config's `transfer` branch): what prefill workers
send over and as what, what decode workers accept, and what happens when a hand-off fails."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.checks import at_least, one_of

KV_TRANSPORTS = ("grpc", "ucx")
KV_WIRE_DTYPES = ("auto", "bf16", "fp8", "int8")
KV_DTYPE_MISMATCH = ("convert", "refuse")
TRANSFER_POLICIES = ("recompute", "fail")
PEER_PULLS = ("auto", "always", "off")


@dataclass(frozen=True)
class TransferConfig:
    transport: str = "grpc"
    """What decode workers receive KV over: grpc | ucx (prefill workers follow the address)."""
    layer_group: int = 0
    """Prefill workers push a prompt's KV every this many layers as they compute (0: at the end)."""
    policy: str = "recompute"
    """A failed hand-off is prefilled again on the decode worker (recompute) or fails (fail)."""
    local_prefill_threshold: int = 0
    """Decode workers prefill prompts of at most this many tokens themselves (no hand-off)."""
    wire_dtype: str = "auto"
    """What prefill workers send KV as: "auto" (as their cache holds it), or "bf16", "fp8",
    "int8" (converted for the transfer only, e.g. for a slow link; the decode worker
    converts into its own cache's format as it lands)."""
    timeout_s: float = 30.0
    """How long a decode worker waits for blocks, and a prefill worker's KV push may take."""
    prefill_timeout_s: float = 600.0
    """How long a decode worker waits for a prompt it handed to a prefill worker: its queue
    there, its compute and its KV push (the Prefill call's deadline and the lease of its
    destination blocks). Under load a long prompt queues there for longer than a push takes;
    giving up then would compute it twice (there, and again here)."""
    kv_dtype_mismatch: str = "convert"
    """KV arriving in another format than the decode cache's: convert it as it lands, or
    refuse the push (the transfer policy then recomputes or fails the request)."""
    peer_pull: str = "auto"
    """A worker the router names a peer for (one holding more of the prompt's prefix) pulls
    those blocks from it: "auto" when the pull is expected to be faster than computing them
    (measured transfer rate vs measured prefill rate, per request), "always", or "off"."""
    peer_timeout_s: float = 5.0
    """How long a peer pull may take before the worker gives up and computes the prefix."""
    peer_gbps: float = 0.5
    """The transfer rate (GB/s) a worker assumes for peer pulls until it has measured one."""
    peer_prefill_tokens_per_s: float = 2000.0
    """The prefill rate (tokens/s) a worker assumes until it has measured its own."""

    def __post_init__(self):
        one_of("kv transport", self.transport, KV_TRANSPORTS)
        one_of("kv wire dtype", self.wire_dtype, KV_WIRE_DTYPES)
        one_of("kv dtype mismatch", self.kv_dtype_mismatch, KV_DTYPE_MISMATCH)
        one_of("transfer policy", self.policy, TRANSFER_POLICIES)
        one_of("peer pull", self.peer_pull, PEER_PULLS)
        at_least("peer pull timeout", self.peer_timeout_s, 0.001)
        at_least("peer pull GB/s prior", self.peer_gbps, 1e-6)
        at_least("peer prefill tokens/s prior", self.peer_prefill_tokens_per_s, 1e-3)
        at_least("kv layer group", self.layer_group, 0)
        at_least("local prefill threshold", self.local_prefill_threshold, 0)
        at_least("transfer timeout", self.timeout_s, 0.001)
        at_least("prefill timeout", self.prefill_timeout_s, 0.001)
