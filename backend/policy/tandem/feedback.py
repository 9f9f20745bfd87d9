"""Feedback (BROS's TCP-like controller, moved from batch size to time, synthesis C1): AIMD on
the latency safety margin ε and on the BE time share.

    RT token late or nearly late, or the iteration overran its prediction:
        ε ← min(2ε, ε_max)          (multiplicative increase of the margin)
        BE share ← reset            (multiplicative decrease: BE backs off at once)
    otherwise:
        ε ← max(ε − step, ε_min)     BE share ← min(share + step, 1)   (additive probing)

A near miss is a token emitted within `near_miss_frac` of its allowance before its deadline:
backing off before the first miss is what keeps attainment above 99 % rather than at it.

`RiderCost` learns, from the same iterations, what BE work riding beside RT work really costs
against the model's prediction for it (the stretch's allowance is divided by it).
"""

from __future__ import annotations

import math

from backend.policy.tandem.config import TandemConfig
from backend.policy.types import IterationResult

_OVERRUN_TOLERANCE = 0.02  # relative: model noise below this is not an overrun
_PACE_WEIGHT = 0.05  # EWMA weight of the newest iteration time (≈ the last 20 iterations)


class Feedback:
    """The controller's state: ε and the BE share, and what the last plan expected."""

    def __init__(self, config: TandemConfig) -> None:
        self.config = config
        self.eps = config.eps_init
        """Latency safety margin: τ = (1 − ε) × the tightest RT allowance."""
        self.be_frac = config.be_frac_init if config.use_aimd else 1.0
        """Share of the time RT leaves under τ that BE may use."""
        self.iteration_s = 0.0
        """Moving average of the iteration time, seconds (the engine's current pace)."""
        self.misses = 0
        """RT deadline misses and near misses seen (statistics)."""
        self._deadline_s = math.inf
        self._allowance_s = math.inf

    def expect(self, deadline_s: float, allowance_s: float) -> None:
        """The plan about to run emits an RT token due at `deadline_s` (the earliest), with
        `allowance_s` of time for it."""
        self._deadline_s = deadline_s
        self._allowance_s = allowance_s

    def observe(self, result: IterationResult) -> None:
        """Updates ε and the BE share from how the iteration went."""
        cfg = self.config
        self.iteration_s += _PACE_WEIGHT * (result.duration_s - self.iteration_s)
        end = result.end_s
        late = (
            math.isfinite(self._deadline_s)
            and end > self._deadline_s - cfg.near_miss_frac * self._allowance_s
        )
        predicted = result.plan.predicted_s
        overrun = predicted is not None and result.duration_s > predicted * (1 + _OVERRUN_TOLERANCE)
        self._deadline_s = self._allowance_s = math.inf
        if late:
            self.misses += 1
        if not cfg.use_aimd:
            return
        if late or overrun:
            self.eps = min(cfg.eps_max, max(2 * self.eps, cfg.eps_min))
            self.be_frac = min(self.be_frac, cfg.be_frac_reset)
        else:
            self.eps = max(cfg.eps_min, self.eps - cfg.eps_step)
            self.be_frac = min(1.0, self.be_frac + cfg.be_frac_step)


RIDER_WEIGHT = 0.05
"""EWMA weight (in log space) of each iteration's measured ÷ predicted cost of its BE riders."""
RIDER_MIN_PREDICTED_FRAC = 0.05
"""Riders predicted below this fraction of the RT work they ride with are not measured: the
difference of two near-equal times is mostly the model's noise."""
RIDER_FACTOR_RANGE = (0.5, 4.0)
"""The correction's bounds (a run of unlucky measurements never stops or floods BE)."""


class RiderCost:
    """What BE work riding in an iteration with RT work really costs against what the model
    predicts for it: the stretch (`rt_stretch`) and BE's time floors are the RT work's time
    multiplied by a fraction, and that fraction is what RT really waits only if BE's part
    costs what the model says.

    On the CPU engine it did not: a chat's decode beside one BE decode took 10–11 ms against
    7 ms alone, where the model said 9–10 ms (the profile's marginal decode row, 0.4 ms, is
    measured without the serving stack that streams every row's tokens on the same two cores),
    so a 30 % stretch made the chat's tokens ×1.45 slower. The calibration's one factor per
    regime scales whole iterations and cannot fix a marginal cost. Each iteration that carried
    both is one sample: (measured − predicted RT part) ÷ predicted BE part, and the factor is
    their moving geometric mean; BE's allowance in RT iterations is divided by it."""

    def __init__(self) -> None:
        self.factor = 1.0
        """Measured ÷ predicted cost of BE riders, recently (1: as predicted)."""
        self.samples = 0
        """Iterations measured."""
        self._log = 0.0

    def observe(self, rt_predicted_s: float, total_predicted_s: float, measured_s: float) -> None:
        """One iteration with RT work predicted at *rt_predicted_s* and BE riders that brought
        it to *total_predicted_s*, measured at *measured_s*."""
        rider_s = total_predicted_s - rt_predicted_s
        if rt_predicted_s <= 0.0 or rider_s < RIDER_MIN_PREDICTED_FRAC * rt_predicted_s:
            return
        lo, hi = RIDER_FACTOR_RANGE
        ratio = min(hi, max(lo, (measured_s - rt_predicted_s) / rider_s))
        self._log += RIDER_WEIGHT * (math.log(ratio) - self._log)
        self.factor = math.exp(self._log)
        self.samples += 1
