"""The live bench's simulator twin runs at the real engine's pace, as tandem's calibration
learned it (bench.live.learned_pace)."""

from __future__ import annotations

import pytest

from bench.live import learned_pace


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
