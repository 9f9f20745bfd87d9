"""The engine driver's view of the policy's latency calibration: the factors and the model's
error percentiles in ``/stats``, one warning per episode of an engine off its profile."""

from __future__ import annotations

import logging

import pytest

from backend.policy.calibration import DECODE, LatencyCalibration
from backend.policy.types import IterationResult, Plan
from backend.sglang_ext.driver import CALIBRATION_WARN_S, EngineDriver
from tests.unit.test_engine_driver import FakeBatch, ScriptedPolicy, req, sched


class CalibratedPolicy(ScriptedPolicy):
    """A fixed decode plan predicted at 20 ms; feeds a real calibration like tandem does."""

    def __init__(self) -> None:
        super().__init__(Plan(decodes=["a"], predicted_s=0.02))
        self.calibration = LatencyCalibration()

    def observe(self, result: IterationResult) -> None:
        super().observe(result)
        assert result.plan.predicted_s is not None
        self.calibration.observe(result.plan.predicted_s, result.duration_s, DECODE)


def run(drv: EngineDriver, now: list[float], pace: float, engine_s: float) -> None:
    """Iterations of the scripted plan taking `pace` × its prediction, for `engine_s`."""
    end = now[0] + engine_s
    while now[0] < end:
        drv.begin_iteration()
        drv.plan_iteration(sched([]), FakeBatch([req("a", "rt", out=2)]))  # type: ignore[arg-type]
        drv.batch_started(True, now[0])
        now[0] += pace * 0.02


def test_stats_carry_the_factors_and_the_error_and_one_warning_per_episode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    policy = CalibratedPolicy()
    drv = EngineDriver(policy, clock=lambda: now[0], profile="h100-llama8b")  # type: ignore[arg-type]
    run(drv, now, 1.0, 2.0)
    summary = drv.stats.summary()
    # the clock's float arithmetic is off in the last bits: still exactly 1.0
    assert summary["latency_factor_decode"] == 1.0 and "latency_error" not in summary
    assert summary["latency_error_p99"] == pytest.approx(0.0, abs=1e-9)
    with caplog.at_level(logging.WARNING, logger="backend.sglang_ext.driver"):
        run(drv, now, 2.0, CALIBRATION_WARN_S + 5.0)  # 2× slower than profiled
        summary = drv.stats.summary()
        assert summary["latency_factor_decode"] == pytest.approx(2.0, rel=0.01)
        assert summary["latency_factor_prefill"] == pytest.approx(summary["latency_factor_decode"])
        assert summary["latency_error_p50"] == pytest.approx(0.5)  # the profile's own error
        assert summary["latency_corrected_error_p50"] < 0.01  # the calibrated prediction's
        assert summary["latency_warnings"] == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "h100-llama8b" in warnings[0].getMessage()
        run(drv, now, 1.0, 10.0)  # back on profile: the episode ends
        assert drv.stats.latency_factor_decode == pytest.approx(1.0, rel=0.01)
        # the run's mean pace (what a twin replays) remembers the slow stretch
        assert drv.stats.latency_mean_pace_decode is not None
        assert 1.2 < drv.stats.latency_mean_pace_decode < 2.0
        assert drv.stats.latency_mean_pace_mixed is None  # never ran a mixed batch
        run(drv, now, 2.0, CALIBRATION_WARN_S - 2.0)  # off again, but not for long enough
        run(drv, now, 1.0, 10.0)
        assert drv.stats.latency_warnings == 1
        run(drv, now, 2.0, CALIBRATION_WARN_S + 5.0)  # a new episode warns again, once
        assert drv.stats.latency_warnings == 2
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_a_policy_without_calibration_reports_neutral_values() -> None:
    now = [100.0]
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["a"])), clock=lambda: now[0])  # type: ignore[arg-type]
    run(drv, now, 1.0, 0.2)
    summary = drv.stats.summary()
    assert summary["latency_factor_decode"] == 1.0 and summary["latency_factor_mixed"] == 1.0
    assert summary["latency_error_p50"] is None and summary["latency_warnings"] == 0
    assert summary["latency_mean_pace_decode"] is None


def test_stats_say_when_the_calibration_last_learned_so_an_idle_engine_shows_its_age() -> None:
    now, wall = [100.0], [1_700_000_000.0]
    policy = CalibratedPolicy()
    drv = EngineDriver(policy, clock=lambda: now[0], wall_clock=lambda: wall[0])  # type: ignore[arg-type]
    assert drv.stats.summary()["latency_calibrated_at_unix_s"] is None  # nothing learned yet
    run(drv, now, 2.0, 1.0)
    assert drv.stats.summary()["latency_calibrated_at_unix_s"] == wall[0]
    learned_at = wall[0]
    wall[0] += 600.0  # ten idle minutes: no iteration, nothing learned, the time stays
    assert drv.stats.summary()["latency_calibrated_at_unix_s"] == learned_at
    run(drv, now, 2.0, 0.2)  # traffic again: learned now
    assert drv.stats.summary()["latency_calibrated_at_unix_s"] == wall[0]
