"""The engine's control-endpoint counters as /metrics gauges: each covers the interval between
the last two readings, and an engine restart starts over."""

from __future__ import annotations

import pytest

from gateway.engine.stats import EngineStatsWindow


def reading(busy_s: float, rt_busy_s: float, overhead_s: float = 0.0) -> dict[str, float]:
    return {"busy_s": busy_s, "rt_busy_s": rt_busy_s, "overhead_s": overhead_s, "iterations": 10}


def gauges(window: EngineStatsWindow) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in window.collect()}


def test_no_gauges_before_the_engine_reported() -> None:
    assert gauges(EngineStatsWindow()) == {}


def test_an_engine_that_was_never_busy_reads_zero_shares() -> None:
    window = EngineStatsWindow()
    window.add(reading(0.0, 0.0))
    assert gauges(window) == {
        "tandem_engine_rt_time_share": 0.0,
        "tandem_engine_scheduler_overhead_share": 0.0,
    }


def test_shares_cover_the_last_interval_not_the_whole_run() -> None:
    window = EngineStatsWindow()
    window.add(reading(10.0, 9.0, 0.1))  # since start: 90 % RT
    assert gauges(window)["tandem_engine_rt_time_share"] == pytest.approx(0.9)
    window.add(reading(12.0, 9.5, 0.3))  # the last 2 s: 0.5 of 2 s RT, 0.2 s overhead
    assert gauges(window) == pytest.approx(
        {"tandem_engine_rt_time_share": 0.25, "tandem_engine_scheduler_overhead_share": 0.1}
    )


def test_a_restarted_engine_starts_a_new_interval() -> None:
    window = EngineStatsWindow()
    window.add(reading(100.0, 50.0))
    window.add(reading(4.0, 3.0))  # counters went down: a new engine
    assert gauges(window)["tandem_engine_rt_time_share"] == pytest.approx(0.75)


def test_an_idle_interval_reads_zero_not_nothing() -> None:
    # issue 17: the RT time share vanished from /metrics while the engine was idle
    window = EngineStatsWindow()
    window.add(reading(5.0, 1.0))
    window.add(reading(5.0, 1.0))  # no iteration since the last reading
    assert gauges(window) == {
        "tandem_engine_rt_time_share": 0.0,
        "tandem_engine_scheduler_overhead_share": 0.0,
    }
    window.add(reading(7.0, 2.0))  # busy again: the share of the new interval
    assert gauges(window)["tandem_engine_rt_time_share"] == pytest.approx(0.5)


def test_the_latency_model_error_and_the_pace_factors_are_gauges() -> None:
    window = EngineStatsWindow()
    window.add(
        {
            **reading(10.0, 5.0),
            "latency_error_p50": 0.5,
            "latency_error_p99": 0.6,
            "latency_corrected_error_p50": 0.02,
            "latency_corrected_error_p99": None,  # no samples yet: no gauge
            "latency_factor_decode": 2.0,
            "latency_factor_prefill": 1.5,
            "latency_factor_mixed": 1.0,
        }
    )
    samples = {
        (m.name, tuple(sorted(s.labels.items()))): s.value
        for m in window.collect()
        for s in m.samples
    }
    assert samples[("tandem_engine_latency_model_error", (("quantile", "0.5"),))] == 0.5
    assert samples[("tandem_engine_latency_model_error", (("quantile", "0.99"),))] == 0.6
    assert samples[("tandem_engine_latency_corrected_error", (("quantile", "0.5"),))] == 0.02
    assert ("tandem_engine_latency_corrected_error", (("quantile", "0.99"),)) not in samples
    assert samples[("tandem_engine_latency_factor", (("regime", "decode"),))] == 2.0
    assert samples[("tandem_engine_latency_factor", (("regime", "mixed"),))] == 1.0


def test_the_calibration_age_says_how_stale_an_idle_engine_s_factors_are() -> None:
    window = EngineStatsWindow()
    window.add({**reading(10.0, 5.0), "latency_calibrated_at_unix_s": 1_000.0})
    assert window.calibration_age_s(now_unix_s=1_600.0) == 600.0
    assert window.calibration_age_s(now_unix_s=990.0) == 0.0  # the engine's clock runs ahead
    ages = [
        s.value
        for m in window.collect()
        if m.name == "tandem_engine_latency_calibration_age_seconds"
        for s in m.samples
    ]
    assert len(ages) == 1 and ages[0] > 600.0  # now is long after 1970's 1,000th second
    assert window.latency_errors()["calibrated_age_s"] == pytest.approx(ages[0], abs=60.0)


def test_an_engine_without_a_policy_has_no_latency_gauges() -> None:
    window = EngineStatsWindow()
    window.add(reading(10.0, 5.0))
    names = {m.name for m in window.collect()}
    assert not any(name.startswith("tandem_engine_latency") for name in names)
