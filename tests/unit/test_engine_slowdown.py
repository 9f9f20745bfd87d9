"""`--engine-slowdown`: the schedule parser, the simulated engine running K× slower than the
model the policy plans with (the policy is not told), the CLI's errors, overload loads
(`--load` > 1) and the latency-model error metrics; `--engine-noise`: the simulated engine's
pace jittering from one iteration to the next."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from backend.policy.registry import make_policy
from backend.policy.types import IterationResult, Plan, Policy, Snapshot
from backend.sim.config import SimConfig
from backend.sim.engine import PaceNoise, simulate
from backend.sim.records import IterationLog, SimResult
from backend.sim.source import ListSource, SimRequest
from bench.metrics import iteration_metrics
from bench.runner import BenchConfig
from bench.workloads.sources import drain
from common.slowdown import format_slowdown, parse_slowdown
from tandem.bench import add_bench_parser, config_from_args
from tests.unit.sim_factories import LATENCY, make_request
from tests.unit.test_bench_cli import one_line_error

# --- the schedule parser ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "schedule"),
    [
        ("2", ((0.0, 2.0),)),
        ("0.5", ((0.0, 0.5),)),
        ("1.5@0", ((0.0, 1.5),)),
        ("1@0,3@60", ((0.0, 1.0), (60.0, 3.0))),
        (" 1@0 , 2@10.5 , 0.8@20 ", ((0.0, 1.0), (10.5, 2.0), (20.0, 0.8))),
    ],
)
def test_parse_slowdown_accepts_a_factor_or_a_schedule(
    spec: str, schedule: tuple[tuple[float, float], ...]
) -> None:
    assert parse_slowdown(spec) == schedule
    assert parse_slowdown(format_slowdown(schedule)) == schedule


def test_format_slowdown_is_the_flag_syntax() -> None:
    assert format_slowdown(((0.0, 2.0),)) == "2"
    assert format_slowdown(((0.0, 1.0), (60.0, 3.0))) == "1@0,3@60"


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "empty entry"),
        ("1@0,", "empty entry"),
        ("0", "must be a finite number > 0"),
        ("-2", "must be a finite number > 0"),
        ("nan", "must be a finite number > 0"),
        ("inf", "must be a finite number > 0"),
        ("abc", "not K or K@T"),
        ("2@x", "not K or K@T"),
        ("2@5", "first change must be at 0"),
        ("1@0,3@60,2@60", "strictly increasing"),
        ("1@0,3@60,2@30", "strictly increasing"),
        ("1@0,0@60", "must be a finite number > 0"),
        ("1@0,3", "has no @T"),
        ("1@0,2@inf", "must be finite"),
    ],
)
def test_parse_slowdown_rejects_bad_input(spec: str, needle: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        parse_slowdown(spec)
    assert needle in str(exc_info.value) and "\n" not in str(exc_info.value)


def test_sim_config_validates_the_schedule_and_looks_up_the_factor() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        SimConfig(kv_capacity_tokens=10, engine_slowdown=((0.0, 1.0), (0.0, 2.0)))
    assert SimConfig(kv_capacity_tokens=10).slowdown_at(5.0) == 1.0
    cfg = SimConfig(kv_capacity_tokens=10, engine_slowdown=((0.0, 1.0), (60.0, 3.0)))
    assert [cfg.slowdown_at(t) for t in (0.0, 59.999, 60.0, 1e9)] == [1.0, 1.0, 3.0, 3.0]


# --- the simulated engine -----------------------------------------------------------------


class _Recorder:
    """fcfs, recording what `observe` tells it (the policy's only view of the engine)."""

    def __init__(self) -> None:
        self.policy: Policy = make_policy("fcfs", LATENCY)
        self.name = self.policy.name
        self.observed: list[IterationResult] = []

    def plan(self, snapshot: Snapshot) -> Plan:
        return self.policy.plan(snapshot)

    def observe(self, result: IterationResult) -> None:
        self.observed.append(result)
        self.policy.observe(result)


def _requests() -> list[SimRequest]:
    # Everything arrives at 0: fcfs then plans the same batches whatever the engine's speed.
    return [
        make_request(
            tier="rt" if i % 2 else "be",
            rid=f"r{i}",
            prompt_len=300 + 97 * i,
            output_len=40 + 7 * i,
            ttft_target_s=1.0 if i % 2 else None,
            tpot_target_s=0.1 if i % 2 else None,
        )
        for i in range(12)
    ]


def _simulate(slowdown: tuple[tuple[float, float], ...]) -> tuple[SimResult, _Recorder]:
    policy = _Recorder()
    cfg = SimConfig(kv_capacity_tokens=8000, max_prefill_tokens=1024, engine_slowdown=slowdown)
    return simulate(ListSource(_requests()), policy, LATENCY, cfg), policy


def _col(log: IterationLog, name: str) -> np.ndarray:
    return np.asarray(getattr(log, name), dtype=float)


@pytest.mark.parametrize("k", [0.5, 2.0, 3.0])
def test_every_iteration_takes_k_times_the_prediction(k: float) -> None:
    base, _ = _simulate(())
    slow, policy = _simulate(((0.0, k),))
    dur, pred = _col(slow.iterations, "duration_s"), _col(slow.iterations, "predicted_s")
    assert len(dur) > 20 and np.isfinite(pred).all()
    np.testing.assert_allclose(dur, k * pred, rtol=1e-12)
    # The same batches as at K = 1 (fcfs plans on the model), each K× longer.
    np.testing.assert_allclose(dur, k * _col(base.iterations, "duration_s"), rtol=1e-12)
    np.testing.assert_allclose(
        _col(slow.iterations, "rt_part_s"), k * _col(base.iterations, "rt_part_s"), rtol=1e-12
    )
    assert slow.end_s == pytest.approx(k * base.end_s)
    # The policy sees the measured durations, its own plans unchanged.
    assert [r.duration_s for r in policy.observed] == list(dur)
    assert [r.plan.predicted_s for r in policy.observed] == list(pred)


def test_a_schedule_switches_the_factor_mid_run() -> None:
    base, _ = _simulate(())
    switch_s = base.end_s / 3
    slow, _ = _simulate(((0.0, 1.0), (switch_s, 3.0)))
    start = _col(slow.iterations, "start_s")
    dur, pred = _col(slow.iterations, "duration_s"), _col(slow.iterations, "predicted_s")
    before, after = start < switch_s, start >= switch_s
    assert before.sum() > 5 and after.sum() > 5
    np.testing.assert_allclose(dur[before], pred[before], rtol=1e-12)
    np.testing.assert_allclose(dur[after], 3.0 * pred[after], rtol=1e-12)
    m = iteration_metrics(slow.iterations)
    assert m["latency_model_error_p50"] == pytest.approx(2 / 3)  # most iterations are slowed
    assert m["latency_model_error_p99"] == pytest.approx(2 / 3)


def test_each_batch_regime_runs_at_its_own_pace() -> None:
    # the live bench's twin: decode-only batches at 0.5×, prefill-only at 2×, mixed at 3×
    base, _ = _simulate(())
    policy = _Recorder()
    cfg = SimConfig(
        kv_capacity_tokens=8000, max_prefill_tokens=1024, regime_slowdowns=(0.5, 2.0, 3.0)
    )
    slow = simulate(ListSource(_requests()), policy, LATENCY, cfg)
    log = slow.iterations
    dur, pred = _col(log, "duration_s"), _col(log, "predicted_s")
    n_p, n_d = _col(log, "num_prefill"), _col(log, "num_decode")
    decode, prefill, mixed = n_p == 0, (n_p > 0) & (n_d == 0), (n_p > 0) & (n_d > 0)
    assert decode.sum() > 5 and prefill.sum() > 0 and mixed.sum() > 0
    np.testing.assert_allclose(dur[decode], 0.5 * pred[decode], rtol=1e-12)
    np.testing.assert_allclose(dur[prefill], 2.0 * pred[prefill], rtol=1e-12)
    np.testing.assert_allclose(dur[mixed], 3.0 * pred[mixed], rtol=1e-12)
    # fcfs plans the same batches on the model, whatever their pace
    np.testing.assert_allclose(pred, _col(base.iterations, "predicted_s"), rtol=1e-12)
    # an RT-only part of a mixed batch is timed at its own regime's pace, never above the batch
    rt_part = _col(log, "rt_part_s")
    assert (rt_part <= dur * (1 + 1e-12)).all()


def test_noise_draws_log_normal_factors_of_mean_one_from_its_own_seed() -> None:
    draws = [PaceNoise(0.3, 7).factor() for _ in range(3)]
    assert len(set(draws)) == 1  # a fresh stream per call: the same first draw
    noise = PaceNoise(0.3, 7)
    factors = np.array([noise.factor() for _ in range(20_000)])
    assert factors.mean() == pytest.approx(1.0, abs=0.01)  # as fast on average
    assert np.log(factors).std() == pytest.approx(0.3, rel=0.02)
    again = PaceNoise(0.3, 7)
    assert [again.factor() for _ in range(5)] == list(factors[:5])
    other = PaceNoise(0.3, "7:1")  # a pool's replica 1
    assert [other.factor() for _ in range(5)] != list(factors[:5])
    quiet = PaceNoise(0.0, 7)
    assert [quiet.factor() for _ in range(3)] == [1.0, 1.0, 1.0]


def _simulate_noisy(sigma: float, seed: int) -> tuple[SimResult, _Recorder]:
    policy = _Recorder()
    cfg = SimConfig(
        kv_capacity_tokens=8000,
        max_prefill_tokens=1024,
        engine_noise=sigma,
        engine_noise_seed=seed,
    )
    return simulate(ListSource(_requests()), policy, LATENCY, cfg), policy


def test_a_noisy_engine_jitters_each_iteration_and_the_policy_sees_only_the_times() -> None:
    base, _ = _simulate(())
    noisy, policy = _simulate_noisy(0.3, seed=1)
    dur, pred = _col(noisy.iterations, "duration_s"), _col(noisy.iterations, "predicted_s")
    # fcfs plans the same batches on the model, whatever their pace
    np.testing.assert_allclose(pred, _col(base.iterations, "predicted_s"), rtol=1e-12)
    ratio = dur / pred
    assert len(ratio) > 20 and len(set(ratio.round(9))) == len(ratio)  # each its own factor
    assert 0.1 < np.log(ratio).std() < 0.5 and 0.7 < ratio.mean() < 1.3
    assert [r.duration_s for r in policy.observed] == list(dur)
    # the same seed gives the same run; another seed another; σ 0 the engine as modelled
    again, _ = _simulate_noisy(0.3, seed=1)
    assert list(_col(again.iterations, "duration_s")) == list(dur)
    other, _ = _simulate_noisy(0.3, seed=2)
    assert list(_col(other.iterations, "duration_s")) != list(dur)
    quiet, _ = _simulate_noisy(0.0, seed=1)
    assert list(_col(quiet.iterations, "duration_s")) == list(_col(base.iterations, "duration_s"))


@pytest.mark.parametrize("sigma", [-0.1, 2.5, math.nan])
def test_engine_noise_must_be_a_sigma_within_bounds(sigma: float) -> None:
    with pytest.raises(ValueError, match=r"engine_noise must be in \[0, 2\]"):
        SimConfig(kv_capacity_tokens=10, engine_noise=sigma)


@pytest.mark.parametrize("factors", [(1.0, 2.0), (1.0, 0.0, 2.0), (1.0, math.inf, 1.0)])
def test_regime_slowdowns_must_be_three_positive_factors(factors: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="regime_slowdowns must be"):
        SimConfig(kv_capacity_tokens=10, regime_slowdowns=factors)


# --- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("0", "--engine-slowdown '0': factor 0 at 0 s must be a finite number > 0"),
        ("-1", "must be a finite number > 0"),
        ("fast", "not K or K@T"),
        ("3@60", "first change must be at 0"),
        ("1@0,3@60,2@60", "strictly increasing"),
        ("1@0,,2@5", "empty entry"),
    ],
)
def test_bad_engine_slowdown_is_one_line(
    capsys: pytest.CaptureFixture[str], value: str, needle: str
) -> None:
    argv = ["bench", "W1", "--engine-slowdown", value, "--duration-s", "1"]
    assert needle in one_line_error(capsys, argv)


