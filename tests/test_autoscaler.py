"""The autoscaler's decisions, replayed against recorded signal traces.

The traces under tests/data/autoscaler/ are samples every 5 s (`Signals.to_dict` per line,
an optional "note" marks a phase). `replay` feeds each decision's replicas back as the next
sample's pool size, as `pdserve up --autoscale` does; queued prefill tokens are pool totals,
so more prefill workers lower the per-worker load the autoscaler sees.
"""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.deploy.autoscaler import (
    POOLS,
    Autoscaler,
    AutoscalerConfig,
    DecodePolicy,
    IntervalQuantile,
    PoolSignals,
    PrefillPolicy,
    Signals,
    diff_buckets,
    histogram_buckets,
    histogram_quantile,
    signals_from_stats,
)
from pdserve.protos import worker_pb2 as pb

TRACES = Path(__file__).parent / "data" / "autoscaler"
TIMING = dict(min_replicas=1, max_replicas=4, scale_up_after_s=30, scale_down_after_s=120, cooldown_s=60,
              max_step_up=2, max_step_down=1)
# the default targets (TTFT 2 s, 512/4096 queued tokens per worker; ITL 0.1 s, KV 0.3/0.85)
CONFIG = AutoscalerConfig(PrefillPolicy(**TIMING), DecodePolicy(**TIMING))


def load(name: str) -> list[Signals]:
    return [Signals.from_dict(json.loads(line)) for line in (TRACES / f"{name}.jsonl").read_text().splitlines()]


def replay(name: str, config: AutoscalerConfig = CONFIG) -> list[tuple[float, dict]]:
    """(t, decisions) per sample, each sample's replicas being the previous decision's."""
    trace, scaler = load(name), Autoscaler(config)
    replicas = {p: getattr(trace[0], p).replicas for p in POOLS}
    out = []
    for s in trace:
        decisions = scaler.decide(s.with_replicas(replicas))
        out.append((s.t, decisions))
        replicas = {p: d.desired for p, d in decisions.items()}
    return out


def changes(steps, pool: str) -> list[tuple[float, int, int]]:
    return [(t, d[pool].current, d[pool].desired) for t, d in steps if d[pool].changed]


def sample(t, prefill=None, decode=None, ttft=None, itl=None) -> Signals:
    return Signals(t, prefill or PoolSignals(2, queued_tokens_sum=2000), decode or PoolSignals(2, kv_usage_mean=0.5),
                   ttft, itl)


# ---- the traces ---------------------------------------------------------------------------
def test_prefill_burst_scales_prefill_stepwise_to_max_then_back_to_min():
    steps = replay("prefill_burst")
    # over from t=70 (TTFT and queue up); +2 is the step cap (proportional asked 4), then the
    # cooldown, then max; idle from t=400: one worker at a time, each after 120 s under
    assert changes(steps, "prefill") == [(100, 1, 3), (160, 3, 4), (510, 4, 3), (635, 3, 2), (760, 2, 1)]
    # decode stayed calm through the burst (in band); it only shrinks when everything is idle
    assert changes(steps, "decode") == [(520, 2, 1)]
    assert all(d["decode"].reason.startswith("in band") for t, d in steps if t < 400)
    up = next(d["prefill"] for t, d in steps if t == 100)
    assert "TTFT p90 2.97s > SLO 2s" in up.reason and "capped from 4" in up.reason
    assert str(up).startswith("prefill 1 -> 3: scale up: overloaded for 30s")


def test_decode_pressure_scales_decode_only():
    steps = replay("decode_pressure")
    assert changes(steps, "decode") == [(110, 1, 3), (170, 3, 4)]
    assert changes(steps, "prefill") == []
    assert "ITL p90" in steps[22][1]["decode"].reason and "KV usage" in steps[22][1]["decode"].reason


def test_oscillation_around_the_thresholds_does_not_flap():
    """Over/under every sample, then runs of 2-5 samples over, 1 under: never 30 s over."""
    steps = replay("oscillation")
    assert changes(steps, "prefill") == [] and changes(steps, "decode") == []
    # it is not calm: the streaks did start, they just never lasted
    for pool in POOLS:
        assert any("overloaded for 20s of 30s" in d[pool].reason for _, d in steps)


def test_overload_at_max_stays_at_max():
    steps = replay("overload_at_max")
    for _, d in steps:
        for pool in POOLS:
            assert d[pool].desired == 4 and "at max_replicas 4" in d[pool].reason


