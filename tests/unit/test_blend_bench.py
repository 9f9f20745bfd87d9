"""`tandem bench W4 --policies fcfs,dfs,blend`: the orderings run through the simulated batch
runner feed, finish every request, and share prefixes as the design says."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.batch_order import ordered_source
from bench.runner import BenchConfig, registered_policies, run_bench
from bench.workloads import build_workload
from bench.workloads.base import BuildContext, WorkloadParams


def test_w4_orderings_finish_everything_and_blend_keeps_dfs_sharing(tmp_path: Path) -> None:
    config = BenchConfig(
        workload="W4",
        out_dir=tmp_path,
        policies=("fcfs", "dfs", "blend"),
        scale=0.05,
        progress=False,
    )
    run = run_bench(config)
    assert not run.failed
    metrics = {name: r.metrics for name, r in run.runs.items()}
    for m in metrics.values():
        assert m["be_finished"] == m["be_requests"] == 2000
        assert m["be_makespan_s"] is not None
    fcfs, dfs, blend = metrics["fcfs"], metrics["dfs"], metrics["blend"]
    # ordered feeds share more prefix than the job in its random order
    assert dfs["prefix_reuse_ratio"] > fcfs["prefix_reuse_ratio"] + 0.03
    assert blend["prefix_reuse_ratio"] >= 0.97 * dfs["prefix_reuse_ratio"]
    # and blending (long outputs started early, dense lines alongside) shortens the job
    assert blend["be_makespan_s"] < min(fcfs["be_makespan_s"], dfs["be_makespan_s"])


def test_orderings_are_known_names_but_not_run_by_default() -> None:
    assert {"dfs", "blend"} <= set(registered_policies())


def test_orderings_refuse_workloads_with_rt_or_timed_arrivals() -> None:
    from backend.policy.latency import LatencyModel, load_profile
    from backend.policy.profiles import resolve_profile

    profile = load_profile(resolve_profile("h100-llama8b-analytic"))
    latency = LatencyModel.fit(profile.samples)
    ctx = BuildContext(
        latency=latency,
        kv_capacity_tokens=profile.kv_capacity_tokens,
        max_prefill_tokens=profile.max_prefill_tokens,
    )
    w3 = build_workload("W3", WorkloadParams(seed=0, duration_s=5.0), ctx)
    with pytest.raises(ValueError, match="offline BE job"):
        ordered_source("blend", w3.source(None, True), profile.kv_capacity_tokens)