def test_the_real_engine_can_be_slowed_but_not_sped_up(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "W1", "--engine", "sglang", "--engine-slowdown", "1@0,0.5@30"]
    assert "factor 0.5 < 1; the real engine (sglang) can be made slower" in one_line_error(
        capsys, argv
    )
    cfg = _config(["bench", "W1", "--engine", "sglang", "--engine-slowdown", "1@0,2@30"])
    assert cfg.engine_slowdown == ((0.0, 1.0), (30.0, 2.0))
    assert "--engine sglang" in cfg.command and "--engine-slowdown 1@0,2@30" in cfg.command


def _config(argv: list[str]) -> BenchConfig:
    parser = argparse.ArgumentParser(prog="tandem")
    add_bench_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(argv))


def test_engine_slowdown_reaches_the_config_and_the_command() -> None:
    cfg = _config(["bench", "W1", "--engine-slowdown", "1@0,3@60", "--out", "/tmp/x"])
    assert cfg.engine_slowdown == ((0.0, 1.0), (60.0, 3.0))
    assert "--engine-slowdown 1@0,3@60" in cfg.command
    plain = _config(["bench", "W1", "--out", "/tmp/x"])
    assert plain.engine_slowdown == () and "slowdown" not in plain.command


def test_engine_noise_reaches_the_config_and_the_command_for_the_simulator_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = _config(["bench", "W1", "--engine-noise", "0.3", "--out", "/tmp/x"])
    assert cfg.engine_noise == 0.3 and "--engine-noise 0.3" in cfg.command
    plain = _config(["bench", "W1", "--out", "/tmp/x"])
    assert plain.engine_noise == 0.0 and "noise" not in plain.command
    live = ["bench", "W1", "--engine", "sglang", "--engine-noise", "0.3"]
    assert "--engine-noise: only for the simulated engine" in one_line_error(capsys, live)
    wild = ["bench", "W1", "--engine-noise", "3", "--duration-s", "1"]
    assert "--engine-noise must be in [0, 2], got 3" in one_line_error(capsys, wild)


