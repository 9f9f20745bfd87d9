"""The live bench's simulator twin runs at the real engine's speed: a latency model fitted to the
real engine's own iterations (bench.live.engine_samples, fit_engine, run_sim), else the profile
at the real engine's pace per batch regime over tandem's run (bench.live.learned_regime_pace),
or as tandem's calibration learned it at the end (bench.live.learned_pace); plus the serving
path's own time (bench.live.shifted)."""

from __future__ import annotations

from array import array
from pathlib import Path

import msgspec
import pytest

from backend.policy.latency import BatchShape, LatencyModel, ProfileSample, load_profile
from backend.policy.profiles import resolve_profile
from backend.policy.time_share import shape_of
from backend.sim.records import IterationLog, RequestRecord, SimResult
from bench.live import (
    engine_iteration_metrics,
    engine_samples,
    fit_engine,
    learned_pace,
    learned_regime_pace,
    paced_samples,
    run_sim,
    shifted,
)
from bench.metrics import compute_metrics
from bench.runner import sim_config
from common.wire import IterationMix, IterationRecord
from tests.unit.live_factories import rt_only_live_run


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


def _record(i: int, seconds: float, mix: IterationMix | None) -> IterationRecord:
    return IterationRecord(i, float(i), seconds, 0.01, mix)


def _mix(shape: BatchShape) -> IterationMix:
    return IterationMix(**msgspec.structs.asdict(shape))


def test_only_iterations_that_ran_a_known_token_mix_are_samples_of_the_engine() -> None:
    decodes = shape_of([100, 200], [])
    records = [
        _record(1, 0.02, _mix(decodes)),
        _record(2, 0.03, None),  # SGLang's own admission ran it: mix unknown
        _record(3, 0.0, _mix(decodes)),  # no time measured
        _record(4, 0.01, _mix(BatchShape())),  # nothing ran
    ]
    (sample,) = engine_samples(records)
    assert sample.shape == decodes and sample.seconds == 0.02


def test_the_real_rows_model_error_is_over_the_iterations_with_a_prediction() -> None:
    decodes = _mix(shape_of([100, 200], []))
    records = [
        IterationRecord(1, 1.0, 0.020, 0.010, decodes),  # predicted half: error 0.5
        IterationRecord(2, 2.0, 0.010, 0.010, decodes),  # exact
        IterationRecord(3, 3.0, 0.040, 0.0, None),  # SGLang's own scheduler: no prediction
    ]
    out = engine_iteration_metrics(records)
    assert out["iterations"] == 3
    assert out["iteration_s_mean"] == pytest.approx(0.07 / 3)
    assert out["latency_mape"] == pytest.approx(0.25)
    assert out["latency_model_error_p50"] == pytest.approx(0.25)
    assert out["latency_model_error_p99"] == pytest.approx(0.495)
    assert out["over_predicted_frac"] == pytest.approx(0.5)


def test_a_run_without_predictions_has_no_model_error() -> None:
    out = engine_iteration_metrics([IterationRecord(1, 1.0, 0.02, 0.0, None)])
    assert out["latency_model_error_p50"] is None and out["latency_mape"] is None


def _engine_shapes() -> list[BatchShape]:
    """Decode batches of 1-64 requests, prompts alone and prompts beside decodes."""
    shapes = [shape_of([300 + 10 * i] * n, []) for n in range(1, 65) for i in range(3)]
    shapes += [
        shape_of([], [(chunk, prefix)]) for chunk in (16, 64, 256, 512) for prefix in (0, 500)
    ]
    shapes += [shape_of([400] * n, [(chunk, 0)]) for n in (1, 8, 32) for chunk in (32, 128, 512)]
    return shapes


def test_the_twins_engine_is_fitted_to_the_real_engines_iterations() -> None:
    """A real engine whose decode cost grows more slowly with the batch than its profile says
    (large decode batches cheaper, small ones dearer): no single pace makes the profile
    predict it, the fit to its own iterations does."""
    profile = LatencyModel([0.004, 0.02, 0.004, 0.0, 0.0, 0.0, 0.0005, 0.0])
    real = LatencyModel([0.008, 0.02, 0.001, 0.0, 0.0, 0.0, 0.0002, 0.0])
    samples = [ProfileSample(shape=s, seconds=real.predict(s)) for s in _engine_shapes()]
    fitted = fit_engine(samples)
    for s in samples:
        assert fitted.predict(s.shape) == pytest.approx(s.seconds, rel=0.02)
    one_decode, full_batch = shape_of([300], []), shape_of([300] * 64, [])
    profile_ratio = profile.predict(full_batch) / profile.predict(one_decode)
    real_ratio = real.predict(full_batch) / real.predict(one_decode)
    assert profile_ratio > 1.5 * real_ratio  # the shapes differ: a pace cannot fix that


def test_the_twin_runs_its_batches_at_the_fitted_engines_times() -> None:
    """Every policy plans with the profile; the twin's iterations take what the engine fitted
    to the real run's iterations says: an engine twice as slow doubles the token times."""
    run = rt_only_live_run(
        Path("unused"),
        sim_regime_pace=(3.0, 3.0, 3.0),  # not what the twin runs at once an engine is fitted
    )
    profile = load_profile(resolve_profile(run.config.profile))
    latency = LatencyModel.fit(profile.samples)
    kv, workload = run.kv_capacity_tokens, run.workload
    base = sim_config(profile, kv, workload)
    tpot: dict[str, float] = {}
    for name, weights in (("as profiled", 1.0), ("twice as slow", 2.0)):
        run.sim_engine = LatencyModel([w * weights for w in latency.weights])
        metrics = compute_metrics(run_sim("fcfs", run, latency, base), workload.window_s)
        tpot[name] = float(metrics["rt_tpot_mean_s"] or 0.0)
    assert tpot["twice as slow"] == pytest.approx(2.0 * tpot["as profiled"], rel=0.1)


def test_the_profile_anchors_the_fit_at_the_runs_pace_per_regime() -> None:
    profile = load_profile(resolve_profile("cpu-tiny"))
    paced = paced_samples(profile, (2.0, 3.0, 4.0))
    for before, after in zip(profile.samples, paced, strict=True):
        regime = 0 if not before.shape.num_prefill else 1 if not before.shape.num_decode else 2
        assert after.shape == before.shape
        assert after.seconds == pytest.approx(before.seconds * (2.0, 3.0, 4.0)[regime])
    assert paced_samples(profile, ()) == list(profile.samples)
