"""Online latency calibration (backend/policy/calibration.py) on hand-built sequences, the Timer's
use of its factors, and the tandem policy planning with a model that is 2× too fast."""

from __future__ import annotations

import math
import random

import pytest

from backend.policy.calibration import (
    DECODE,
    MIXED,
    PREFILL,
    LatencyCalibration,
    regime_of,
)
from backend.policy.latency import BatchShape
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.tandem.timing import BatchTotals, Timer
from backend.policy.types import IterationResult, Plan, ReqState
from tests.unit.tandem_factories import LATENCY, NOW, make_request, snapshot


def feed(
    calib: LatencyCalibration, pace: float, engine_s: float, it_s: float, regime: int
) -> float:
    """Iterations of model time `it_s` on an engine `pace` × slower, for `engine_s` seconds of
    engine time; the engine time it took."""
    t = 0.0
    while t < engine_s:
        calib.observe(it_s, pace * it_s, regime)
        t += pace * it_s
    return t


def time_to_within(
    calib: LatencyCalibration, pace: float, it_s: float, tol: float = 0.1, regime: int = DECODE
) -> float:
    """Engine seconds until the factor is within `tol` (relative) of `pace`."""
    t = 0.0
    while abs(calib.factor(regime) / pace - 1.0) > tol:
        calib.observe(it_s, pace * it_s, regime)
        t += pace * it_s
        assert t < 60.0, "did not converge"
    return t


def test_regimes() -> None:
    assert regime_of(0, 5) == DECODE and regime_of(0, 0) == DECODE
    assert regime_of(2, 0) == PREFILL and regime_of(1, 3) == MIXED


def test_starts_at_exactly_one_and_stays_there_on_exact_predictions() -> None:
    calib = LatencyCalibration()
    assert calib.factors == (1.0, 1.0, 1.0)
    rng = random.Random(0)
    for _ in range(5000):
        predicted = rng.uniform(0.001, 0.2)
        calib.observe(predicted, predicted, rng.randrange(3))
        # two evaluations of the same model may differ in the last bits: still exact
        calib.observe(predicted, predicted * (1 + 1e-13), rng.randrange(3))
    assert calib.factors == (1.0, 1.0, 1.0)
    assert all(type(f) is float for f in calib.factors)


@pytest.mark.parametrize("it_s", [0.005, 0.03, 0.2])
def test_a_slowdown_is_learned_within_about_a_second_at_any_iteration_rate(it_s: float) -> None:
    calib = LatencyCalibration()
    t = time_to_within(calib, 2.0, it_s)
    # engine seconds, whatever the iteration rate (τ_fast = 0.5 s), give or take an iteration
    assert 0.3 < t < 1.5 + 2.0 * it_s


@pytest.mark.parametrize("it_s", [0.005, 0.03])
def test_a_speedup_is_believed_more_slowly_but_within_a_few_seconds(it_s: float) -> None:
    calib = LatencyCalibration()
    feed(calib, 2.0, 30.0, it_s, DECODE)  # long enough for both means to settle at 2
    assert calib.factor(DECODE) == pytest.approx(2.0, rel=1e-3)
    down = time_to_within(calib, 1.0, it_s)
    assert 2.5 < down < 5.0  # τ_slow = 2 s: slower than upward, on the safe side
    # and up again from 1: fast
    feed(calib, 1.0, 30.0, it_s, DECODE)
    assert time_to_within(calib, 2.0, it_s) < 1.5


def test_a_faster_engine_is_learned_too() -> None:
    calib = LatencyCalibration()
    assert time_to_within(calib, 0.6, 0.03, tol=0.05) < 7.0
    feed(calib, 0.6, 10.0, 0.03, DECODE)
    assert calib.factor(DECODE) == pytest.approx(0.6, rel=1e-3)


@pytest.mark.parametrize("pace", [1.0, 1.5])
def test_lognormal_noise_does_not_move_the_factor_off_the_true_pace(pace: float) -> None:
    calib = LatencyCalibration()
    rng = random.Random(1)
    seen = []
    for _ in range(10_000):
        calib.observe(0.03, 0.03 * pace * math.exp(rng.gauss(0.0, 0.3)), DECODE)
        seen.append(calib.factor(DECODE) / pace)
    settled = seen[1000:]
    mean = sum(settled) / len(settled)
    assert 1.0 <= mean < 1.03  # unbiased means; the max of the two leans a little high
    assert min(settled) > 0.85 and max(settled) < 1.35  # bounded excursions, no drift
    assert abs(sum(settled[-3000:]) / 3000 - mean) < 0.02  # no divergence over time