def test_idle_at_min_stays_at_min():
    steps = replay("idle_at_min")
    for _, d in steps:
        for pool in POOLS:
            assert d[pool].desired == 1
    # no latency data at all: idle is "under" (the watermark), never "over" (the SLO)
    assert "underloaded but at min_replicas 1" in steps[-1][1]["prefill"].reason


def test_refusals_alone_scale_their_own_pool_up():
    steps = replay("refusals")
    # TTFT/ITL within SLO and load in band all along: only the refusals are over
    assert changes(steps, "prefill") == [(60, 1, 2)]
    assert changes(steps, "decode") == [(230, 1, 2)]
    for t, d in steps:
        for pool in POOLS:
            if d[pool].reason.startswith("overloaded") or d[pool].changed:
                assert "refused at queue limit" in d[pool].reason and "SLO" not in d[pool].reason


def test_cooldown_spaces_the_changes():
    config = replace(CONFIG, prefill=replace(CONFIG.prefill, max_replicas=8, max_step_up=1, cooldown_s=120))
    steps = replay("sustained_overload", config)
    assert changes(steps, "prefill") == [(30, 1, 2), (150, 2, 3), (270, 3, 4), (390, 4, 5), (510, 5, 6)]
    assert changes(steps, "decode") == []
    assert "cooldown (60s of 120s" in next(d["prefill"].reason for t, d in steps if t == 90)


@pytest.mark.parametrize("name", sorted(p.stem for p in TRACES.glob("*.jsonl")))
def test_invariants_on_every_trace(name):
    """Within bounds, steps bounded, changes at least a cooldown apart: on every trace."""
    steps = replay(name)
    for pool in POOLS:
        p = getattr(CONFIG, pool)
        last = None
        for t, d in steps:
            assert p.min_replicas <= d[pool].desired <= p.max_replicas
            if d[pool].changed:
                assert -p.max_step_down <= d[pool].desired - d[pool].current <= p.max_step_up
                assert last is None or t - last >= p.cooldown_s
                last = t


# ---- single decisions ---------------------------------------------------------------------
def test_proportional_step_and_its_cap():
    config = replace(CONFIG, prefill=replace(CONFIG.prefill, scale_up_after_s=0, max_replicas=10, max_step_up=3))
    # TTFT 1.5x the SLO on 2 workers: 3 workers
    d = Autoscaler(config).decide(sample(0, ttft=3.0))["prefill"]
    assert (d.current, d.desired) == (2, 3)
    # 4x the queue mark on 2 workers would be 8: capped at +3
    d = Autoscaler(config).decide(sample(0, prefill=PoolSignals(2, queued_tokens_sum=2 * 4 * 4096)))["prefill"]
    assert (d.current, d.desired) == (2, 5) and "capped from 8" in d.reason


def test_no_latency_data_is_neither_over_nor_under():
    scaler = Autoscaler(CONFIG)
    d = scaler.decide(sample(0, ttft=None, itl=None))
    assert d["prefill"].reason.startswith("in band") and "TTFT p90 no data" in d["prefill"].reason
    assert d["decode"].reason.startswith("in band") and "ITL p90 no data" in d["decode"].reason


def test_an_slo_breach_blocks_scale_down_even_when_the_queue_is_empty():
    config = replace(CONFIG, prefill=replace(CONFIG.prefill, scale_up_after_s=600, scale_down_after_s=0))
    d = Autoscaler(config).decide(sample(0, prefill=PoolSignals(3, queued_tokens_sum=0), ttft=2.5))["prefill"]
    assert not d.changed and d.reason.startswith("overloaded for 0s of 600s (TTFT p90 2.5s > SLO 2s)")


def test_cooldown_blocks_a_scale_down_right_after_a_scale_up():
    config = replace(CONFIG, prefill=replace(CONFIG.prefill, scale_up_after_s=0, scale_down_after_s=0, cooldown_s=60))
    scaler = Autoscaler(config)
    assert scaler.decide(sample(0, ttft=5.0))["prefill"].desired == 4
    quiet = PoolSignals(4, queued_tokens_sum=0)
    assert scaler.decide(sample(30, prefill=quiet))["prefill"].reason.startswith("cooldown (30s of 60s")
    assert scaler.decide(sample(60, prefill=quiet))["prefill"].desired == 3


