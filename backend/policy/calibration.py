"""Online calibration of the latency model: how much slower (or faster) the engine runs than its
profile says, learned from every iteration's predicted and measured time.

A profile is measured once, on one machine; the engine it plans for may run slower (another
process takes the CPU, a different GPU, thermal limits). `LatencyCalibration` keeps one
multiplicative factor per *batch regime* so that

    corrected prediction = factor[regime] × model prediction

Regimes (`regime_of`): the three batch kinds whose cost has a different bottleneck, so that a
change of machine or of load moves them by different amounts —

    DECODE   decodes only: memory-bandwidth bound plus the per-iteration CPU overhead (launch,
             sampling, the scheduler's Python), which dominates small decode batches
    PREFILL  prefill chunks only: compute bound (FLOP/s)
    MIXED    both in one extend batch (SGLang runs the decodes as 1-token extends: its own
             kernels and, on the CPU backend, its own attention cost)

e.g. an H200 in place of the profiled H100 speeds decodes up by its bandwidth (×1.4) and leaves
prefill almost as it was; a busy host CPU slows small decode batches far more than long chunks.
A regime with no sample of its own yet uses the pooled factor (learned from every iteration),
so a stale profile never keeps a rarely seen batch kind optimistic. Nor does a regime with
*little* evidence of its own: its estimate is its own samples' weighted mean plus, for the weight
they do not carry yet, the pooled estimate *as it is now* (not as it was at the regime's first
sample). A regime seen for a few iterations at the start of a run, before the pooled factor
learned the engine's pace, would otherwise keep those iterations' factor — measured: prompt-only
batches on an engine twice as slow as profiled kept 1.1–1.3 for minutes while every other batch
said 2, because the policy rarely plans a batch without decodes once RT is running. A regime
with seconds of evidence of its own is its own: the pooled one no longer moves it (see
`test_regimes_learn_independently_and_an_unseen_one_uses_the_pooled_factor`).

Estimator, per regime and pooled: two exponentially weighted means of log(measured/predicted),
a fast one (time constant `tau_fast_s`) and a slow one (`tau_slow_s`); the factor is exp of the
larger. The time constants are in seconds of engine time — each sample weighs
1 − exp(−dt/τ), dt the iteration's *expected* duration (factor × prediction, not the measured
one: weighting by the noisy measurement would bias the mean upward by σ²) — so the estimate
converges equally fast at any iteration rate. Except for a surprise: an iteration that took
more than twice its expected time weighs half its measured time, up to τ_fast / 2
(`SURPRISE_WEIGHT`). When the engine turns 10× slower than believed (a CPU-bound neighbour on a
small host), its iterations come 10× less often, and at the expected weight the factor would take
10× as long in wall time to learn it; ordinary noise (σ = 0.3: 1 % of samples beyond 2×) is
hardly affected. The max of the two makes the factor rise at the fast pace (an engine that
became slower is believed within ~2 τ_fast: being late costs RT its SLO) and fall at the slow
pace (an engine that became faster is believed within ~2 τ_slow: being conservative for a few
seconds costs only a little BE throughput). Each mean alone is unbiased for the median of the
ratio; the max adds an upward bias of a fraction of the fast mean's noise (≈ 1 % for σ = 0.3
lognormal noise at 30 ms iterations), on the safe side.

Robustness: a sample's log-ratio is clipped to ±log(`clip_ratio`) around each estimate (a 10×
stall moves the factor no more than a 4× one), and both means stay within
[log `min_factor`, log `max_factor`] (no wind-up, no divergence; 1/256…256 by default: a
spinning neighbour on a 2-core host slows small CPU decode batches ×60 — torch's worker threads
wait for each other — and a bound below the real slowdown would leave the model optimistic for
as long as it lasts). Exactness: a ratio within
`exact_tol` of 1 counts as exactly 1, so an engine that runs as its profile predicts (the
simulator, whose two evaluations of the same model may differ in the last bit) keeps every
factor at exactly 1.0 and the planner's arithmetic bit-for-bit unchanged.

It also keeps the model's error over the last `window` iterations: |predicted − measured| /
measured before correction (how good the profile is for this engine) and after (how good the
calibrated prediction is), with p50/p99 on demand.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

DECODE = 0
"""Regime of a batch with decodes only."""
PREFILL = 1
"""Regime of a batch with prefill chunks only."""
MIXED = 2
"""Regime of a batch with both."""
REGIMES = ("decode", "prefill", "mixed")
"""Regime names, by index."""


def regime_of(num_prefill: int | float, num_decode: int | float) -> int:
    """The regime of a batch with `num_prefill` chunks and `num_decode` decodes (an empty batch
    counts as DECODE; it costs nothing anyway)."""
    if num_prefill == 0:
        return DECODE
    return PREFILL if num_decode == 0 else MIXED


def budget_pace(factors: tuple[float, ...], pace_max: float) -> float:
    """How much an iteration budget stretches on an engine whose learned pace is *factors*
    (one per regime): their geometric mean, within [1, pace_max]. A budget given in the
    profile's seconds buys the same work on a slower engine; a faster engine keeps the budget
    in wall seconds (its iterations get shorter anyway)."""
    if pace_max <= 1.0:  # wall seconds whatever the pace (every forecast asks: skip the logs)
        return 1.0
    finite = [f for f in factors if math.isfinite(f) and f > 0.0]
    if not finite:
        return 1.0
    mean = math.exp(sum(math.log(f) for f in finite) / len(finite))
    return min(max(mean, 1.0), pace_max)


SURPRISE_WEIGHT = 0.5
"""A sample weighs max(expected duration, min(this × measured duration, τ_fast / 2)) seconds of
engine time, or its measured duration when that is less than this × the expected one: only an
iteration more than 1 / this × slower or faster than expected weighs other than usual,
and no single one more than τ_fast / 2 (one stall moves the factor by ×1.7 at most, for about a
second; a sustained slowdown of ×40 is learned in about six iterations)."""


class _LogMean:
    """One estimator: the fast and slow time-weighted means of the log-ratio.

    A regime's means start from a prior (the pooled means) and are kept split in two: the
    weighted sum of its own samples (`fast`, `slow`) and the weight the prior still carries
    (`prior_fast`, `prior_slow`: 1 before any sample, × (1 − a) with each sample of weight a).
    The mean is own part + prior weight × the prior's current value. The pooled estimator has
    no prior (weight 0)."""

    __slots__ = ("fast", "prior_fast", "prior_slow", "slow")

    def __init__(self, prior_weight: float = 0.0) -> None:
        self.fast = 0.0
        self.slow = 0.0
        self.prior_fast = prior_weight
        self.prior_slow = prior_weight

    def means(self, prior: _LogMean | None) -> tuple[float, float]:
        """(fast, slow) means with the prior's weight on `prior`'s current means."""
        if prior is None:
            return self.fast, self.slow
        return (
            self.fast + self.prior_fast * prior.fast,
            self.slow + self.prior_slow * prior.slow,
        )

    def log_factor(self, prior: _LogMean | None) -> float:
        fast, slow = self.means(prior)
        return fast if fast > slow else slow


class LatencyCalibration:
    """Per-regime correction factors of a latency model, learned online (module docstring)."""

    def __init__(
        self,
        *,
        tau_fast_s: float = 0.5,
        tau_slow_s: float = 2.0,
        min_factor: float = 1 / 256,
        max_factor: float = 256.0,
        clip_ratio: float = 4.0,
        exact_tol: float = 1e-6,
        window: int = 1000,
    ) -> None:
        if not 0 < tau_fast_s <= tau_slow_s:
            raise ValueError("need 0 < tau_fast_s ≤ tau_slow_s")
        if not 0 < min_factor <= 1.0 <= max_factor:
            raise ValueError("need 0 < min_factor ≤ 1 ≤ max_factor")
        if clip_ratio <= 1.0 or window < 1 or exact_tol < 0:
            raise ValueError("need clip_ratio > 1, window ≥ 1, exact_tol ≥ 0")
        self.tau_fast_s = tau_fast_s
        self.tau_slow_s = tau_slow_s
        self.min_factor = min_factor
        self.max_factor = max_factor
        self._lo = math.log(min_factor)
        self._hi = math.log(max_factor)
        self._clip = math.log(clip_ratio)
        self.exact_tol = exact_tol
        self._regimes = [_LogMean(prior_weight=1.0) for _ in REGIMES]
        self._pooled = _LogMean()
        self._errors: deque[float] = deque(maxlen=window)
        self._corrected_errors: deque[float] = deque(maxlen=window)
        self.factors: tuple[float, float, float] = (1.0, 1.0, 1.0)
        """The current factor of each regime (DECODE, PREFILL, MIXED)."""
        self.samples = 0
        """Samples taken (iterations with a positive prediction and measurement)."""
        self.last_error: float | None = None
        """|predicted − measured| / measured of the latest sample, before correction."""
        self.last_corrected_error: float | None = None
        """The same after correction (with the factor in force when it was predicted)."""
        self._predicted_total_s = [0.0 for _ in REGIMES]
        self._measured_total_s = [0.0 for _ in REGIMES]

    def factor(self, regime: int) -> float:
        """The correction factor of `regime`."""
        return self.factors[regime]

    def observe(self, predicted_s: float, measured_s: float, regime: int) -> None:
        """One iteration: the model's (uncorrected) prediction, the measured time, the regime
        of the batch. Samples without a positive, finite prediction and measurement are
        ignored."""
        if not (0 < predicted_s < math.inf and 0 < measured_s < math.inf):
            return
        used = self.factors[regime]
        self.samples += 1
        self.last_error = abs(predicted_s - measured_s) / measured_s
        self.last_corrected_error = abs(used * predicted_s - measured_s) / measured_s
        self._errors.append(self.last_error)
        self._predicted_total_s[regime] += predicted_s
        self._measured_total_s[regime] += measured_s
        self._corrected_errors.append(self.last_corrected_error)
        x = math.log(measured_s / predicted_s)
        if abs(x) <= self.exact_tol:
            x = 0.0
        est = self._regimes[regime]
        # The sample's weight in engine time: its expected duration (free of its own noise),
        # or half the measured one when that is longer — an engine far slower than believed
        # must not take as many samples to learn it as at the old pace (their rate dropped) —
        # or the measured one when that is less than half of it: a run of iterations far faster
        # than believed (a neighbour pausing for a second) comes at a higher rate, and at the
        # expected weight it would take the factor down in a fraction of τ_slow of wall time.
        expected_s = used * predicted_s
        if measured_s < SURPRISE_WEIGHT * expected_s:
            dt = measured_s
        else:
            dt = max(expected_s, min(SURPRISE_WEIGHT * measured_s, self.tau_fast_s / 2))
        pooled = self._pooled
        self._update(est, x, dt, pooled)
        self._update(pooled, x, dt, None)
        d, p, m = (
            math.exp(min(self._hi, max(self._lo, e.log_factor(pooled)))) for e in self._regimes
        )
        self.factors = (d, p, m)

    def _update(self, est: _LogMean, x: float, dt: float, prior: _LogMean | None) -> None:
        """One sample `x` of weight `dt` seconds into `est` (whose prior is `prior`'s current
        means): each mean moves toward the sample, clipped around the mean, kept within the
        factor bounds; the prior's weight shrinks by the sample's."""
        fast, slow = est.means(prior)
        weight_fast = -math.expm1(-dt / self.tau_fast_s)
        weight_slow = -math.expm1(-dt / self.tau_slow_s)
        new_fast = self._step(fast, x, weight_fast)
        new_slow = self._step(slow, x, weight_slow)
        if prior is None:
            est.fast, est.slow = new_fast, new_slow
            return
        # own part = the new mean less what the (smaller) prior weight contributes
        est.prior_fast *= 1.0 - weight_fast
        est.prior_slow *= 1.0 - weight_slow
        est.fast = new_fast - est.prior_fast * prior.fast
        est.slow = new_slow - est.prior_slow * prior.slow

    def _step(self, old: float, x: float, weight: float) -> float:
        """`old` moved toward the sample `x` by `weight` (in [0, 1]), the sample clipped
        around `old`, the result kept within the factor bounds."""
        resid = min(self._clip, max(-self._clip, x - old))
        if resid == 0.0:
            return old
        new = old + weight * resid
        return min(self._hi, max(self._lo, new))

    def mean_pace(self, regime: int) -> float | None:
        """The engine's pace in `regime` over every sample so far: Σ measured ÷ Σ predicted
        (the uncorrected model), i.e. how many times the profile's time the regime's
        iterations took in all; None before its first sample. Unlike the factors (which
        follow the latest seconds), it weighs the whole run: what a simulator needs to replay
        the run at the engine's pace."""
        predicted = self._predicted_total_s[regime]
        return self._measured_total_s[regime] / predicted if predicted > 0 else None

    def error_percentiles(self, corrected: bool = False) -> tuple[float | None, float | None]:
        """(p50, p99) of the relative error over the window (nearest rank; None when empty):
        of the model's own prediction, or with `corrected` of the calibrated one."""
        values = sorted(self._corrected_errors if corrected else self._errors)
        if not values:
            return None, None
        n = len(values)
        return values[n // 2], values[min(n - 1, int(0.99 * n))]

    def summary(self) -> dict[str, float | None]:
        """Factors and error percentiles, JSON-ready (the engine driver's counters)."""
        p50, p99 = self.error_percentiles()
        c50, c99 = self.error_percentiles(corrected=True)
        out: dict[str, float | None] = {
            f"latency_factor_{name}": f for name, f in zip(REGIMES, self.factors, strict=True)
        }
        out.update(
            {f"latency_mean_pace_{name}": self.mean_pace(r) for r, name in enumerate(REGIMES)}
        )
        out.update(
            latency_error_p50=p50,
            latency_error_p99=p99,
            latency_corrected_error_p50=c50,
            latency_corrected_error_p99=c99,
        )
        return out


class PaceSpread:
    """How much slower than the calibrated prediction the engine's recent iterations ran: the
    upper quantile of measured ÷ predicted over the last `window` iterations.

    The calibration's factors are means, and deliberately smooth (one stall must not move
    them); the SLO admission needs a bound. On a quiet engine the ratio's p90 is about 1.2
    (noise); while the engine's pace changes — a neighbour takes the CPU — it is the size of
    the change at once, iterations before the factors have learned it, and it stays high while
    the engine is erratic (a host whose iterations swing between 40 and 600 ms). The gateway
    multiplies its forecasts by it (backend/policy/feasibility.py), so neither the
    calibration's lag nor its averaging admits a request the engine's recent iterations say
    will be late.

    Each sample is kept against the profile (its prediction less the factor it was planned
    with) and measured against the factors *as they are now* (`upper(factors)`), because the
    gateway's forecast is the profile × the reported factors × this spread. Measured against
    the prediction of its own time, an iteration from before the factors learned a slower pace
    counts that pace twice once they have: seen on a fresh CPU engine whose first iterations
    ran ×9–20 its profile — the decode factor learned ×9, the p90 stayed ×20 for the window's
    32 iterations, and a TPOT forecast of 1 s (the iterations took 135 ms) refused every chat.
    An engine with nothing admitted runs no iteration, so the window never moved on. Pure; the
    caller feeds it."""

    def __init__(self, window: int = 32, quantile: float = 0.9, recent: int = 8) -> None:
        if window < 1 or not 0.0 < quantile <= 1.0 or not 1 <= recent <= window:
            raise ValueError("need window ≥ 1, 0 < quantile ≤ 1 and 1 ≤ recent ≤ window")
        self.quantile = quantile
        """The upper quantile `upper` reports."""
        self.recent = recent
        """The latest iterations `recent_mean` is taken over: few enough that a change of
        pace moves it within a few iterations, as it moves `upper`."""
        self._ratios: deque[tuple[float, int]] = deque(maxlen=window)

    def observe(
        self, predicted_s: float, measured_s: float, regime: int = DECODE, plan_factor: float = 1.0
    ) -> None:
        """One iteration's prediction and measured time, its batch regime (`regime_of`) and
        the calibration factor its prediction was scaled with (1.0: none, the profile's own
        word); ignored unless the times and the factor are positive and finite."""
        if 0 < predicted_s < math.inf and 0 < measured_s < math.inf and 0 < plan_factor < math.inf:
            self._ratios.append((measured_s * plan_factor / predicted_s, regime))

    def upper(self, factors: tuple[float, ...] = (1.0, 1.0, 1.0)) -> float:
        """The quantile of measured ÷ predicted at *factors* (the calibration's now, by regime)
        over the window (nearest rank; 1.0 before any sample)."""
        if not self._ratios:
            return 1.0
        values = sorted(ratio / factors[regime] for ratio, regime in self._ratios)
        return values[min(len(values) - 1, int(self.quantile * len(values)))]

    def recent_mean(self, factors: tuple[float, ...] = (1.0, 1.0, 1.0)) -> float:
        """The mean of measured ÷ predicted at *factors* over the latest `recent` iterations
        (1.0 before any sample): the pace the engine runs at now, where `upper` is its worst
        but one iteration in ten. The SLO admission stretches a request slot's wait of many
        decode steps by this plus a part of the gap to `upper` that shrinks with their number
        (`feasibility.pace_stretch`): one iteration's noise, not a change of pace, averages out
        over many. The mean, not the median: a sum of iterations is n times their mean, and an
        engine's iteration times skew long (a stall now and then; the median of log-normal
        noise of σ 0.3 is 0.96 of its mean)."""
        if not self._ratios:
            return 1.0
        latest = list(itertools.islice(reversed(self._ratios), self.recent))
        return sum(ratio / factors[regime] for ratio, regime in latest) / len(latest)
