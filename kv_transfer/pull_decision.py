"""Whether to pull a prefix's KV from a peer or compute it: a pure decision on running estimates.

A worker keeps two running estimates (`RunningRate`): the transfer rate of its peer pulls
(bytes per second, end to end: the call, the peer's copy, the wire, the checks) and its own
prefill rate (prompt tokens computed per second, as its prefills measured them). Each starts
at a prior (`TransferConfig.peer_gbps`, `peer_prefill_tokens_per_s`) until it has measured.
`pull_or_compute` prices both ways for one request's missing blocks; the pull wins only when
it is expected to finish sooner.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunningRate:
    """An exponentially weighted mean of a rate (amount per second), `prior` until observed."""

    value: float
    weight: float = 0.3
    """How much each new observation moves the estimate (0..1]."""
    samples: int = 0

    def observe(self, amount: float, seconds: float) -> None:
        """Fold in one measurement (`amount` done in `seconds`); the first replaces the prior."""
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.samples == 0 else (1 - self.weight) * self.value + self.weight * rate
        self.samples += 1


@dataclass(frozen=True)
class PullChoice:
    """The decision for one request and what it was based on (seconds, expected)."""

    pull: bool
    pull_s: float
    compute_s: float


def pull_or_compute(blocks: int, block_bytes: int, block_size: int, transfer_bytes_per_s: float,
                    prefill_tokens_per_s: float, overhead_s: float = 0.0) -> PullChoice:
    """Pull `blocks` blocks of `block_bytes` bytes (each `block_size` tokens) from a peer at
    `transfer_bytes_per_s`, plus `overhead_s` for the call, or compute their tokens at
    `prefill_tokens_per_s`? A pull of nothing, or an estimate that is not positive, computes."""
    if blocks <= 0 or transfer_bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
        return PullChoice(False, float("inf"), 0.0)
    pull_s = overhead_s + blocks * block_bytes / transfer_bytes_per_s
    compute_s = blocks * block_size / prefill_tokens_per_s
    return PullChoice(pull_s < compute_s, pull_s, compute_s)