def test_on_unattainable_names_an_outcome_for_every_tenant_or_per_tenant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = _config(["bench", "W6", "--on-unattainable", "rt-burst=accept,downgrade", "--out", "/x"])
    assert cfg.on_unattainable == (("rt-burst", "accept"), ("", "downgrade"))
    assert "--on-unattainable rt-burst=accept,downgrade" in cfg.command
    plain = _config(["bench", "W6", "--out", "/tmp/x"])
    assert plain.on_unattainable == () and "unattainable" not in plain.command
    for value, needle in [
        ("maybe", "'maybe' is no outcome (choose from reject, downgrade, accept)"),
        ("=accept", "'=accept' names no tenant"),
        ("a=accept,a=reject", "tenant 'a' is given twice"),
        ("accept,reject", "the bare outcome is given twice"),
    ]:
        argv = ["bench", "W6", "--on-unattainable", value, "--duration-s", "1"]
        assert needle in one_line_error(capsys, argv)
    live = ["bench", "W6", "--engine", "sglang", "--on-unattainable", "accept"]
    assert "--on-unattainable: only for the simulated engine" in one_line_error(capsys, live)
    # a tenant the workload does not have would change nothing: refused, naming the ones it has
    typo = ["bench", "W6", "--on-unattainable", "rt-bursty=accept", "--duration-s", "1"]
    assert "W6 has no RT tenant 'rt-bursty' (its RT tenants: rt-steady, rt-burst)" in (
        one_line_error(capsys, typo)
    )
    anonymous = ["bench", "W1", "--on-unattainable", "chat=accept", "--duration-s", "1"]
    assert "W1 has no RT tenant 'chat' (it names no RT tenants)" in one_line_error(
        capsys, anonymous
    )


