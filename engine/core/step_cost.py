"""What a step costs, learned from the steps run: `StepCost` fits seconds = a + b * tokens +
c * context by least squares over recent steps (older ones decay), so the scheduler can size the less urgent
work that shares an urgent request's step to a time budget; `StepTimes` keeps the steps'
seconds as a histogram per kind of step (contended: a more urgent request running beside
less urgent ones on this worker; window: only less urgent work, within the urgent window;
plain), which each worker's /metrics serves."""
from __future__ import annotations

from dataclasses import dataclass, field

# 1 ms to 4 s, each bucket sqrt(2) wide: a step's time against another's within that
ROW_FIT_ROWS = 8  # decode-only steps of at most this many rows teach what a row adds to a small step
BUCKETS = tuple(round(0.001 * 2 ** (k / 2), 6) for k in range(25)) + (float("inf"),)


@dataclass
class StepCost:
    """seconds = a + b * tokens + c * context: `tokens` the step's new tokens (the matmuls'
    rows), `context` the keys its attention reads (each chunk's tokens so far, its own
    included). A decode row of a long prompt reads its whole KV each step: on a 2-core Zen 4 one
    such row (1,000 tokens) beside a short urgent decode made the step 2.5x, where its one
    matmul row cost next to nothing."""
    decay: float = 0.98  # each step's weight in the fit shrinks by this at every later step
    _s: dict = field(default_factory=lambda: dict.fromkeys(("w", "n", "c", "t", "nn", "nc", "cc", "nt", "ct"), 0.0))
    # the same fit over decode-only steps of at most ROW_FIT_ROWS rows: what one more row adds to
    # a small step, as an urgent decode's is. A fit over short prompt chunks too, or over whole
    # batches, says less (a chunk's tokens share its matmuls better, and a batch's rows amortize
    # the step's fixed work): on the Xeon a second row made a 12 ms one-row step 15 ms in a
    # cluster, and those fits (1.5-2 ms a row) let it into a step of 15% budget
    _rows: "StepCost | None" = None

    def observe(self, seconds: float, tokens: int, context: int = 0, rows: bool = False) -> None:
        """A step of `tokens` new tokens that read `context` keys took `seconds`; `rows`: all
        its chunks were single tokens (decode rows; up to ROW_FIT_ROWS of them, the row fit's too)."""
        if rows and tokens <= ROW_FIT_ROWS:
            if self._rows is None:
                self._rows = StepCost(self.decay)
            self._rows.observe(seconds, tokens, context)
        d, s = self.decay, self._s
        for k, v in (("w", 1.0), ("n", tokens), ("c", context), ("t", seconds), ("nn", tokens * tokens),
                     ("nc", tokens * context), ("cc", context * context), ("nt", tokens * seconds),
                     ("ct", context * seconds)):
            s[k] = d * s[k] + v

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) by least squares, b and c >= 0 (a slope the data cannot tell apart from the
        other, or that comes out negative, is 0); None until steps of different sizes ran."""
        s = self._s
        if s["w"] < 2:
            return None
        w = s["w"]
        mn, mc, mt = s["n"] / w, s["c"] / w, s["t"] / w
        vnn, vcc, vnc = s["nn"] / w - mn * mn, s["cc"] / w - mc * mc, s["nc"] / w - mn * mc
        vnt, vct = s["nt"] / w - mn * mt, s["ct"] / w - mc * mt
        tiny = 1e-9
        b = c = 0.0
        det = vnn * vcc - vnc * vnc
        if vnn > tiny * max(1.0, mn * mn) and vcc > tiny * max(1.0, mc * mc) and det > 1e-6 * vnn * vcc:
            b, c = (vnt * vcc - vct * vnc) / det, (vct * vnn - vnt * vnc) / det
        if b <= 0 or c <= 0:  # one slope alone
            b = vnt / vnn if vnn > tiny * max(1.0, mn * mn) else 0.0
            c = 0.0
            if b <= 0:
                b, c = 0.0, (vct / vcc if vcc > tiny * max(1.0, mc * mc) else 0.0)
        if b <= 0 and c <= 0:
            return None
        return max(0.0, mt - b * mn - c * mc), max(b, 0.0), max(c, 0.0)

    def _row_fit(self) -> tuple[float, float, float] | None:
        """The decode-only steps' fit once it is known, else the fit over all."""
        fit = None if self._rows is None else self._rows.fit()
        return fit if fit is not None else self.fit()

    def allowance(self, own_tokens: int, own_context: int, budget: float) -> float | None:
        """Seconds of less urgent decode rows that fit beside the urgent requests' decodes
        (`own_tokens` rows reading `own_context` keys) while the step stays within (1 +
        `budget`) times what theirs alone take; None until a fit is known."""
        fit = self._row_fit()
        if fit is None:
            return None
        a, b, c = fit
        return budget * (a + b * own_tokens + c * own_context)

    def chunk_seconds(self, tokens: int, start: int) -> float:
        """What a prompt chunk of `tokens` from position `start` adds to a step (0 until the fit
        is known); a decode row is a chunk of one token."""
        fit = self.fit()
        return 0.0 if fit is None else fit[1] * tokens + fit[2] * (start + tokens)

    def chunk_tokens(self, seconds: float, start: int) -> int:
        """The most tokens a prompt chunk from position `start` may take to add at most
        `seconds` to a step (a large number until the fit is known)."""
        fit = self.fit()
        if fit is None or fit[1] + fit[2] <= 0:
            return 1 << 30
        return max(int((seconds - fit[2] * start) // (fit[1] + fit[2])), 0)

    def row_seconds(self, context: int, small: bool = False) -> float:
        """What one more decode row whose attention reads `context` keys adds to a step (0 until
        the fit is known). `small`: to a small step beside urgent decodes, the larger of the
        small decode-only steps' estimate and the fit over all (either may run low: a few noisy
        small steps, or chunks and batches); else the fit over all, which sizes window steps."""
        fits = [self.fit()] + ([self._row_fit()] if small else [])
        return max((f[1] + f[2] * context for f in fits if f is not None), default=0.0)


STEP_KINDS = ("plain", "contended", "window")


@dataclass
class StepTimes:
    """Steps' seconds in BUCKETS (cumulative counts, as Prometheus keeps them), per kind
    (STEP_KINDS)."""
    counts: dict[str, list[int]] = field(default_factory=lambda: {k: [0] * len(BUCKETS) for k in STEP_KINDS})
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))

    def add(self, seconds: float, contended: bool, window: bool = False) -> None:
        kind = "contended" if contended else "window" if window else "plain"
        counts = self.counts[kind]
        for i, edge in enumerate(BUCKETS):
            if seconds <= edge:
                counts[i] += 1
        self.sums[kind] += seconds

    def snapshot(self) -> dict:
        return {k: (list(v), self.sums[k]) for k, v in self.counts.items()}
