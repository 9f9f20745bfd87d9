"""The planning-cost bench (`python -m bench.studies.driver_overhead`) keeps running against
the driver it times: its stand-ins churn through admissions and finishes without error."""

from __future__ import annotations

from bench.studies import driver_overhead


def test_the_bench_plans_through_churn_and_times_the_whole_plan_iteration() -> None:
    out = driver_overhead.measure("64x64", iterations=60, warmup=5)
    assert {"plan_iteration_us_p50", "plan_iteration_us_p90", "policy_plan_us_p50"} <= set(out)
    assert out["running_mean"] > 0 and out["waiting_mean"] > 0
    # the policy's plan is a part of the driver's plan_iteration, never more than all of it
    assert 0 < out["policy_plan_us_p50"] <= out["plan_iteration_us_p50"]
    assert out["plan_iteration_us_p50"] <= out["plan_iteration_us_p90"]
