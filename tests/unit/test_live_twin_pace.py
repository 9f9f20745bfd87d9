"""The live bench's simulator twin runs at the real engine's pace: per batch regime over tandem's
run (bench.live.learned_regime_pace), or as tandem's calibration learned it at the end
(bench.live.learned_pace), plus the serving path's own time (bench.live.shifted)."""

from __future__ import annotations

from array import array

import msgspec
import pytest

from backend.sim.records import IterationLog, RequestRecord, SimResult
from bench.live import learned_pace, learned_regime_pace, shifted


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


def test_the_twin_adds_the_serving_overhead_to_every_token() -> None:
    record = RequestRecord(
        rid="r",
        tier="rt",
        arrival_s=1.0,
        prompt_len=10,
        output_len_target=3,
        generated=3,
        first_token_s=1.1,
        finish_s=1.3,
        token_times=array("d", [1.1, 1.2, 1.3]),
        evictions=0,
        cached_tokens=0,
        ttft_target_s=0.5,
        tpot_target_s=0.1,
        deadline_s=None,
        length_key="rt",
    )
    unfinished = msgspec.structs.replace(
        record, rid="u", first_token_s=None, finish_s=None, generated=0, token_times=array("d")
    )
    result = SimResult(
        policy_name="tandem",
        requests=[record, unfinished],
        iterations=IterationLog(100),
        horizon_s=None,
        end_s=2.0,
        prefix_reuse_ratio=0.0,
    )
    out = shifted(result, 0.02)
    assert record.first_token_s == pytest.approx(1.12) and record.finish_s == pytest.approx(1.32)
    assert list(record.token_times) == pytest.approx([1.12, 1.22, 1.32])
    assert record.arrival_s == 1.0  # the client sent it when it did
    assert unfinished.first_token_s is None and unfinished.finish_s is None
    assert out is result and shifted(result, 0.0) is result
