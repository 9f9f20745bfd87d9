"""A real engine slowed on purpose (`engine.slowdown`, `tandem bench --engine sglang
--engine-slowdown`): the config refuses what it cannot do, the launcher loads the pace plugin
for every policy, the plugin's pause follows the schedule from the moment the start file
appears, and the live bench's twin takes the engine's own pace back out of a slowed run's
iterations before it puts the schedule on top."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from backend.launch.sglang import PACE_PLUGIN_NAME, engine_env, engine_settings
from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import resolve_profile
from backend.policy.time_share import shape_of
from backend.sglang_ext.pace import START_FILE_POLL_S, Stretch
from bench.live import (
    SLOWDOWN_START_FILE,
    LiveRun,
    engine_section,
    iteration_regime_pace,
    run_sim,
    slowdown_recovery,
    unslowed,
)
from bench.live_report import report_markdown, results_dict
from bench.metrics import compute_metrics
from bench.runner import sim_config
from common.config import (
    ENGINE_SETTINGS_ENV,
    ConfigError,
    EngineConfig,
    engine_settings_from_env,
    load_config,
)
from common.wire import IterationMix, IterationRecord
from tests.unit.live_factories import rt_only_live_run


def write(tmp_path: Path, engine: dict[str, object]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"engine": engine}))
    return path


# --- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"slowdown": "0.5"}, "engine.slowdown '0.5': factor 0.5 < 1 (a real engine can be made"),
        ({"slowdown": "1@0,0.8@30"}, "factor 0.8 < 1"),
        ({"slowdown": "3@10"}, "engine.slowdown '3@10': the first change must be at 0 s"),
        ({"slowdown": "fast"}, "engine.slowdown 'fast': entry 'fast' is not K or K@T"),
        ({"slowdown_start_file": "/tmp/go"}, "engine.slowdown_start_file needs engine.slowdown"),
        ({"slowdown": "2", "kind": "sim"}, "engine.slowdown stretches the forward passes of"),
        ({"slowdown": "2", "launch": False}, "(engine.kind sglang, engine.launch true)"),
    ],
)
def test_a_slowdown_tandem_cannot_apply_is_refused_naming_the_key(
    tmp_path: Path, engine: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, engine))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_schedule_reaches_the_engine_and_the_pace_plugin_loads_for_every_policy(
    tmp_path: Path,
) -> None:
    start = str(tmp_path / "go")
    for patch, policy in ((True, "tandem"), (False, "none")):
        engine = EngineConfig(
            patch=patch,
            policy=policy,
            profile="cpu-tiny",
            slowdown="1@0,3@60",
            slowdown_start_file=start,
        )
        env = engine_env(engine, base={})
        assert PACE_PLUGIN_NAME in env["SGLANG_PLUGINS"].split(",")
        settings = engine_settings_from_env(env)
        assert settings.slowdown == ((0.0, 1.0), (60.0, 3.0))
        assert settings.slowdown_start_file == start
        assert settings == engine_settings(engine) or settings.engine_key is None
    plain = engine_env(EngineConfig(), base={})
    assert PACE_PLUGIN_NAME not in plain["SGLANG_PLUGINS"]
    assert engine_settings_from_env(plain).slowdown == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"slowdown": [[0, 0.5]]}', "every factor must be ≥ 1"),
        ('{"slowdown": [[5, 2]]}', "first change must be at 0 s"),
        ('{"slowdown_start_file": "/x"}', "slowdown_start_file needs a slowdown"),
    ],
)
def test_bad_pace_settings_name_the_problem(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_settings_from_env({ENGINE_SETTINGS_ENV: value})


# --- the pause after each forward pass ------------------------------------------------------


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_without_a_start_file_the_schedule_counts_from_the_engines_start() -> None:
    clock = FakeClock(1000.0)
    stretch = Stretch(((0.0, 2.0), (60.0, 4.0)), None, clock)
    assert stretch.pause_s(0.1) == pytest.approx(0.1)  # 2×: as long again
    clock.now += 61.0
    assert stretch.pause_s(0.1) == pytest.approx(0.3)  # 4×
    assert stretch.stretched_s == pytest.approx(0.4)


def test_the_engine_runs_its_own_pace_until_the_start_file_appears(tmp_path: Path) -> None:
    clock = FakeClock(5000.0)
    start_file = tmp_path / "go"
    stretch = Stretch(((0.0, 1.0), (30.0, 3.0)), str(start_file), clock)
    assert stretch.pause_s(0.2) == 0.0
    start_file.write_text("5010.0\n")  # second 0 is the time written in it
    clock.now += START_FILE_POLL_S / 2
    assert stretch.pause_s(0.2) == 0.0  # not looked at again yet
    clock.now = 5035.0
    assert stretch.factor_now() == 1.0 and stretch.start_unix_s == 5010.0  # second 25: 1×
    clock.now = 5041.0
    assert stretch.pause_s(0.2) == pytest.approx(0.4)  # second 31: 3×


def test_a_start_file_without_a_time_counts_from_when_it_was_written(tmp_path: Path) -> None:
    start_file = tmp_path / "go"
    start_file.write_text("now\n")
    written = start_file.stat().st_mtime
    stretch = Stretch(((0.0, 2.0),), str(start_file), FakeClock(written + 1.0))
    assert stretch.factor_now() == 2.0 and stretch.start_unix_s == written


# --- the live bench -------------------------------------------------------------------------


def _live(tmp_path: Path, slowdown: tuple[tuple[float, float], ...]) -> LiveRun:
    return rt_only_live_run(tmp_path, slowdown)


def test_every_policys_engine_is_slowed_from_its_own_replays_start(tmp_path: Path) -> None:
    run = _live(tmp_path, ((0.0, 1.0), (20.0, 2.0)))
    profile_path = resolve_profile("cpu-tiny")
    profile = load_profile(profile_path)
    for name in ("tandem", "fcfs", "priority"):
        log = tmp_path / name / "engine.log"
        section = engine_section(name, run, profile, profile_path, 30000, log)
        assert section["slowdown"] == "1@0,2@20"
        assert section["slowdown_start_file"] == str(tmp_path / name / SLOWDOWN_START_FILE)
    plain = _live(tmp_path, ())
    section = engine_section("fcfs", plain, profile, profile_path, 30000, tmp_path / "e.log")
    assert "slowdown" not in section and "slowdown_start_file" not in section


def test_the_twin_takes_the_slowdown_out_of_the_real_engines_iterations() -> None:
    """An engine that ran at 1.5× its profile, slowed 1× then 3× from second 10 of a replay
    that started at Unix time 100: each iteration divided by the factor when it started gives
    back the engine's own pace, per regime."""
    latency = LatencyModel.fit(load_profile(resolve_profile("cpu-tiny")).samples)
    decodes, prompt = shape_of([300] * 8, []), shape_of([], [(256, 0)])
    records = []
    for i, at_s in enumerate((102.0, 105.0, 111.0, 115.0)):
        for shape, own_pace in ((decodes, 1.5), (prompt, 0.8)):
            factor = 3.0 if at_s - 100.0 >= 10.0 else 1.0
            seconds = own_pace * latency.predict(shape) * factor
            mix = IterationMix(**msgspec.structs.asdict(shape))
            records.append(IterationRecord(i, at_s + seconds, seconds, 0.0, mix))
    schedule = ((0.0, 1.0), (10.0, 3.0))
    raw = iteration_regime_pace(records, latency)
    assert raw[0] == pytest.approx(1.5 * 2.0) and raw[1] == pytest.approx(0.8 * 2.0)
    own = iteration_regime_pace(unslowed(records, schedule, 100.0), latency)
    assert own[0] == pytest.approx(1.5) and own[1] == pytest.approx(0.8)
    assert own[2] == pytest.approx((1.5 * 0.8) ** 0.5)  # no mixed batch ran: the others' mean
    assert iteration_regime_pace([], latency) == ()