def test_overload_is_accepted_and_scales_the_rt_rate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from backend.policy.latency import LatencyModel, load_profile
    from backend.policy.profiles import resolve_profile
    from bench import runner

    cfg = _config(["bench", "W1", "--load", "1.5", "--duration-s", "10", "--out", str(tmp_path)])
    assert cfg.load == 1.5
    profile_path = resolve_profile(cfg.profile)
    profile = load_profile(profile_path)
    latency = LatencyModel.fit(profile.samples)
    workload, kv = runner.build(cfg, latency, profile)
    monkeypatch.setattr(runner.cap, "rt_capacity", lambda *a, **k: (10.0, True))
    capacity, _, rate = runner.measure_rate(
        cfg, workload, latency, profile_path, runner.sim_config(profile, kv, workload)
    )
    assert capacity == 10.0 and rate == pytest.approx(workload.rt_rate_share * 1.5 * 10.0)
    assert rate is not None
    rt = [s for s in drain(workload.source(rate, False)) if s.tier == "rt"]
    assert 100 < len(rt) < 200  # 15 req/s over 10 s


# --- the metrics --------------------------------------------------------------------------


def test_latency_model_error_percentiles_on_a_hand_built_log() -> None:
    log = IterationLog(100)
    # (predicted, measured): errors |p − m| / m = 0, 0.5, 0.5, 1/3, and one without prediction.
    for pred, dur in ((0.1, 0.1), (0.1, 0.2), (0.05, 0.1), (0.4, 0.3), (None, 0.5)):
        log.append(
            start_s=0.0,
            duration_s=dur,
            predicted_s=pred,
            plan_ms=1.0,
            num_prefill=0,
            num_decode=1,
            prefill_tokens=0,
            kv_used_tokens=10,
            num_running=1,
            num_waiting=0,
            num_evictions=0,
        )
    errors = [0.0, 0.5, 0.5, 1 / 3]
    m = iteration_metrics(log)
    assert m["latency_model_error_p50"] == pytest.approx(float(np.percentile(errors, 50)))
    assert m["latency_model_error_p50"] == pytest.approx((1 / 3 + 0.5) / 2)
    assert m["latency_model_error_p99"] == pytest.approx(float(np.percentile(errors, 99)))
    assert m["latency_mape"] == pytest.approx(sum(errors) / 4)
    empty = iteration_metrics(IterationLog(100))
    assert empty["latency_model_error_p50"] is None and empty["latency_model_error_p99"] is None
    assert not math.isnan(float(m["latency_model_error_p99"] or 0.0))
