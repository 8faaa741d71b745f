"""`pdserve up --autoscale`: the thin shell around the autoscaler's decision core
(deploy/autoscaler.py). Every `interval_s` it samples the router's view of the pools (worker
stats, and TTFT/ITL p90 over the last interval from the router's histograms), asks the
autoscaler, logs every decision with its reason, and resizes a pool through the same
`PoolControl` (router/control.py) as `pdserve scale` (so a removed worker drains first)."""
from __future__ import annotations

import asyncio
import time

from pdserve.config import AutoscaleConfig

from .autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    DecodePolicy,
    IntervalQuantile,
    PrefillPolicy,
    histogram_buckets,
    signals_from_stats,
)


def autoscaler_config(config: AutoscaleConfig) -> AutoscalerConfig:
    """Both pools' policies from the cluster's autoscaling settings (bounds and SLOs; the
    rest keeps the decision core's defaults)."""
    bounds = dict(min_replicas=1, max_replicas=config.max_replicas, scale_up_after_s=config.up_after_s,
                  scale_down_after_s=config.down_after_s, cooldown_s=config.cooldown_s)
    return AutoscalerConfig(prefill=PrefillPolicy(ttft_slo_s=config.ttft_slo_s, **bounds),
                            decode=DecodePolicy(itl_slo_s=config.itl_slo_s, **bounds))


class AutoscaleLoop:
    def __init__(self, router, control, config: AutoscalerConfig, log, interval_s: float = 5.0):
        self.router, self.control, self.log = router, control, log
        self.autoscaler = Autoscaler(config)
        self.interval_s = interval_s
        self._ttft, self._itl = IntervalQuantile(0.9), IntervalQuantile(0.9)
        self._prev_stats = None
        self.decisions: list = []  # the changes made, newest last

    async def tick(self, now: float | None = None) -> list:
        """One round: sample, decide, act. Returns the decisions that changed a pool."""
        m, cluster = self.router.metrics, self.router.cluster
        stats = dict(cluster.stats)
        if not self._fresh(stats):
            return []  # the router has not read a pool's stats again since the last round
        signals = signals_from_stats(
            time.monotonic() if now is None else now, stats, prev_stats=self._prev_stats,
            ttft_p90_s=self._ttft.update(histogram_buckets(m.ttft)), itl_p90_s=self._itl.update(histogram_buckets(m.itl)),
            replicas=self.control.sizes(), healthy=dict(cluster.healthy))
        self._prev_stats = stats
        changed = [d for d in self.autoscaler.decide(signals).values() if d.changed and d.pool in self.control.pools]
        for d in changed:
            self.log(f"autoscaler: {d}")
        if changed:
            await self.control.scale({d.pool: d.desired for d in changed})
            self.decisions += changed
        return changed

    def _fresh(self, stats: dict) -> bool:
        """Whether every pool has a worker whose stats were read again since the last round.
        A refresh waits for each worker's engine step, so a busy pool's stats can be older
        than one round: judged again, its cumulative counters would read as "no refusals
        since" and break the overload streak the hysteresis waits for."""
        prev = self._prev_stats
        if prev is None:
            return True
        return all(any(prev.get(w) is not s for w, s in stats.items() if s.role == role)
                   for role in {s.role for s in stats.values()})

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception as e:  # noqa: BLE001 - a failed round must not stop autoscaling
                self.log(f"autoscaler: round failed: {e!r}")
