"""`tandem bench` end to end on the simulator: a tiny W1 (a few simulated seconds, three
policies) and a tiny trace replay through the CLI entry point; the three outputs exist, results.json
follows API.md's schema, and a second identical run gives identical results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.metrics import WALL_CLOCK_KEYS
from bench.plots import PLOT_FILES
from tandem.cli import main

POLICIES = ("fcfs", "priority", "rt-only")
TOP_KEYS = (
    "workload",
    "engine",
    "profile",
    "seed",
    "load",
    "rt_capacity_req_s",
    "rt_rate_req_s",
    "policies",
)
POLICY_KEYS = (
    "rt_ttft_attainment",
    "rt_tpot_attainment",
    "rt_ttft_p50_s",
    "rt_ttft_p99_s",
    "rt_tpot_mean_s",
    "rt_tbt_p99_s",
    "rt_normalized_latency_s",
    "rt_token_attainment",
    "be_throughput_tok_s",
    "be_throughput_req_s",
    "be_max_wait_s",
    "goodput_req_s",
    "eviction_rate",
    "kv_utilization_mean",
    "prefix_reuse_ratio",
    "plan_ms_p50",
    "plan_ms_p99",
)
FRACTIONS = (
    "rt_ttft_attainment",
    "rt_tpot_attainment",
    "rt_token_attainment",
    "eviction_rate",
    "kv_utilization_mean",
    "prefix_reuse_ratio",
)


def run_w1(out: Path, cache: Path) -> dict[str, Any]:
    code = main(
        [
            "bench",
            "W1",
            "--engine",
            "sim",
            "--policies",
            ",".join(POLICIES),
            "--rt-rate",
            "8",
            "--duration-s",
            "4",
            "--seed",
            "3",
            "--kv-scale",
            "20",
            "--out",
            str(out),
            "--cache-dir",
            str(cache),
            "--no-progress",
        ]
    )
    assert code == 0
    return json.loads((out / "results.json").read_text())  # type: ignore[no-any-return]


def deterministic(results: dict[str, Any]) -> dict[str, Any]:
    """results.json without what depends on the wall clock."""
    out = {k: v for k, v in results.items() if k != "run_info"}
    out["policies"] = {
        name: {k: v for k, v in m.items() if k not in WALL_CLOCK_KEYS}
        for name, m in results["policies"].items()
    }
    return out


def test_w1_end_to_end_writes_three_outputs(tmp_path: Path) -> None:
    results = run_w1(tmp_path / "a", tmp_path / "cache")
    for key in TOP_KEYS:
        assert key in results, key
    assert results["workload"] == "W1" and results["engine"] == "sim"
    assert results["profile"] == "h100-llama8b-analytic" and results["seed"] == 3
    assert results["rt_rate_req_s"] == 8.0
    assert list(results["policies"]) == list(POLICIES)
    for name, metrics in results["policies"].items():
        for key in POLICY_KEYS:
            assert key in metrics, (name, key)
        for key in FRACTIONS:
            assert metrics[key] is None or 0.0 <= metrics[key] <= 1.0, (name, key)
        assert metrics["rt_requests"] > 10
    assert results["policies"]["rt-only"]["be_throughput_tok_s"] == 0.0
    assert results["policies"]["fcfs"]["be_throughput_tok_s"] > 0.0
    assert results["policies"]["fcfs"]["rt_interference_tbt_p99"] is not None
    report = (tmp_path / "a" / "report.md").read_text()
    assert "tandem bench W1 --engine sim --policies fcfs,priority,rt-only" in report
    assert all(f"| {name} |" in report for name in POLICIES)
    for png in PLOT_FILES:
        data = (tmp_path / "a" / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 200_000


def test_same_command_twice_gives_identical_results(tmp_path: Path) -> None:
    first = run_w1(tmp_path / "a", tmp_path / "cache")
    second = run_w1(tmp_path / "b", tmp_path / "cache")
    assert deterministic(first) == deterministic(second)


def test_load_measures_capacity_once_then_uses_the_cache(tmp_path: Path) -> None:
    argv = [
        "bench",
        "W1",
        "--policies",
        "fcfs",
        "--load",
        "0.5",
        "--duration-s",
        "2",
        "--capacity-run-s",
        "3",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-progress",
    ]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    first, second = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert first["run_info"]["capacity_source"] == "measured"
    assert second["run_info"]["capacity_source"] == "cached"
    capacity = first["rt_capacity_req_s"]
    assert capacity > 1.0 and second["rt_capacity_req_s"] == capacity
    assert first["rt_rate_req_s"] == pytest.approx(0.5 * capacity)
    assert (tmp_path / "cache" / "capacity.json").is_file()


def test_one_run_compares_settings_of_one_policy(tmp_path: Path) -> None:
    out = tmp_path / "specs"
    code = main(
        [
            "bench",
            "W1",
            "--policies",
            "static-chunk,static-chunk:chunk_tokens=2048",
            "--rt-rate",
            "8",
            "--duration-s",
            "4",
            "--kv-scale",
            "20",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["policies"]
    assert set(runs) == {"static-chunk", "static-chunk:chunk_tokens=2048"}
    # a four times larger token budget runs the same work in fewer iterations
    assert runs["static-chunk:chunk_tokens=2048"]["iterations"] < runs["static-chunk"]["iterations"]
    assert "static-chunk:chunk_tokens=2048" in (out / "report.md").read_text()


def test_trace_replay_end_to_end(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {
            "t_ms": 100 * i,
            "input_len": 300 + 7 * i,
            "output_len": 20 + i % 5,
            "tier": "be" if i % 4 == 0 else "rt",
            "tenant": "t",
        }
        for i in range(60)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "trace"
    code = main(
        [
            "bench",
            "trace",
            str(trace),
            "--policies",
            "fcfs,static-chunk",
            "--rate-scale",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["workload"] == "trace" and results["rt_capacity_req_s"] is None
    fcfs = results["policies"]["fcfs"]
    assert fcfs["rt_requests"] == 45 and fcfs["be_requests"] == 15
    assert results["window_s"] == pytest.approx(59 * 0.1 / 2)
