"""The autoscaler's decision core: how many prefill and decode workers each pool should have.

In: a `Signals` sample every few seconds (build it with `signals_from_stats` from the router's
`cluster.stats` and the TTFT/ITL p90 of the last interval, see `IntervalQuantile`). Out: one
`Decision` per pool (current and desired replicas, and a reason an SRE can read in the logs).
The caller (`pdserve up --autoscale`) applies `desired` with `Pool.scale(n)`. Pure: no I/O, no
clock, no asyncio, no Ray; the time is the sample's `t`.

Each pool is judged on its own signals, so a decode overload never scales prefill:
- prefill: TTFT p90 against `ttft_slo_s`, queued prefill tokens per worker against watermarks;
- decode: ITL p90 against `itl_slo_s`, mean KV-block usage against watermarks;
- both: requests refused at a worker's queue limit since the last sample.
A pool is *over* when any signal is above its high mark (or refusals happened), *under* when
its load is at or below the low mark with no SLO breach and no refusals, else *in band*. A
missing latency (no requests in the interval) counts as neither over nor under. Hysteresis: a
pool changes only after being over (under) *continuously* for `scale_up_after_s`
(`scale_down_after_s`), never within `cooldown_s` of its last change, by at most
`max_step_up`/`max_step_down`, and always within `[min_replicas, max_replicas]`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

POOLS = ("prefill", "decode")

Buckets = list[tuple[float, float]]  # (upper bound, cumulative count), the last bound +inf


# ---- configuration ------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolPolicy:
    """How one pool may be resized; its load targets are in `PrefillPolicy`/`DecodePolicy`."""

    min_replicas: int = 1
    """Fewest workers. At least 1: a pool at zero cannot serve, and an idle pool sends no
    signal that could wake it."""
    max_replicas: int = 4
    """Most workers (what the Ray cluster's CPUs/GPUs can hold)."""
    scale_up_after_s: float = 30.0
    """Overloaded continuously this long before adding workers (rides out short spikes)."""
    scale_down_after_s: float = 300.0
    """Under the low marks continuously this long before removing workers; longer than up,
    because capacity removed too early costs the SLO, capacity kept too long only money."""
    cooldown_s: float = 60.0
    """No change within this long of the pool's last one: new workers need time to start
    and take load before the signals can show their effect."""
    max_step_up: int = 2
    """Most workers added at once."""
    max_step_down: int = 1
    """Most workers removed at once."""

    def __post_init__(self):
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        for name in ("scale_up_after_s", "scale_down_after_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("max_step_up and max_step_down must be >= 1")

    def _check_marks(self, low: float, high: float, what: str) -> None:
        if not 0 <= low < high:
            raise ValueError(f"{what}: need 0 <= low ({low}) < high ({high})")


@dataclass(frozen=True)
class PrefillPolicy(PoolPolicy):
    """The prefill pool: sized from queued prompt tokens and time to first token."""

    ttft_slo_s: float = 2.0
    """Target p90 time to first token (set it for your model and hardware)."""
    queued_tokens_per_worker_high: int = 4096
    """Over above this many queued prefill tokens per worker (a few seconds of prefill work
    for a small model on CPU)."""
    queued_tokens_per_worker_low: int = 512
    """Under at or below this many queued prefill tokens per worker."""

    def __post_init__(self):
        super().__post_init__()
        if self.ttft_slo_s <= 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")
        self._check_marks(self.queued_tokens_per_worker_low, self.queued_tokens_per_worker_high, "queued tokens")


@dataclass(frozen=True)
class DecodePolicy(PoolPolicy):
    """The decode pool: sized from KV-block usage and inter-token latency."""

    itl_slo_s: float = 0.1
    """Target p90 inter-token latency (0.1 s: 10 tokens/s per stream)."""
    kv_usage_high: float = 0.85
    """Over above this mean fraction of KV blocks in use (near full, requests wait or preempt)."""
    kv_usage_low: float = 0.3
    """Under at or below this mean fraction of KV blocks in use."""

    def __post_init__(self):
        super().__post_init__()
        if self.itl_slo_s <= 0:
            raise ValueError(f"itl_slo_s must be > 0, got {self.itl_slo_s}")
        if self.kv_usage_high > 1:
            raise ValueError(f"kv_usage_high must be <= 1, got {self.kv_usage_high}")
        self._check_marks(self.kv_usage_low, self.kv_usage_high, "kv usage")


@dataclass(frozen=True)
class AutoscalerConfig:
    """Both pools' policies (the autoscaler is opt-in: `pdserve up --autoscale`)."""

    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    decode: DecodePolicy = field(default_factory=DecodePolicy)


# ---- signals ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolSignals:
    """One pool's load at one sample."""

    replicas: int                  # the pool's current size (the target given to Pool.scale)
    queued_tokens_sum: int = 0     # queued prefill tokens over the pool's workers
    queued_tokens_mean: float = 0.0  # the same per reporting worker (for the logs)
    kv_usage_mean: float = 0.0     # fraction of KV blocks in use, mean over workers
    kv_usage_max: float = 0.0
    running: int = 0
    waiting: int = 0
    refused: int = 0               # requests refused at a queue limit since the last sample


@dataclass(frozen=True)
class Signals:
    """One sample of both pools, at time `t` (seconds, any monotonic origin)."""

    t: float
    prefill: PoolSignals
    decode: PoolSignals
    ttft_p90_s: float | None = None  # None: no first token in the interval
    itl_p90_s: float | None = None   # None: no token streamed in the interval

    @classmethod
    def from_dict(cls, d: Mapping) -> Signals:
        """From a trace line (`to_dict`'s shape); a "note" key is allowed and ignored."""
        d = {k: v for k, v in d.items() if k != "note"}
        return cls(**{**d, "prefill": PoolSignals(**d["prefill"]), "decode": PoolSignals(**d["decode"])})

    def to_dict(self) -> dict:
        return asdict(self)

    def with_replicas(self, replicas: Mapping[str, int]) -> Signals:
        """The same sample with the pools' sizes replaced (replaying a trace)."""
        return replace(self, **{p: replace(getattr(self, p), replicas=n) for p, n in replicas.items()})


def _refused_since(now: int, before: int | None) -> int:
    # a worker new since the last sample counts its whole counter; a restarted one restarts at 0
    return now if before is None or now < before else now - before


def signals_from_stats(t: float, stats: Mapping, *, prev_stats: Mapping | None = None,
                       ttft_p90_s: float | None = None, itl_p90_s: float | None = None,
                       replicas: Mapping[str, int] | None = None,
                       healthy: Mapping[str, bool] | None = None) -> Signals:
    """Build a sample from what the router has.

    Args:
        stats: `router.cluster.stats`, worker id -> `protos.worker_pb2.WorkerStats`.
        prev_stats: the `stats` of the previous sample (a shallow `dict(...)` copy: `refresh`
            replaces the messages, it does not mutate them); refusals are the difference of
            the workers' cumulative `refused` counters. None (the first sample): 0 refusals,
            so refusals from before the autoscaler started do not count.
        ttft_p90_s, itl_p90_s: latency p90 over the last interval (`IntervalQuantile`).
        replicas: each pool's current size as the actuator knows it; default: the workers
            reporting. Prefer the actuator's: a worker still starting reports nothing.
        healthy: `router.cluster.healthy`; when given, stale stats of workers that stopped
            answering are left out.
    Workers of role "aggregated" belong to neither pool and are not counted.
    """
    pools = {}
    for pool in POOLS:
        ws = [(wid, s) for wid, s in stats.items()
              if s.role == pool and (healthy is None or healthy.get(wid, False))]
        kv = [s.kv_usage for _, s in ws]
        queued = sum(s.queued_prefill_tokens for _, s in ws)
        refused = 0 if prev_stats is None else sum(
            _refused_since(s.refused, prev_stats[wid].refused if wid in prev_stats else None) for wid, s in ws)
        pools[pool] = PoolSignals(
            replicas=replicas[pool] if replicas and pool in replicas else len(ws),
            queued_tokens_sum=queued, queued_tokens_mean=queued / len(ws) if ws else 0.0,
            kv_usage_mean=sum(kv) / len(kv) if kv else 0.0, kv_usage_max=max(kv, default=0.0),
            running=sum(s.running for _, s in ws), waiting=sum(s.waiting for _, s in ws), refused=refused)
    return Signals(t, pools["prefill"], pools["decode"], ttft_p90_s, itl_p90_s)


# ---- latency percentiles from Prometheus histograms ---------------------------------------
def histogram_quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile of a cumulative histogram, as Prometheus' `histogram_quantile` computes
    it: linear interpolation inside the bucket holding the rank (from 0 for the first bucket);
    a rank in the +inf bucket answers the highest finite bound. None when it has no
    observations."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    buckets = sorted(buckets)
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        raise ValueError("need at least one finite bucket and a last +inf bucket")
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, below = (0.0, 0.0) if b == 0 else buckets[b - 1]
    end, count = buckets[b]
    if count == below:  # q == 0 with an empty first bucket
        return start
    return start + (end - start) * (rank - below) / (count - below)


def diff_buckets(before: Buckets, after: Buckets) -> Buckets:
    """The observations between two snapshots of the same cumulative histogram. A count
    that went down means the histogram restarted (a new router): `after` is all there is."""
    before, after = sorted(before), sorted(after)
    if [ub for ub, _ in before] != [ub for ub, _ in after]:
        raise ValueError("snapshots of different histograms (bucket bounds differ)")
    if any(a < b for (_, b), (_, a) in zip(before, after)):
        return after
    return [(ub, a - b) for (ub, b), (_, a) in zip(before, after)]


def histogram_buckets(histogram) -> Buckets:
    """The cumulative buckets of an unlabelled prometheus_client Histogram
    (e.g. `RouterMetrics.ttft`), read from its `collect()`."""
    return sorted((float(s.labels["le"]), s.value) for family in histogram.collect()
                  for s in family.samples if s.name.endswith("_bucket"))


class IntervalQuantile:
    """The q-quantile of the observations since the previous `update`: the autoscaler
    reacts to the last interval, not to the histogram's whole history."""

    def __init__(self, q: float = 0.9):
        self.q = q
        self._last: Buckets | None = None

    def update(self, buckets: Buckets) -> float | None:
        """None on the first call (no interval yet) and when the interval had no data."""
        last, self._last = self._last, sorted(buckets)
        return None if last is None else histogram_quantile(diff_buckets(last, self._last), self.q)


# ---- decisions ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """What to do with one pool, and why (log `str(decision)`)."""

    pool: str
    current: int
    desired: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def __str__(self) -> str:
        head = f"{self.current} -> {self.desired}" if self.changed else f"hold at {self.current}"
        return f"{self.pool} {head}: {self.reason}"


@dataclass(frozen=True)
class _Assessment:
    state: str     # "over" | "under" | "band"
    ratio: float   # observed / target of the worst over-signal (> 1 when over)
    floor: int     # fewest workers that leave the load mid-band (bounds a scale-down)
    why: str       # the measurements against their marks


@dataclass
class _PoolState:
    over_since: float | None = None
    under_since: float | None = None
    last_change_t: float | None = None


def _fmt(x: float | None) -> str:
    return "no data" if x is None else f"{x:.3g}s"


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"  # token counts in full, fractions short


def _assess(n: int, latency: float | None, slo: float, lat_name: str, load: float, low: float,
            high: float, load_name: str, refused: int) -> _Assessment:
    """Classify one pool. `load` is per worker, so n * load / x is the workers at load x."""
    over, ratios = [], [1.0]
    if latency is not None and latency > slo:
        over.append(f"{lat_name} p90 {latency:.3g}s > SLO {slo:g}s")
        ratios.append(latency / slo)
    if load > high:
        over.append(f"{load_name} {_num(load)} > high {high:g}")
        ratios.append(load / high)
    if refused:
        over.append(f"{refused} refused at queue limit")
        ratios.append((n + 1) / n)  # refusals say "too few", not by how much: one more
    # removing workers must leave the rest mid-band, not just under the high mark: less flapping
    floor = math.ceil(n * load / ((low + high) / 2) - 1e-9)
    if over:
        return _Assessment("over", max(ratios), floor, "; ".join(over))
    why = f"{load_name} {_num(load)} (low {low:g}, high {high:g}), {lat_name} p90 {_fmt(latency)}"
    return _Assessment("under" if load <= low else "band", 1.0, floor, why)


def _assess_prefill(p: PrefillPolicy, s: Signals) -> _Assessment:
    # per worker of the pool's size, not of the workers reporting: a worker still starting
    # will take its share, and scaling up must lower the load the next sample shows
    n = max(s.prefill.replicas, 1)
    return _assess(n, s.ttft_p90_s, p.ttft_slo_s, "TTFT", s.prefill.queued_tokens_sum / n,
                   p.queued_tokens_per_worker_low, p.queued_tokens_per_worker_high, "queued tokens/worker",
                   s.prefill.refused)


def _assess_decode(p: DecodePolicy, s: Signals) -> _Assessment:
    return _assess(max(s.decode.replicas, 1), s.itl_p90_s, p.itl_slo_s, "ITL", s.decode.kv_usage_mean,
                   p.kv_usage_low, p.kv_usage_high, "KV usage", s.decode.refused)


class Autoscaler:
    """Decides each pool's size from successive `Signals`. Its only state is the hysteresis
    bookkeeping: since when each pool has been over/under, and when it last changed."""

    def __init__(self, config: AutoscalerConfig | None = None):
        self.config = config or AutoscalerConfig()
        self._state = {pool: _PoolState() for pool in POOLS}

    def decide(self, signals: Signals) -> dict[str, Decision]:
        """One decision per pool ("prefill", "decode"). Feed samples in time order; apply
        each changed decision (`Pool.scale(d.desired)`) and report the new size as the next
        sample's `replicas`."""
        c, t = self.config, signals.t
        return {"prefill": self._decide("prefill", c.prefill, t, signals.prefill.replicas,
                                        _assess_prefill(c.prefill, signals)),
                "decode": self._decide("decode", c.decode, t, signals.decode.replicas,
                                       _assess_decode(c.decode, signals))}

    def _decide(self, pool: str, p: PoolPolicy, t: float, n: int, a: _Assessment) -> Decision:
        st = self._state[pool]
        # the streaks: any sample of the other kind, or in band, breaks continuity
        st.over_since = (st.over_since if st.over_since is not None else t) if a.state == "over" else None
        st.under_since = (st.under_since if st.under_since is not None else t) if a.state == "under" else None

        def hold(reason: str) -> Decision:
            return Decision(pool, n, n, reason)

        def change(desired: int, reason: str) -> Decision:
            # the next change must be earned by signals measured after this one
            st.last_change_t, st.over_since, st.under_since = t, None, None
            return Decision(pool, n, desired, reason)

        # the bounds are configuration, not load: enforced at once, whatever the signals
        bounded = min(max(n, p.min_replicas), p.max_replicas)
        if bounded != n:
            return change(bounded, f"outside bounds [{p.min_replicas}, {p.max_replicas}]")
        if st.last_change_t is not None and t - st.last_change_t < p.cooldown_s:
            return hold(f"cooldown ({t - st.last_change_t:.0f}s of {p.cooldown_s:g}s since the last change); "
                        f"{a.state}: {a.why}")
        if a.state == "over":
            held = t - st.over_since
            if n >= p.max_replicas:
                return hold(f"overloaded but at max_replicas {p.max_replicas} ({a.why})")
            if held < p.scale_up_after_s:
                return hold(f"overloaded for {held:.0f}s of {p.scale_up_after_s:g}s ({a.why})")
            target = max(n + 1, math.ceil(n * a.ratio - 1e-9))  # proportional to the worst signal
            desired = min(target, n + p.max_step_up, p.max_replicas)
            capped = f", capped from {target}" if desired < target else ""
            return change(desired, f"scale up: overloaded for {held:.0f}s ({a.why}){capped}")
        if a.state == "under":
            held = t - st.under_since
            if n <= p.min_replicas:
                return hold(f"underloaded but at min_replicas {p.min_replicas} ({a.why})")
            if held < p.scale_down_after_s:
                return hold(f"underloaded for {held:.0f}s of {p.scale_down_after_s:g}s ({a.why})")
            desired = max(n - p.max_step_down, a.floor, p.min_replicas)
            if desired >= n:
                return hold(f"underloaded, but {n - 1} workers would leave the load above mid-band ({a.why})")
            return change(desired, f"scale down: underloaded for {held:.0f}s ({a.why})")
        return hold(f"in band ({a.why})")