def test_replicas_outside_the_bounds_are_brought_back_at_once():
    config = replace(CONFIG, decode=replace(CONFIG.decode, min_replicas=2))
    d = Autoscaler(config).decide(sample(0, prefill=PoolSignals(6), decode=PoolSignals(1)))
    assert (d["prefill"].desired, d["decode"].desired) == (4, 2)
    assert "outside bounds [1, 4]" in d["prefill"].reason


def test_scale_down_leaves_the_rest_mid_band():
    """2 decode workers at KV 0.3 (the low mark): 1 worker would be at 0.6, above mid-band."""
    config = replace(CONFIG, decode=replace(CONFIG.decode, scale_down_after_s=0))
    d = Autoscaler(config).decide(sample(0, decode=PoolSignals(2, kv_usage_mean=0.3)))["decode"]
    assert not d.changed and "above mid-band" in d.reason
    d = Autoscaler(config).decide(sample(0, decode=PoolSignals(2, kv_usage_mean=0.2)))["decode"]
    assert d.desired == 1


@pytest.mark.parametrize("bad", [dict(min_replicas=0), dict(min_replicas=3, max_replicas=2), dict(cooldown_s=-1),
                                 dict(max_step_up=0), dict(ttft_slo_s=0),
                                 dict(queued_tokens_per_worker_low=5000, queued_tokens_per_worker_high=4096)])
def test_bad_prefill_policy_is_refused(bad):
    with pytest.raises(ValueError):
        PrefillPolicy(**bad)


def test_bad_decode_policy_is_refused():
    with pytest.raises(ValueError, match="kv_usage_high"):
        DecodePolicy(kv_usage_high=1.5)
    with pytest.raises(ValueError, match="kv usage"):
        DecodePolicy(kv_usage_low=0.9)


# ---- histograms ---------------------------------------------------------------------------
BUCKETS = [(0.1, 10), (0.5, 60), (1.0, 90), (math.inf, 100)]


def test_histogram_quantile_known_values():
    assert histogram_quantile(BUCKETS, 0.5) == pytest.approx(0.1 + 0.4 * 40 / 50)  # inside (0.1, 0.5]
    assert histogram_quantile(BUCKETS, 0.9) == pytest.approx(1.0)                  # the top of (0.5, 1.0]
    assert histogram_quantile(BUCKETS, 0.05) == pytest.approx(0.05)                # first bucket from 0
    assert histogram_quantile(BUCKETS, 0.95) == 1.0                                # +inf: highest finite bound
    assert histogram_quantile(list(reversed(BUCKETS)), 0.5) == pytest.approx(0.42)  # order does not matter
    assert histogram_quantile([(0.1, 0), (math.inf, 0)], 0.9) is None              # no data
    with pytest.raises(ValueError):
        histogram_quantile([(0.1, 3), (1.0, 5)], 0.9)                             # no +inf bucket


def test_interval_quantile_covers_only_the_last_interval():
    from prometheus_client import CollectorRegistry, Histogram
    h = Histogram("ttft", "t", registry=CollectorRegistry(), buckets=(0.1, 0.5, 1.0, 5.0))
    window = IntervalQuantile(0.9)
    for _ in range(100):
        h.observe(0.05)
    assert window.update(histogram_buckets(h)) is None  # first call: no interval yet
    for _ in range(10):
        h.observe(3.0)  # a slow interval: over all history p90 would still be 0.1
    assert histogram_quantile(histogram_buckets(h), 0.9) <= 0.1
    assert window.update(histogram_buckets(h)) == pytest.approx(1.0 + 4.0 * 9 / 10)
    assert window.update(histogram_buckets(h)) is None  # nothing observed since


def test_diff_buckets():
    later = [(0.1, 15), (0.5, 70), (1.0, 100), (math.inf, 112)]
    assert diff_buckets(BUCKETS, later) == [(0.1, 5), (0.5, 10), (1.0, 10), (math.inf, 12)]
    restarted = [(0.1, 1), (0.5, 2), (1.0, 2), (math.inf, 2)]
    assert diff_buckets(BUCKETS, restarted) == restarted  # a counter went down: a new histogram
    with pytest.raises(ValueError):
        diff_buckets(BUCKETS, [(0.2, 1), (math.inf, 1)])