def test_outliers_are_clipped_and_the_factor_stays_within_its_bounds() -> None:
    calib = LatencyCalibration()
    feed(calib, 1.0, 5.0, 0.03, DECODE)
    calib.observe(0.03, 3.0, DECODE)  # one 100× stall (GC, preemption)
    assert 1.0 < calib.factor(DECODE) < 2.0  # clipped, and weighs at most τ_fast / 2
    assert feed(calib, 1.0, 1.0, 0.03, DECODE) and calib.factor(DECODE) < 1.1  # gone in 1 s
    calib.observe(0.03, 1e-6, DECODE)  # one absurdly short measurement
    assert calib.factor(DECODE) > 0.95
    feed(calib, 1000.0, 3000.0, 0.03, DECODE)
    assert calib.factor(DECODE) == pytest.approx(256.0)  # max_factor
    # model iterations of 3 s, so 1,000× faster ones take 3 ms (with 30 ms ones, 120 s of
    # engine time were 4 million iterations: 25 s of this test)
    feed(calib, 0.001, 120.0, 3.0, DECODE)
    assert calib.factor(DECODE) == pytest.approx(1 / 256)  # min_factor
    before = calib.factors
    for bad in (0.0, -1.0, math.inf, math.nan):
        calib.observe(0.03, bad, DECODE)
        calib.observe(bad, 0.03, DECODE)
    assert calib.factors == before


def test_regimes_learn_independently_and_an_unseen_one_uses_the_pooled_factor() -> None:
    calib = LatencyCalibration()
    for _ in range(400):  # 2× slower decodes, prefill as profiled, interleaved
        calib.observe(0.02, 0.04, DECODE)
        calib.observe(0.05, 0.05, PREFILL)
    assert calib.factor(DECODE) == pytest.approx(2.0, rel=0.02)
    assert calib.factor(PREFILL) == pytest.approx(1.0, rel=0.02)
    # MIXED has never run: it borrows the pooled estimate (in between, never the optimistic
    # profile when batches are running slow)
    assert 1.0 < calib.factor(MIXED) < 2.0
    feed(calib, 3.0, 10.0, 0.03, MIXED)
    assert calib.factor(MIXED) == pytest.approx(3.0, rel=0.01)
    # a change seen in one regime only never moves another: a regime the policy plans rarely
    # would keep a factor it can never correct (tried: surprises spread to every regime pushed
    # the mixed factor to its bound on a busy host, and the policy stopped planning mixed
    # batches). A regime met after a change of pace learns it from its own first iterations
    # (surprise weight), and the SLO admission sees the misprediction at once (`PaceSpread`).
    assert calib.factor(DECODE) == pytest.approx(2.0, rel=0.02)
    assert calib.factor(PREFILL) == pytest.approx(1.0, rel=0.02)


def test_a_regime_seen_briefly_before_a_change_of_pace_follows_the_pooled_factor() -> None:
    # the simulator at slowdown 2 (session 35): a few prompt-only iterations at the start, while
    # every factor was still near 1, then RT decodes in every batch. The prompt-only factor kept
    # its first iterations' 1.1–1.3 for minutes while the engine ran at 2 in every regime, and
    # the policy split prompts from decodes expecting prompt-only iterations at 1.1× the profile.
    calib = LatencyCalibration()
    feed(calib, 1.0, 0.15, 0.03, PREFILL)  # 5 iterations, 0.15 s of evidence
    feed(calib, 2.0, 10.0, 0.03, MIXED)
    feed(calib, 2.0, 10.0, 0.03, DECODE)
    assert calib.factor(MIXED) == pytest.approx(2.0, rel=0.02)
    assert calib.factor(PREFILL) > 1.7  # the pooled pace for the weight its own 5 lack
    # its own evidence takes over as it comes: at pace 2 it converges to 2 exactly as fast
    assert time_to_within(calib, 2.0, 0.03, tol=0.02, regime=PREFILL) < 2.0
    # and a regime with seconds of evidence of its own is not moved by the others
    feed(calib, 1.0, 10.0, 0.03, PREFILL)
    feed(calib, 3.0, 10.0, 0.03, DECODE)
    assert calib.factor(PREFILL) == pytest.approx(1.0, rel=0.02)
    assert calib.factor(DECODE) == pytest.approx(3.0, rel=0.02)