def test_the_twin_runs_the_same_schedule_as_the_real_engine(tmp_path: Path) -> None:
    steady, slowed = _live(tmp_path, ()), _live(tmp_path, ((0.0, 2.0),))
    profile = load_profile(resolve_profile(steady.config.profile))
    latency = LatencyModel.fit(profile.samples)
    base = sim_config(profile, steady.kv_capacity_tokens, steady.workload)
    tpot = {}
    for label, run in (("steady", steady), ("slowed", slowed)):
        metrics = compute_metrics(run_sim("fcfs", run, latency, base), run.workload.window_s)
        tpot[label] = float(metrics["rt_tpot_mean_s"] or 0.0)
    assert tpot["slowed"] == pytest.approx(2.0 * tpot["steady"], rel=0.1)


def test_a_slowed_live_run_says_so_in_its_results_and_report(tmp_path: Path) -> None:
    slowed = _live(tmp_path, ((0.0, 1.0), (30.0, 2.0)))
    results = results_dict(slowed)
    assert results["engine_slowdown"] == "1@0,2@30"
    assert results["engine_slowdown_schedule"] == [
        {"start_s": 0.0, "factor": 1.0},
        {"start_s": 30.0, "factor": 2.0},
    ]
    assert "engine slowdown 1@0,2@30: every policy's engine sleeps" in report_markdown(
        slowed, plots=[]
    )
    plain = _live(tmp_path, ())
    assert "engine_slowdown" not in results_dict(plain)
    assert "engine slowdown" not in report_markdown(plain, plots=[])


def test_the_calibrations_recovery_is_timed_from_each_change_of_the_schedule() -> None:
    """The engine runs as predicted, goes 3× slower at second 20 of a replay started at Unix
    time 100; the model's prediction catches up 4 s later (iterations every 0.1 s), and the
    median over the trailing 1 s window half a second after that."""
    records = []
    for i in range(400):
        at = 100.0 + 0.1 * i
        measured = 0.03 if at < 120.0 else 0.09
        predicted = 0.03 if at < 124.0 else 0.088
        records.append(IterationRecord(i, at, measured, predicted, None))
    (change,) = slowdown_recovery(records, ((0.0, 1.0), (20.0, 3.0)), 100.0)
    assert (change["at_s"], change["from_factor"], change["factor"]) == (20.0, 1.0, 3.0)
    assert change["error_back_within_band_s"] == pytest.approx(4.5, abs=0.15)
    assert change["ratio_p50_back_within_band_s"] == pytest.approx(4.5, abs=0.15)
    # a slowdown from the start is a change too (from the engine's own pace); stock SGLang
    # predicts nothing, so it has no recovery to time
    assert len(slowdown_recovery(records, ((0.0, 2.0),), 100.0)) == 1
    stock = [msgspec.structs.replace(r, predicted_iteration_s=0.0) for r in records[:5]]
    assert slowdown_recovery(stock, ((0.0, 2.0),), 100.0) == []
