"""The live bench's simulator twin runs at the real engine's pace: per batch regime over tandem's
run (bench.live.learned_regime_pace), or as tandem's calibration learned it at the end
(bench.live.learned_pace)."""

from __future__ import annotations

import pytest

from bench.live import learned_pace, learned_regime_pace


def test_the_twin_runs_at_the_geometric_mean_of_the_learned_factors() -> None:
    stats = {
        "latency_factor_decode": 2.0,
        "latency_factor_prefill": 0.5,
        "latency_factor_mixed": 4.0,
    }
    assert learned_pace(stats) == pytest.approx(4.0 ** (1 / 3))


def test_missing_or_broken_factors_leave_the_profiles_pace() -> None:
    assert learned_pace({}) == 1.0
    assert learned_pace({"latency_factor_decode": None, "error": "x"}) == 1.0
    assert learned_pace({"latency_factor_decode": 1.5, "latency_factor_mixed": 0}) == 1.5


def test_the_twin_replays_each_regimes_mean_pace_over_the_run() -> None:
    stats = {
        "latency_mean_pace_decode": 0.8,
        "latency_mean_pace_prefill": 1.25,
        "latency_mean_pace_mixed": 2.0,
        "latency_factor_decode": 9.0,  # the last seconds: not what the run was
    }
    assert learned_regime_pace(stats) == (0.8, 1.25, 2.0)


def test_a_regime_the_run_never_had_takes_the_mean_of_the_others() -> None:
    stats = {"latency_mean_pace_decode": 0.5, "latency_mean_pace_prefill": 2.0}
    assert learned_regime_pace(stats) == pytest.approx((0.5, 2.0, 1.0))
    assert learned_regime_pace({"latency_mean_pace_mixed": None}) == ()
    assert learned_regime_pace({}) == ()