def test_error_percentiles_on_a_known_sequence() -> None:
    calib = LatencyCalibration(window=100)
    assert calib.error_percentiles() == (None, None)
    errors = [i / 100 for i in range(100)]
    random.Random(2).shuffle(errors)
    for e in errors:
        calib.observe(1.0 + e, 1.0, PREFILL)  # |predicted − measured| / measured = e
    assert calib.error_percentiles() == pytest.approx((0.50, 0.99))
    summary = calib.summary()
    assert summary["latency_error_p50"] == pytest.approx(0.50)
    assert summary["latency_error_p99"] == pytest.approx(0.99)
    assert set(summary) >= {"latency_factor_decode", "latency_factor_prefill"}
    # the window keeps the last 100 only: 100 exact predictions push the errors out
    for _ in range(100):
        calib.observe(1.0, 1.0, DECODE)
    assert calib.error_percentiles() == (0.0, 0.0)


def test_the_corrected_error_uses_the_factor_in_force() -> None:
    calib = LatencyCalibration()
    feed(calib, 2.0, 30.0, 0.03, DECODE)
    calib.observe(0.03, 0.06, DECODE)
    assert calib.last_error == pytest.approx(0.5)
    assert calib.last_corrected_error == pytest.approx(0.0, abs=1e-3)
    p50, _ = calib.error_percentiles(corrected=True)
    assert p50 is not None and p50 < 0.01


def test_the_timer_scales_predictions_and_inversions_by_the_regime_factor() -> None:
    timer = Timer(LATENCY)
    t = BatchTotals()
    t.num_decode, t.decode_context = 4, 2000
    decode_only = timer.predict(t)
    with_chunk = timer.with_chunk(t, 500, 0)
    chunk = timer.max_chunk(t, 0.05, prefix=0, cap=10_000)
    timer.scale = (2.0, 1.0, 3.0)
    assert timer.predict(t) == 2.0 * decode_only
    assert timer.with_chunk(t, 500, 0) == 3.0 * with_chunk  # decodes + a chunk: MIXED
    scaled = timer.max_chunk(t, 0.05, prefix=0, cap=10_000)
    assert 0 < scaled < chunk
    assert timer.with_chunk(t, scaled, 0) <= 0.05 < timer.with_chunk(t, scaled + 1, 0)
    alone = BatchTotals()
    assert timer.with_chunk(alone, 500, 0) == LATENCY.predict(BatchShape().with_prefill(500))
    timer.scale = (1.0, 1.5, 1.0)
    assert timer.with_chunk(alone, 500, 0) == 1.5 * LATENCY.predict(BatchShape().with_prefill(500))


def _true_time(plan: Plan, reqs: dict[str, ReqState], pace: float) -> float:
    """What an engine `pace` × slower than LATENCY takes for `plan`."""
    shape = BatchShape()
    for rid in plan.decodes:
        shape = shape.with_decode(reqs[rid].context_len)
    for chunk in plan.prefills:
        shape = shape.with_prefill(chunk.tokens, reqs[chunk.rid].prefilled)
    return pace * LATENCY.predict(shape)


