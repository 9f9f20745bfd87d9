"""The live bench runs W6 (several tenants of each tier) on the real engine: `--engine sglang`
takes it in its CPU variant, and results.json and report.md carry each tenant's metrics for the
real run and its simulator twin, as the simulator's bench does."""

from __future__ import annotations

import json
from pathlib import Path

from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import resolve_profile
from backend.sim.records import SimResult
from bench.live import LiveRun, live_config, run_sim
from bench.live_report import report_markdown, results_dict
from bench.metrics import compute_metrics, tenant_metrics
from bench.runner import BenchConfig, build, sim_config


def fcfs_run(workload: str, duration_s: float, rt_rate_req_s: float) -> tuple[LiveRun, SimResult]:
    """A live run's record of fcfs on *workload*, its twin's result standing in for the real one
    (both go through the same report code)."""
    config = live_config(
        BenchConfig(
            workload=workload, out_dir=Path("unused"), engine="sglang", duration_s=duration_s
        )
    )
    profile = load_profile(resolve_profile(config.profile))
    latency = LatencyModel.fit(profile.samples)
    built, kv = build(config, latency, profile)
    run = LiveRun(
        config=config,
        workload=built,
        profile_name="cpu-tiny",
        kv_capacity_tokens=kv,
        rt_capacity_req_s=None,
        rt_rate_req_s=rt_rate_req_s,
        policy_options={},
    )
    result = run_sim("fcfs", run, latency, sim_config(profile, kv, built))
    run.real["fcfs"] = run.sim["fcfs"] = compute_metrics(result, built.window_s)
    return run, result


def test_a_w6_live_run_reports_every_tenant_real_and_twin() -> None:
    run, result = fcfs_run("W6", 20.0, 4.0)
    assert run.config.variant == "cpu" and run.config.profile == "cpu-tiny"
    run.tenants["fcfs"] = run.sim_tenants["fcfs"] = tenant_metrics(
        result.requests, run.workload.tenants, result.end_s
    )
    results = json.loads(json.dumps(results_dict(run), default=str))
    for section in ("policies", "sim"):
        tenants = results[section]["fcfs"]["tenants"]
        assert set(tenants) == {"rt-steady", "rt-burst", "be-a", "be-b"}
        assert tenants["rt-burst"]["tier"] == "rt" and tenants["be-a"]["weight"] == 1.0
        assert tenants["rt-steady"]["rt_admitted_attainment"] is not None
    report = report_markdown(run, plots=[])
    assert report.count("| fcfs | rt-burst | rt | 1 |") == 2  # the real table and the twin's
    assert "RT shed" in report


def test_a_live_run_without_named_tenants_has_no_tenant_rows() -> None:
    run, _ = fcfs_run("W1", 5.0, 2.0)
    assert "tenants" not in results_dict(run)["policies"]["fcfs"]
    assert "Per tenant" not in report_markdown(run, plots=[])


def test_a_live_run_keeps_every_request_as_the_client_saw_it(tmp_path: Path) -> None:
    # a miss in the report is looked up in live/<policy>/requests.json: every request, its
    # admission and token times, on the replay's clock, whose Unix start it gives
    from bench.live import save_requests

    _, result = fcfs_run("W1", 5.0, 4.0)
    path = tmp_path / "live" / "fcfs" / "requests.json"
    save_requests(path, result.requests, 1_800_000_000.5)
    saved = json.loads(path.read_text())
    assert saved["replay_start_unix_s"] == 1_800_000_000.5
    rows = {row["rid"]: row for row in saved["requests"]}
    assert len(rows) == len(result.requests)
    for r in result.requests:
        row = rows[r.rid]
        assert (row["tier"], row["admission"], row["generated"]) == (
            r.tier,
            r.admission,
            r.generated,
        )
        assert row["token_times"] == [round(t, 4) for t in r.token_times]


def test_the_twin_is_compared_on_the_admitted_tail_where_shed_requests_censor_the_offered_one() -> (
    None
):
    # a shed request's TTFT is censored at the run's end: past 1 % shed, the offered p99 is the
    # run's length, so the report says so and compares the admitted requests' tail as well
    run, _ = fcfs_run("W1", 5.0, 2.0)
    real, twin = dict(run.real["fcfs"]), dict(run.sim["fcfs"])
    real.update(rt_shed_rate=0.037, rt_ttft_p99_s=116.0, rt_admitted_ttft_p99_s=1.1)
    twin.update(rt_shed_rate=0.005, rt_ttft_p99_s=23.0, rt_admitted_ttft_p99_s=1.2)
    run.real["fcfs"], run.sim["fcfs"] = real, twin
    ratios = results_dict(run)["sim_over_real"]["fcfs"]
    assert abs(ratios["rt_admitted_ttft_p99_s"] - 1.2 / 1.1) < 1e-9
    assert abs(ratios["rt_ttft_p99_s"] - 23.0 / 116.0) < 1e-9
    report = report_markdown(run, plots=[])
    assert "adm. TTFT p99 s" in report
    assert "more than 1 % of the RT requests offered were shed (real fcfs)" in report
    run.real["fcfs"] = {**real, "rt_shed_rate": 0.0}
    assert "censored" not in report_markdown(run, plots=[])
