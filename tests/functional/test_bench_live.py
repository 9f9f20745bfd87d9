"""`tandem bench W1 --engine sglang`: the real engine behind the gateway and its simulator twin,
one small run (tandem only, a fixed RT rate: the λ* search on the real engine takes minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench import main

pytestmark = pytest.mark.slow


def test_a_live_run_reports_real_and_simulated_metrics(tmp_path: Path) -> None:
    out = tmp_path / "live"
    code = main(
        [
            "bench",
            "W1",
            "--engine",
            "sglang",
            "--rt-rate",
            "1",
            "--duration-s",
            "8",
            "--policies",
            "tandem",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["engine"] == "sglang" and results["variant"] == "cpu"
    assert results["rt_rate_req_s"] == 1.0
    real, sim = results["policies"]["tandem"], results["sim"]["tandem"]
    # Every request of the window came back, from the engine and from the simulator.
    assert real["rt_finished"] == real["rt_requests"] > 0
    assert real["be_finished"] == real["be_requests"] > 0
    assert sim["rt_requests"] == real["rt_requests"]
    assert 0.0 <= real["rt_ttft_attainment"] <= 1.0 and real["be_throughput_tok_s"] > 0
    ratios = results["sim_over_real"]["tandem"]
    assert ratios["be_throughput_tok_s"] is not None and ratios["be_throughput_tok_s"] > 0
    stats = results["engine_stats"]["tandem"]
    assert stats["policy"] == "tandem" and stats["iterations"] > 0
    assert 0.0 <= stats["overhead_frac"] < 1.0
    # the real row carries the calibrated model's error over the iterations the bench recorded
    assert real["iterations"] > 0 and real["latency_model_error_p50"] is not None
    assert 0.0 <= real["latency_model_error_p50"] <= real["latency_model_error_p99"]
    # the twin runs at the engine's pace per regime over the run, plus the serving path's
    # time outside the engine measured before the replay (HTTP, gateway, tokenizer, stream)
    paces = results["sim_regime_pace"]
    assert set(paces) == {"decode", "prefill", "mixed"} and all(v > 0 for v in paces.values())
    assert results["sim_pace"] > 0
    assert 0.0 < results["serving_overhead_ms"]["tandem"] < real["rt_ttft_p50_s"] * 1000
    report = (out / "report.md").read_text()
    assert report.startswith("`tandem bench W1 --engine sglang")
    assert "serving overhead (client TTFT less the engine's prefill step" in report
    assert "## Simulator ÷ real" in report
    assert "the calibrated latency model's error per iteration" in report
