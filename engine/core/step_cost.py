"""What a step costs, learned from the steps run: `StepCost` fits seconds = a + b * tokens by
least squares over recent steps (older ones decay), so the scheduler can size the less urgent
work that shares an urgent request's step to a time budget; `StepTimes` keeps the steps'
seconds as a histogram, apart for contended steps (a more urgent request running beside
less urgent ones on this worker), which each worker's /metrics serves."""
from __future__ import annotations

from dataclasses import dataclass, field

# 1 ms to 4 s, each bucket sqrt(2) wide: a step's time against another's within that
BUCKETS = tuple(round(0.001 * 2 ** (k / 2), 6) for k in range(25)) + (float("inf"),)


@dataclass
class StepCost:
    decay: float = 0.98  # each step's weight in the fit shrinks by this at every later step
    _w: float = 0.0
    _n: float = 0.0
    _t: float = 0.0
    _nn: float = 0.0
    _nt: float = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        d = self.decay
        self._w, self._n, self._t = d * self._w + 1, d * self._n + tokens, d * self._t + seconds
        self._nn, self._nt = d * self._nn + tokens * tokens, d * self._nt + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds of a step = a + b * tokens; None until steps of different sizes ran."""
        if self._w < 2:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):
            return None
        b = (self._nt / self._w - mean_n * mean_t) / var
        if b <= 0:
            return None
        return max(0.0, mean_t - b * mean_n), b

    def extra_tokens(self, own_tokens: int, budget: float, default: int) -> int:
        """How many tokens of less urgent work fit beside `own_tokens` of the urgent requests'
        while the step stays within (1 + `budget`) times what their tokens alone take; `default`
        until the fit is known."""
        fit = self.fit()
        if fit is None:
            return default
        a, b = fit
        return max(0, int(budget * (a + b * own_tokens) / b))


@dataclass
class StepTimes:
    """Steps' seconds in BUCKETS (cumulative counts, as Prometheus keeps them), per kind."""
    counts: dict[bool, list[int]] = field(default_factory=lambda: {False: [0] * len(BUCKETS),
                                                                  True: [0] * len(BUCKETS)})
    sums: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})

    def add(self, seconds: float, contended: bool) -> None:
        counts = self.counts[contended]
        for i, edge in enumerate(BUCKETS):
            if seconds <= edge:
                counts[i] += 1
        self.sums[contended] += seconds

    def snapshot(self) -> dict:
        return {k: (list(v), self.sums[k]) for k, v in self.counts.items()}
