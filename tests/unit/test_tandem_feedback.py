"""tandem's AIMD feedback on the safety margin ε and the BE share."""

from __future__ import annotations

import pytest

from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.feedback import Feedback
from backend.policy.types import IterationResult, Plan


def _ran(start: float, duration: float, predicted: float | None = None) -> IterationResult:
    return IterationResult(
        start_s=start, duration_s=duration, plan=Plan(decodes=["x"], predicted_s=predicted)
    )


def test_aimd_backs_off_at_once_on_a_miss_and_probes_additively() -> None:
    fb = Feedback(TandemConfig(eps_init=0.1, be_frac_init=0.25, be_frac_step=0.05))
    for _ in range(3):
        fb.expect(deadline_s=1.0, allowance_s=1.0)
        fb.observe(_ran(0.0, 0.5))
    assert fb.eps == pytest.approx(0.085) and fb.be_frac == pytest.approx(0.40)
    fb.expect(deadline_s=1.0, allowance_s=1.0)
    fb.observe(_ran(0.0, 1.2))  # the token came 0.2 s late
    assert fb.eps == pytest.approx(0.17) and fb.be_frac == pytest.approx(0.25)
    assert fb.misses == 1


def test_a_near_miss_or_an_overrun_also_backs_off() -> None:
    fb = Feedback(TandemConfig(near_miss_frac=0.05, be_frac_init=1.0))
    fb.expect(deadline_s=1.0, allowance_s=1.0)
    fb.observe(_ran(0.0, 0.97))  # within 5 % of the deadline
    assert fb.be_frac == pytest.approx(0.25)
    fb = Feedback(TandemConfig(be_frac_init=1.0))
    fb.observe(_ran(0.0, 0.05, predicted=0.03))  # ran 66 % over its prediction
    assert fb.be_frac == pytest.approx(0.25) and fb.eps == pytest.approx(0.2)


def test_without_aimd_both_stay_fixed() -> None:
    fb = Feedback(TandemConfig(use_aimd=False, eps_init=0.1))
    fb.expect(deadline_s=1.0, allowance_s=1.0)
    fb.observe(_ran(0.0, 2.0))
    assert fb.eps == 0.1 and fb.be_frac == 1.0