# ---- signals from the router's stats ------------------------------------------------------
def stats(wid, role, **kw) -> pb.WorkerStats:
    return pb.WorkerStats(worker_id=wid, role=role, num_blocks=100, **kw)


def test_signals_from_worker_stats():
    prev = {"prefill-0": stats("prefill-0", "prefill", refused=5),
            "prefill-1": stats("prefill-1", "prefill", refused=9), "decode-0": stats("decode-0", "decode", refused=2)}
    now = {"prefill-0": stats("prefill-0", "prefill", queued_prefill_tokens=3000, running=2, waiting=3, refused=7),
           "prefill-1": stats("prefill-1", "prefill", queued_prefill_tokens=1000, running=1, refused=1),  # restarted
           "prefill-2": stats("prefill-2", "prefill", queued_prefill_tokens=500, refused=4),  # new
           "decode-0": stats("decode-0", "decode", kv_usage=0.5, running=10, refused=2),
           "decode-1": stats("decode-1", "decode", kv_usage=0.75, running=12, waiting=1),
           "decode-9": stats("decode-9", "decode", kv_usage=1.0, refused=50),  # stopped answering
           "aggregated-0": stats("aggregated-0", "aggregated", queued_prefill_tokens=99999, refused=99)}
    healthy = {w: w != "decode-9" for w in now}
    s = signals_from_stats(10.0, now, prev_stats=prev, ttft_p90_s=0.8, itl_p90_s=None, healthy=healthy)
    assert (s.t, s.ttft_p90_s, s.itl_p90_s) == (10.0, 0.8, None)
    assert s.prefill == PoolSignals(replicas=3, queued_tokens_sum=4500, queued_tokens_mean=1500.0, kv_usage_mean=0.0,
                                    kv_usage_max=0.0, running=3, waiting=3, refused=2 + 1 + 4)
    assert s.decode == PoolSignals(replicas=2, queued_tokens_sum=0, queued_tokens_mean=0.0, kv_usage_mean=0.625,
                                   kv_usage_max=0.75, running=22, waiting=1, refused=0)
    # the first sample counts no refusals; the actuator's sizes win over the workers reporting
    s = signals_from_stats(0.0, now, replicas={"prefill": 4})
    assert (s.prefill.refused, s.decode.refused) == (0, 0)
    assert (s.prefill.replicas, s.decode.replicas) == (4, 3)
    assert Signals.from_dict(s.to_dict()) == s


class _Pools:
    """The actuator side of AutoscaleLoop (PoolControl's interface), recording the sizes asked."""

    def __init__(self, sizes: dict[str, int]):
        self.pools, self.asked = dict(sizes), []

    def sizes(self) -> dict[str, int]:
        return dict(self.pools)

    async def scale(self, sizes: dict[str, int]) -> dict[str, int]:
        self.asked.append(sizes)
        self.pools |= sizes
        return self.sizes()


def test_loop_grows_a_pool_whose_stats_refresh_slower_than_its_rounds():
    """A busy prefill worker answers its Stats call only between engine steps, so the
    router's copy can be older than one autoscaler round. Such a round is not judged: the
    refusals counted when the stats do arrive keep the overload streak going."""
    import asyncio
    from types import SimpleNamespace

    from pdserve.deploy.autoscale_loop import AutoscaleLoop
    from pdserve.router.metrics import RouterMetrics

    cluster = SimpleNamespace(stats={}, healthy={"prefill-0": True, "decode-0": True})
    router = SimpleNamespace(metrics=RouterMetrics(), cluster=cluster)
    pools = _Pools({"prefill": 1, "decode": 1})
    policy = dict(scale_up_after_s=2.0, cooldown_s=0.0, max_replicas=2)
    loop = AutoscaleLoop(router, pools, AutoscalerConfig(prefill=PrefillPolicy(**policy), decode=DecodePolicy(**policy)),
                         log=lambda msg: None, interval_s=1.0)
    decode = stats("decode-0", "decode", kv_usage=0.5)
    refused = 0
    for t in range(8):
        if t % 2 == 0:  # the prefill worker's stats arrive every other round, 40 more refusals each time
            refused += 40
            cluster.stats = {"prefill-0": stats("prefill-0", "prefill", refused=refused), "decode-0": decode}
        decode = cluster.stats["decode-0"] = stats("decode-0", "decode", kv_usage=0.5)
        asyncio.run(loop.tick(now=float(t)))
    assert pools.asked == [{"prefill": 2}]