@pytest.mark.parametrize("use_calibration", [True, False])
def test_tandem_on_an_engine_twice_as_slow_as_its_profile_plans_shorter_chunks(
    use_calibration: bool,
) -> None:
    policy = TandemPolicy(LATENCY, config=TandemConfig(use_calibration=use_calibration))
    decoding = [
        make_request(f"d{i}", prompt_len=500, generated=5, running=True, ttft_target_s=5.0)
        for i in range(4)
    ]
    prompt = make_request("p", prompt_len=6000, ttft_target_s=30.0, arrival_s=NOW)
    reqs = {r.rid: r for r in [*decoding, prompt]}

    def plan() -> Plan:
        return policy.plan(snapshot(waiting=[prompt], running=decoding))

    first = plan()
    assert first.prefills and first.decodes and first.predicted_s is not None
    first_tokens = first.prefills[0].tokens
    assert first.predicted_s == pytest.approx(_true_time(first, reqs, 1.0))
    engine_s = 0.0
    while engine_s < 3.0:  # three seconds on an engine twice as slow as profiled
        p = plan()
        measured = _true_time(p, reqs, 2.0)
        policy.observe(IterationResult(start_s=NOW + engine_s, duration_s=measured, plan=p))
        engine_s += measured
    after = plan()
    assert after.predicted_s is not None
    truth = _true_time(after, reqs, 2.0)
    summary = policy.calibration.summary()
    assert summary["latency_factor_mixed"] == pytest.approx(2.0, rel=0.05)
    assert summary["latency_error_p50"] == pytest.approx(0.5, rel=0.01)  # the raw model's
    if use_calibration:
        assert after.prefills[0].tokens < first_tokens  # fewer tokens per iteration
        assert after.predicted_s == pytest.approx(truth, rel=0.1)  # and it knows the pace
        assert policy.timer.scale == policy.calibration.factors
    else:
        assert after.predicted_s == pytest.approx(truth / 2.0)  # the profile, as measured
        assert policy.timer.scale == (1.0, 1.0, 1.0)


def test_on_the_simulator_which_runs_as_profiled_every_factor_stays_exactly_one() -> None:
    from backend.sim.config import SimConfig
    from backend.sim.engine import simulate
    from backend.sim.source import ListSource
    from tests.unit.test_tandem_policy import _mixed_workload

    policy = TandemPolicy(LATENCY, config=TandemConfig(use_calibration=True))
    simulate(ListSource(_mixed_workload()), policy, LATENCY, SimConfig(kv_capacity_tokens=60_000))
    assert policy.calibration.samples > 100
    assert policy.calibration.factors == (1.0, 1.0, 1.0)
    assert policy.timer.scale == (1.0, 1.0, 1.0)
    _, p99 = policy.calibration.error_percentiles()
    assert p99 is not None and p99 < 1e-9


def test_a_much_slower_engine_is_learned_within_seconds_of_wall_time() -> None:
    # a CPU-bound neighbour made a real 2-core engine's iterations 12 ms → 400-900 ms: samples
    # come 40× less often, and at the expected-duration weight the factor took 18 s to follow
    calib = LatencyCalibration()
    wall_s = time_to_within(calib, 40.0, 0.012, tol=0.2)
    assert wall_s < 5.0


def test_a_second_of_much_faster_iterations_weighs_a_second_not_their_expected_time() -> None:
    # a real 2-core engine under a CPU spinner (×35): the spinner paused for about a second,
    # twenty 5 ms iterations came where 60 ms were expected, and at their expected weight they
    # took the factor from 38 to 11 — the next admitted chat then ran at ×35 and missed
    calib = LatencyCalibration()
    feed(calib, 35.0, 30.0, 0.004, DECODE)
    assert calib.factor(DECODE) == pytest.approx(35.0, rel=0.01)
    feed(calib, 1.2, 0.1, 0.004, DECODE)
    assert calib.factor(DECODE) > 0.85 * 35.0  # falls at the slow pace, in its own time
    # a speedup that lasts is still believed within a few seconds of wall time
    wall_s = feed(calib, 1.2, 6.0, 0.004, DECODE)
    assert wall_s <= 6.01 and calib.factor(DECODE) < 2.0


def test_the_mean_pace_weighs_the_whole_run_per_regime() -> None:
    # the live bench's twin replays a run at Σ measured ÷ Σ predicted per regime, where the
    # factors follow the last seconds only
    calib = LatencyCalibration()
    assert calib.mean_pace(DECODE) is None
    for _ in range(200):
        calib.observe(0.010, 0.030, DECODE)  # 3× slower for 6 s of engine time
    for _ in range(200):
        calib.observe(0.010, 0.010, DECODE)  # then as profiled for 2 s
    calib.observe(0.100, 0.050, PREFILL)
    assert calib.mean_pace(DECODE) == pytest.approx((6.0 + 2.0) / 4.0)
    assert calib.factor(DECODE) < 1.5  # the factor has moved on toward the last pace
    assert calib.mean_pace(PREFILL) == pytest.approx(0.5)
    assert calib.mean_pace(MIXED) is None
    summary = calib.summary()
    assert summary["latency_mean_pace_decode"] == pytest.approx(2.0)
    assert summary["latency_mean_pace_mixed"] is None
