"""`tandem bench --engine sglang --policies tandem:KEY=VALUE…`: settings of tandem side by side on
the real engine. Each row's engine runs config.yaml's options with the row's own on top, and so
does its simulator twin; stock SGLang's policies take none, and a bad option is refused before
any engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import resolve_profile
from bench import live
from bench.live import CPU_POLICY_OPTIONS, engine_section, live_config, run_sim
from bench.runner import BenchConfig, build, sim_config
from tests.unit.live_factories import rt_only_live_run


def config(tmp_path: Path, policies: tuple[str, ...]) -> BenchConfig:
    return BenchConfig(workload="W1", out_dir=tmp_path, engine="sglang", policies=policies)


def test_tandem_rows_may_carry_options_and_stock_rows_may_not(tmp_path: Path) -> None:
    specs = ("tandem", "tandem:rt_stretch=0.6", "priority")
    assert live_config(config(tmp_path, specs)).policies == specs
    with pytest.raises(ValueError, match="stock SGLang's priority takes no options"):
        live_config(config(tmp_path, ("priority:x=1",)))
    with pytest.raises(ValueError, match=r"'tandem:no_such_option=1'.*no_such_option"):
        live_config(config(tmp_path, ("tandem:no_such_option=1",)))
    with pytest.raises(ValueError, match="rt_stretch must be ≥ 0"):
        live_config(config(tmp_path, ("tandem:rt_stretch=-1",)))
    with pytest.raises(ValueError, match="runs tandem, fcfs, priority; not rr"):
        live_config(config(tmp_path, ("rr",)))


def test_a_row_runs_the_shipped_options_with_its_own_on_top(tmp_path: Path) -> None:
    run = rt_only_live_run(tmp_path)
    run.policy_options = dict(CPU_POLICY_OPTIONS)
    assert CPU_POLICY_OPTIONS["rt_stretch"] != 0.6  # else the test shows nothing
    merged = run.options_of("tandem:rt_stretch=0.6")
    assert merged == {**CPU_POLICY_OPTIONS, "rt_stretch": 0.6}
    assert run.options_of("tandem") == CPU_POLICY_OPTIONS and run.options_of("fcfs") == {}
    profile_path = resolve_profile("cpu-tiny")
    profile = load_profile(profile_path)
    section = engine_section(
        "tandem:rt_stretch=0.6", run, profile, profile_path, 31000, tmp_path / "e.log"
    )
    assert section["patch"] is True and section["policy"] == "tandem"
    assert section["policy_options"] == merged
    stock = engine_section("priority", run, profile, profile_path, 31001, tmp_path / "p.log")
    assert stock["patch"] is False and "policy_options" not in stock


def test_the_twin_of_a_row_runs_that_rows_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = rt_only_live_run(tmp_path)
    run.policy_options = dict(CPU_POLICY_OPTIONS)
    profile = load_profile(resolve_profile(run.config.profile))
    latency = LatencyModel.fit(profile.samples)
    _, kv = build(run.config, latency, profile)
    base = sim_config(profile, kv, run.workload)
    made: list[object] = []
    real_make_policy = live.make_policy  # type: ignore[attr-defined]

    def making(name: str, model: LatencyModel, **options: object) -> object:
        policy = real_make_policy(name, model, **options)
        made.append(policy)
        return policy

    monkeypatch.setattr(live, "make_policy", making)
    for spec in ("tandem", "tandem:rt_stretch=0.6", "priority"):
        result = run_sim(spec, run, latency, base)
        assert result.requests, spec
    shipped, varied, stock = made
    assert shipped.config.rt_stretch == CPU_POLICY_OPTIONS["rt_stretch"]  # type: ignore[attr-defined]
    assert varied.config.rt_stretch == 0.6  # type: ignore[attr-defined]
    assert varied.config.be_min_time_share == CPU_POLICY_OPTIONS["be_min_time_share"]  # type: ignore[attr-defined]
    assert stock.name == "priority"  # type: ignore[attr-defined]
