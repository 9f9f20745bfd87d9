"""The SLO admission's forecast (backend/policy/feasibility.py) on hand-built engine states, and
the simulator's front door that applies it (each contract outcome)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from msgspec.structs import replace as msgspec_replace

from backend.policy.calibration import DECODE, PREFILL, PaceSpread
from backend.policy.feasibility import (
    MIN_PACE_ITERATIONS,
    MIN_VERIFIED_ITERATIONS,
    Backlog,
    Forecast,
    RtOutputs,
    Shortfall,
    SloAsk,
    SloForecaster,
    TtftFeedback,
    idle,
    load_of,
    mean_iteration_s,
    pace_stretch,
    work_ahead,
)
from backend.policy.latency import LatencyModel
from backend.policy.load_report import observe_pace, policy_factors
from backend.policy.types import IterationResult, ReqState
from backend.sim.config import SimConfig, SloUnattainable
from backend.sim.engine import simulate
from backend.sim.front_door import FrontDoor, front_door_for
from backend.sim.records import RequestRecord
from backend.sim.source import ListSource, SimRequest
from common.wire import EngineLoad, TenantLoad
from tests.unit.sim_factories import LATENCY, make_req, make_request, make_snapshot
from tests.unit.tandem_factories import make_policy

# LATENCY: 10 ms per iteration + 20 ms per 1K prefill tokens + 1 ms per 1K decode context.
FORECASTER = SloForecaster(LATENCY, iteration_budget_s=0.05, headroom=0.8)


def idle_load(**fields: Any) -> EngineLoad:
    """An engine state after its first iteration: empty unless *fields* say otherwise."""
    return EngineLoad(iteration=1, at_unix_s=0.0, **fields)


def test_an_idle_engine_meets_a_short_prompt() -> None:
    forecast = FORECASTER.forecast(idle_load(), SloAsk(prompt_tokens=1000, ttft_target_s=1.0))
    # one chunk of 1000 tokens: 10 ms + 20 ms
    assert forecast.ttft_s == pytest.approx(0.030)
    assert forecast.feasible


def test_an_idle_engine_whose_model_is_unchecked_admits_what_it_forecasts_late() -> None:
    """A profile measured on a busy machine can be many times too slow; on an idle engine no
    iteration would ever correct it, so refusing there would refuse for good."""
    long_ask = SloAsk(prompt_tokens=10_000, ttft_target_s=0.1)  # 10 chunks of 50 ms: 0.5 s
    unverified = FORECASTER.forecast(idle_load(), long_ask)
    assert unverified.ttft_s > 0.1 and unverified.feasible
    verified = idle_load(calibration_samples=MIN_VERIFIED_ITERATIONS)
    assert not FORECASTER.forecast(verified, long_ask).feasible  # the profile's pace misses
    assert not FORECASTER.forecast(idle_load(num_be_running=1), long_ask).feasible  # busy
    in_flight = Backlog(num_requests=1, prompt_tokens=10)
    assert not FORECASTER.forecast(idle_load(), long_ask, in_flight).feasible
    # what is measured still counts: the wait so far, what outcomes taught
    waited = SloAsk(prompt_tokens=10_000, ttft_target_s=0.1, waited_s=0.09)
    assert not FORECASTER.forecast(idle_load(), waited, ttft_extra_s=0.02).feasible
    assert not FORECASTER.forecast(idle_load(), msgspec_replace(waited, waited_s=0.11)).feasible
    assert not FORECASTER.forecast(idle_load(), long_ask, ttft_extra_s=0.09).feasible
    assert idle(idle_load()) and not idle(idle_load(num_rt_waiting=1))


def test_an_idle_engine_re_checks_a_pace_learned_earlier_instead_of_refusing_on_it() -> None:
    """A pace learned before the engine went idle (its slow first iterations, a neighbour
    gone since) would refuse every request for good: nothing runs that could re-check it."""
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.1, tpot_target_s=0.02)
    slow: dict[str, Any] = {"latency_factors": (4.0, 4.0, 4.0), "pace_ratio_p90": 3.0}
    learned = idle_load(calibration_samples=500, **slow)
    forecast = FORECASTER.forecast(learned, ask)
    assert forecast.ttft_s > 0.1  # 30 ms × 4 × 3: the pace says it misses
    assert forecast.feasible  # but at the profile's pace, alone, it is met: it runs
    busy = idle_load(calibration_samples=500, num_rt_running=1, rt_context_tokens=100, **slow)
    assert not FORECASTER.forecast(busy, ask).feasible  # with work to re-check the pace: refused
    impossible = SloAsk(prompt_tokens=1000, ttft_target_s=0.1, tpot_target_s=0.001)
    assert not FORECASTER.forecast(learned, impossible).feasible  # 10 ms decodes at any pace


def test_a_request_waits_for_what_is_left_of_the_iteration_in_flight() -> None:
    """An iteration is not preempted: deep into a long BE prompt on a CPU engine one runs for
    seconds, and an RT request that arrives then waits for its rest, whatever the iteration
    before it took."""
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=1.0)  # 30 ms alone
    # the report came after a 10 ms iteration, and a 2 s one started then
    long_next = idle_load(num_be_running=1, iteration_s=0.01, inflight_predicted_s=2.0)
    assert FORECASTER.forecast(long_next, ask).ttft_s == pytest.approx(2.03)
    judged_at = [(0.5, 1.53), (1.9, 0.13), (3.0, 0.03)]  # seconds after the report
    for at_s, ttft_s in judged_at:
        forecast = FORECASTER.forecast(long_next, SloAsk(1000, 1.0, at_s=at_s))
        assert forecast.ttft_s == pytest.approx(ttft_s)
        assert forecast.feasible == (ttft_s <= 1.0 * FORECASTER.headroom)
    # an engine that does not say what runs: its last iteration stands for it, as before
    unknown = idle_load(num_be_running=1, iteration_s=0.4)
    assert FORECASTER.forecast(unknown, SloAsk(1000, 1.0, at_s=5.0)).ttft_s == pytest.approx(0.43)
    # the engine's recent worst pace stretches it like the rest of the forecast
    slow = msgspec_replace(long_next, pace_ratio_p90=2.0)
    assert FORECASTER.forecast(slow, SloAsk(1000, 1.0, at_s=3.0)).ttft_s == pytest.approx(1.06)


def test_a_prompt_after_a_cached_prefix_costs_what_its_chunks_attend_to() -> None:
    """A conversation's turn computes only its new tokens, but they attend to the whole
    history its engine's cache holds: on a backend that recomputes the prefix's attention rows
    (the CPU engine's), a 274-token turn after 2,200 cached tokens costs about as much as the
    whole conversation's last chunk."""
    # 10 ms per iteration + 20 ms per 1K prompt tokens + 50 ms per 1M token² of (prefix+chunk)²
    full_square = LatencyModel([0.010, 0.020, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.050])
    forecaster = SloForecaster(full_square, iteration_budget_s=1.0)
    new_only = forecaster.forecast(idle_load(), SloAsk(274, 1.0)).ttft_s
    turn = forecaster.forecast(idle_load(), SloAsk(274, 1.0, cached_tokens=2200)).ttft_s
    assert new_only == pytest.approx(0.010 + 0.020 * 0.274 + 0.050 * 0.274**2)
    assert turn == pytest.approx(0.010 + 0.020 * 0.274 + 0.050 * 2.474**2)
    # the forecast's own model (no such term) sees no difference
    assert FORECASTER.forecast(idle_load(), SloAsk(274, 1.0, cached_tokens=2200)).ttft_s == (
        pytest.approx(FORECASTER.forecast(idle_load(), SloAsk(274, 1.0)).ttft_s)
    )


def test_rt_prompts_ahead_delay_the_first_token_and_the_excess_is_named() -> None:
    load = idle_load(num_rt_waiting=10, rt_waiting_prompt_tokens=20_000, iteration_s=0.05)
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tpot_target_s=0.2)
    forecast = FORECASTER.forecast(load, ask)
    # the iteration in flight, then 21K tokens in 2000-token chunks (50 ms each), the last 1000
    assert forecast.ttft_s == pytest.approx(0.05 + 10 * 0.05 + 0.03)
    shortfall = forecast.shortfall
    assert shortfall is not None and shortfall.target == "ttft"
    assert shortfall.predicted_s == pytest.approx(forecast.ttft_s)
    assert shortfall.retry_after_s >= 1.0
    message = shortfall.describe()
    assert "time to first token" in message and "500 ms" in message and "80 ms over" in message


def test_a_forecast_under_the_target_but_over_its_headroom_names_a_positive_excess() -> None:
    """With headroom < 1 a forecast of 801 ms misses a 1000 ms target (it must stay within
    650 ms); the message said "-199 ms over" before."""
    shortfall = Shortfall("ttft", target_s=1.0, predicted_s=0.801, retry_after_s=1.0, budget_s=0.65)
    assert shortfall.over_s == pytest.approx(0.151)
    message = shortfall.describe()
    assert "1000 ms" in message and "650 ms" in message and "151 ms over" in message


def test_a_slower_engine_turns_a_feasible_request_away() -> None:
    load = idle_load(num_rt_waiting=4, rt_waiting_prompt_tokens=8000)
    ask = SloAsk(prompt_tokens=2000, ttft_target_s=0.5)
    assert FORECASTER.forecast(load, ask).feasible  # 5 chunks of 50 ms
    slow = idle_load(
        num_rt_waiting=4, rt_waiting_prompt_tokens=8000, latency_factors=(3.0, 3.0, 3.0)
    )
    assert not FORECASTER.forecast(slow, ask).feasible


def test_recent_iterations_slower_than_the_calibrated_model_scale_the_forecast() -> None:
    ask = SloAsk(prompt_tokens=2000, ttft_target_s=0.5, tpot_target_s=0.05)
    steady = FORECASTER.forecast(idle_load(num_rt_running=2, rt_context_tokens=2000), ask)
    # the calibration has not caught up yet: 1 iteration in 10 ran 4× over its prediction
    swinging = idle_load(num_rt_running=2, rt_context_tokens=2000, pace_ratio_p90=4.0)
    late = FORECASTER.forecast(swinging, ask)
    assert steady.feasible and late.ttft_s == pytest.approx(4 * steady.ttft_s)
    assert late.tpot_s == pytest.approx(4 * (steady.tpot_s or 0.0))
    shortfall = late.shortfall
    assert shortfall is not None and shortfall.target == "tpot"  # 4 × 14 ms over 0.8 × 50 ms
    # faster than predicted never makes a forecast more optimistic than the calibrated model
    quick = FORECASTER.forecast(
        idle_load(num_rt_running=2, rt_context_tokens=2000, pace_ratio_p90=0.5), ask
    )
    assert quick.ttft_s == pytest.approx(steady.ttft_s)


def test_pace_spread_is_the_recent_upper_ratio_and_forgets_old_iterations() -> None:
    spread = PaceSpread(window=10, quantile=0.9)
    assert spread.upper() == 1.0  # nothing measured yet: the calibrated model as it is
    for _ in range(10):
        spread.observe(0.01, 0.011)
    assert spread.upper() == pytest.approx(1.1)
    spread.observe(0.01, 0.4)  # the neighbour starts: the very next forecast knows
    assert spread.upper() == pytest.approx(40.0)
    for _ in range(10):
        spread.observe(0.01, 0.01)
    assert spread.upper() == pytest.approx(1.0)  # ten iterations later it is gone
    for bad in (0.0, -1.0, math.inf, math.nan):
        spread.observe(bad, 0.01)
        spread.observe(0.01, bad)
    assert spread.upper() == pytest.approx(1.0)


def test_the_recent_mean_is_the_pace_now_and_moves_within_a_few_iterations() -> None:
    spread = PaceSpread(window=32, quantile=0.9, recent=8)
    assert spread.recent_mean() == 1.0  # nothing measured yet
    for i in range(32):  # a noisy engine: one iteration in four 1.6× its prediction
        spread.observe(0.01, 0.016 if i % 4 == 0 else 0.01)
    assert spread.upper() == pytest.approx(1.6)
    assert spread.recent_mean() == pytest.approx(1.15)  # the slow ones count in a sum
    for _ in range(5):  # a neighbour takes the CPU: iterations at 3×
        spread.observe(0.01, 0.03)
    assert spread.recent_mean() == pytest.approx((5 * 3.0 + 3 * 1.0) / 8)  # moving after five
    assert spread.upper() == pytest.approx(3.0)
    for _ in range(3):
        spread.observe(0.01, 0.03)
    assert spread.recent_mean() == pytest.approx(3.0)  # the pace now, after eight
    # measured against the factors as they are now, like the p90
    assert spread.recent_mean((3.0, 1.0, 1.0)) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        PaceSpread(window=8, recent=9)


def test_a_wait_of_many_iterations_is_stretched_by_the_pace_now_and_part_of_the_noise() -> None:
    assert pace_stretch(1.5, None, 100) == 1.5  # not reported: the p90 whole
    assert pace_stretch(1.5, 1.0, 1) == pytest.approx(1.5)  # one iteration: the p90
    assert pace_stretch(1.5, 1.0, 4) == pytest.approx(1.25)  # the noise over √4
    assert pace_stretch(1.5, 1.0, 100) == pytest.approx(1.05)
    assert pace_stretch(3.0, 3.0, 100) == pytest.approx(3.0)  # a change of pace counts whole
    assert pace_stretch(2.0, 2.5, 100) == pytest.approx(2.5)  # a burst newer than the p90
    assert pace_stretch(0.8, 0.5, 10) == 1.0  # never faster than the calibrated model
    assert pace_stretch(1.5, 1.0, 0) == pytest.approx(1.5)  # no iteration counted: one


def test_a_slower_pace_the_factors_have_learned_is_not_counted_twice() -> None:
    spread = PaceSpread(window=10, quantile=0.9)
    for _ in range(10):  # a fresh engine runs 9× its profile before the factor knows it
        spread.observe(0.01, 0.09, DECODE, plan_factor=1.0)
    assert spread.upper() == pytest.approx(9.0)  # the forecast knows at once
    # once the decode factor has learned 9×, those iterations were as the model now says
    assert spread.upper((9.0, 1.0, 1.0)) == pytest.approx(1.0)
    # iterations planned at the learned factor count against the factors of the moment too
    spread.observe(0.18, 0.27, DECODE, plan_factor=9.0)  # 1.5× the learned pace
    assert spread.upper((9.0, 1.0, 1.0)) == pytest.approx(1.5)
    # a regime is measured against its own factor
    spread.observe(0.01, 0.04, PREFILL, plan_factor=1.0)
    assert spread.upper((9.0, 2.0, 1.0)) == pytest.approx(2.0)


def test_a_fresh_engine_that_ran_slow_is_forecast_at_its_learned_pace_only() -> None:
    """What refused every chat of a fresh CPU engine (see `PaceSpread`): the policy's plans,
    each 9× slower than predicted, teach the decode factor 9× while the spread keeps them; the
    TPOT forecast from the report is the profile × 9, not × 81."""
    policy = make_policy()
    spread = PaceSpread()
    running = [make_req(f"r{i}", running=True, generated=1) for i in range(4)]
    for step in range(40):
        snap = make_snapshot(running=running, now_s=1.0 + step)
        plan = policy.plan(snap)
        assert plan.predicted_s is not None and plan.decodes
        measured_s = 9.0 * plan.predicted_s / policy.plan_factor(plan)
        observe_pace(spread, policy, plan, measured_s)
        policy.observe(IterationResult(start_s=1.0 + step, duration_s=measured_s, plan=plan))
    factors = policy_factors(policy)
    assert factors[DECODE] == pytest.approx(9.0, rel=0.05)
    assert spread.upper() > 8.0  # against the prediction of its time: 9× counted again
    assert spread.upper(factors) == pytest.approx(1.0, rel=0.05)
    ask = SloAsk(prompt_tokens=10, ttft_target_s=5.0, tpot_target_s=1.0)
    load = idle_load(num_rt_running=4, rt_context_tokens=4 * 101, latency_factors=factors)
    learned = FORECASTER.forecast(msgspec_replace(load, pace_ratio_p90=spread.upper(factors)), ask)
    at_profile = FORECASTER.forecast(idle_load(num_rt_running=4, rt_context_tokens=404), ask)
    assert learned.tpot_s is not None and at_profile.tpot_s is not None
    assert learned.tpot_s == pytest.approx(9.0 * at_profile.tpot_s, rel=0.1)


def test_work_sent_but_not_yet_reported_counts_like_the_queue() -> None:
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5)
    queued = FORECASTER.forecast(idle_load(num_rt_waiting=8, rt_waiting_prompt_tokens=16_000), ask)
    in_flight = FORECASTER.forecast(idle_load(), ask, Backlog(num_requests=8, prompt_tokens=16_000))
    assert in_flight.ttft_s == pytest.approx(queued.ttft_s)
    assert not in_flight.feasible


def test_time_already_waited_counts_against_the_ttft_target() -> None:
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, waited_s=0.45)
    forecast = FORECASTER.forecast(idle_load(), ask)
    assert forecast.ttft_s == pytest.approx(0.48)
    # 30 ms predicted of the 50 ms left, within the headroom of those (40 ms)
    assert forecast.feasible and forecast.ttft_budget_s == pytest.approx(0.45 + 0.8 * 0.05)
    verified = idle_load(calibration_samples=MIN_VERIFIED_ITERATIONS)
    later = FORECASTER.forecast(verified, msgspec_replace(ask, waited_s=0.47))
    assert later.ttft_s == pytest.approx(0.50) and not later.feasible


def test_what_outcomes_taught_is_added_to_the_ttft() -> None:
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, waited_s=0.1)
    plain = FORECASTER.forecast(idle_load(), ask)
    taught = FORECASTER.forecast(idle_load(), ask, ttft_extra_s=0.5)
    assert plain.ttft_s == pytest.approx(0.1 + 0.03) and plain.feasible
    assert taught.ttft_s == pytest.approx(0.1 + 0.03 + 0.5) and not taught.feasible


def test_feedback_believes_lateness_every_request_shares_at_once() -> None:
    feedback = TtftFeedback(quantile=0.75, window=16, decay_s=1e9)
    assert feedback.extra_s(0.0) == 0.0
    feedback.observe(0.1, 1.1, 0.0)  # the first first token, 1 s later than forecast
    assert feedback.extra_s(0.0) == pytest.approx(1.0)  # a lone sample is believed
    for t in range(1, 4):
        feedback.observe(0.1, 1.1, float(t))
    assert feedback.extra_s(4.0) == pytest.approx(1.0)
    for t in range(4, 15):  # then as forecast: 4 late of 15 still hold a quarter of them
        feedback.observe(0.1, 0.1, float(t))
    assert feedback.extra_s(15.0) == pytest.approx(1.0)
    feedback.observe(0.1, 0.05, 15.0)  # earlier than forecast counts as on time, never below
    assert feedback.extra_s(16.0) == 0.0


def test_feedback_is_not_moved_by_a_first_token_late_now_and_then() -> None:
    feedback = TtftFeedback(quantile=0.75, window=16, decay_s=1e9)
    for t in range(64):  # one in five first tokens 0.7 s late (a stall), the rest on time
        feedback.observe(0.05, 0.75 if t % 5 == 4 else 0.06, float(t))
        assert feedback.extra_s(float(t)) <= 0.0100001
    for t in range(64, 80):  # but one in three is a lateness they share: it is believed
        feedback.observe(0.05, 0.75 if t % 3 == 0 else 0.06, float(t))
    assert feedback.extra_s(80.0) == pytest.approx(0.7)


def test_feedback_lets_old_late_samples_fade_also_when_a_new_one_comes() -> None:
    feedback = TtftFeedback(quantile=0.75, window=16, decay_s=10.0)
    for _ in range(8):
        feedback.observe(0.1, 1.1, 0.0)  # a burst of first tokens 1 s late
    feedback.observe(0.1, 0.1, 30.0)  # 30 s later (three time constants) one on time
    assert feedback.extra_s(30.0) == pytest.approx(math.exp(-3.0))


def test_feedback_fades_when_nothing_is_admitted_to_learn_from() -> None:
    feedback = TtftFeedback(decay_s=10.0)
    feedback.observe(0.1, 0.9, 0.0)  # one first token 0.8 s late
    assert feedback.extra_s(0.0) == pytest.approx(0.8)
    assert feedback.extra_s(10.0) == pytest.approx(0.8 * math.exp(-1.0))
    assert feedback.extra_s(100.0) < 0.001  # tried again, as if never taught


def test_feedback_ignores_nonsense_and_stays_bounded() -> None:
    feedback = TtftFeedback(decay_s=1e9, max_extra_s=60.0)
    for bad in (math.inf, math.nan):
        feedback.observe(0.1, bad, 0.0)
        feedback.observe(bad, 0.1, 0.0)
    assert feedback.extra_s(0.0) == 0.0 and feedback.samples == 0
    feedback.observe(0.001, 1e6, 0.0)
    assert feedback.extra_s(0.0) == 60.0
    for bad_option in ({"quantile": 0.0}, {"quantile": 1.5}, {"window": 0}, {"decay_s": 0.0}):
        with pytest.raises(ValueError):
            TtftFeedback(**bad_option)


def test_feedback_learns_how_much_faster_a_slot_waits_steps_ran_and_reverts_on_slower_ones() -> (
    None
):
    """Forecasts of 1.0 s, 0.8 s of it a slot's wait at 10 ms a decode step, whose engine ran
    its iterations at 6 ms meanwhile: each needed the step scaled by 0.6. Believed after
    `slot_wait_min_samples`; a forecast made with the scale (its step is forecast before the
    scale) teaches the same scale, not 0.6 × 0.6; two of sixteen at a slower pace put it back
    to 1; a forecast that is mostly not a slot wait, or without the engine's iterations, teaches
    nothing; the scale never goes below its floor, and fades back to 1 when nothing comes."""
    feedback = TtftFeedback(decay_s=1e9)
    for t in range(3):
        feedback.observe(1.0, 0.68, float(t), slot_wait_s=0.8, slot_step_s=0.01, iteration_s=0.006)
        assert feedback.slot_wait_scale(float(t)) == 1.0  # not believed yet
    feedback.observe(1.0, 0.68, 3.0, slot_wait_s=0.8, slot_step_s=0.01, iteration_s=0.006)
    assert feedback.slot_wait_scale(3.0) == pytest.approx(0.6)
    assert feedback.extra_s(3.0) == 0.0  # early is not late
    for t in range(4, 16):  # forecast with the scale (0.48 s of wait), the same pace
        feedback.observe(
            0.68, 0.68, float(t), slot_wait_s=0.48, slot_step_s=0.01, iteration_s=0.006
        )
    assert feedback.slot_wait_scale(16.0) == pytest.approx(0.6)
    slower = {"slot_wait_s": 0.48, "slot_step_s": 0.01, "iteration_s": 0.011}
    feedback.observe(0.68, 1.1, 16.0, **slower)
    assert feedback.slot_wait_scale(16.0) == pytest.approx(0.6)  # one: a stall, perhaps
    feedback.observe(0.68, 1.1, 17.0, **slower)
    assert feedback.slot_wait_scale(17.0) == 1.0  # two of sixteen: the forecast pace is right
    for t in range(18, 40):  # mostly prompt work, or no iterations known: nothing
        feedback.observe(1.0, 0.1, float(t), slot_wait_s=0.3, slot_step_s=0.01, iteration_s=0.001)
        feedback.observe(1.0, 0.1, float(t), slot_wait_s=0.9, slot_step_s=0.01, iteration_s=None)
    assert feedback.slot_wait_scale(40.0) == 1.0
    floor = TtftFeedback(decay_s=10.0, slot_wait_floor=0.5)
    for _ in range(4):  # needed 0.2: held at the floor
        floor.observe(1.0, 0.3, 0.0, slot_wait_s=0.9, slot_step_s=0.01, iteration_s=0.002)
    assert floor.slot_wait_scale(0.0) == pytest.approx(0.5)
    assert floor.slot_wait_scale(10.0) == pytest.approx(1.0 - 0.5 * math.exp(-1.0))
    off = TtftFeedback(slot_wait=False)
    for t in range(8):
        off.observe(1.0, 0.3, float(t), slot_wait_s=0.9, slot_step_s=0.01, iteration_s=0.002)
    assert off.slot_wait_scale(8.0) == 1.0
    for bad_option in (
        {"slot_wait_quantile": 0.0},
        {"slot_wait_floor": 0.0},
        {"slot_wait_min_samples": 0},
        {"slot_wait_min_samples": 17},
    ):
        with pytest.raises(ValueError):
            TtftFeedback(**bad_option)


def test_slots_freed_in_fewer_steps_than_forecast_keep_the_quantiles_margin() -> None:
    """The slot wait's step count is a high quantile of the running requests' lengths, so most
    slots free in fewer steps than forecast. First tokens 0.3 s after a 1.0 s forecast that was
    0.8 s of slot wait, at the forecast pace (10 ms an iteration): the count came in under the
    quantile, not the pace — the scale stays 1 (the margin is what keeps the unlucky ones on
    time), where one learned from the whole wait would have cut it to its floor."""
    feedback = TtftFeedback(decay_s=1e9)
    for t in range(16):
        feedback.observe(1.0, 0.3, float(t), slot_wait_s=0.8, slot_step_s=0.01, iteration_s=0.01)
    assert feedback.slot_wait_scale(16.0) == 1.0
    assert feedback.extra_s(16.0) == 0.0


def test_the_engines_mean_iteration_comes_from_two_of_its_reports() -> None:
    assert mean_iteration_s(10, 100.0, 60, 101.5) == pytest.approx(0.03)
    assert mean_iteration_s(10, 100.0, 10 + MIN_PACE_ITERATIONS - 1, 100.1) is None  # too few
    assert mean_iteration_s(10, 100.0, 9, 100.1) is None  # the engine restarted: no pace
    assert mean_iteration_s(10, 100.0, 20, 99.0) == 0.0  # clocks apart: never negative


def test_the_forecast_scales_a_slot_wait_by_what_outcomes_taught() -> None:
    load = EngineLoad(
        iteration=10,
        at_unix_s=0.0,
        iteration_s=0.01,
        max_running_requests=8,
        num_rt_running=8,
        rt_context_tokens=8 * 300,
        rt_decode_steps_left=tuple(100 + i for i in range(8)),
    )
    ask = SloAsk(prompt_tokens=50, ttft_target_s=10.0, tpot_target_s=1.0)
    plain = FORECASTER.forecast(load, ask)
    taught = FORECASTER.forecast(load, ask, slot_wait_scale=0.5)
    assert plain.slot_wait_s > 0.0 and plain.slot_wait_scale == 1.0
    assert taught.slot_wait_s == pytest.approx(0.5 * plain.slot_wait_s)
    assert taught.slot_wait_scale == 0.5
    assert taught.ttft_s == pytest.approx(plain.ttft_s - 0.5 * plain.slot_wait_s)


def test_too_many_rt_decodes_miss_the_tpot_target() -> None:
    # 300 decodes of 1000 context: 10 ms + 300 ms per iteration
    load = idle_load(num_rt_running=299, rt_context_tokens=299_000)
    forecast = FORECASTER.forecast(
        load, SloAsk(prompt_tokens=1000, ttft_target_s=10.0, tpot_target_s=0.2)
    )
    assert forecast.tpot_s == pytest.approx(0.31)
    assert forecast.shortfall is not None and forecast.shortfall.target == "tpot"
    assert "time per output token" in forecast.shortfall.describe()
    relaxed = FORECASTER.forecast(
        load, SloAsk(prompt_tokens=1000, ttft_target_s=10.0, tpot_target_s=0.5)
    )
    assert relaxed.feasible


# ---------------------------------------------------------------------------------- per tenant


def waiting(
    tenant_id: str,
    tokens: int,
    weight: float = 1.0,
    count: int = 1,
    running: int = 0,
    counter: float = 0.0,
) -> TenantLoad:
    return TenantLoad(
        tenant_id=tenant_id,
        weight=weight,
        num_waiting=count,
        waiting_prompt_tokens=tokens,
        num_running=running,
        fair_counter=counter,
    )


def split(*tenants: TenantLoad, **fields: Any) -> EngineLoad:
    """An engine state whose waiting RT work is *tenants*' (totals summed)."""
    return idle_load(
        num_rt_waiting=sum(t.num_waiting for t in tenants),
        rt_waiting_prompt_tokens=sum(t.waiting_prompt_tokens for t in tenants),
        rt_by_tenant=tenants,
        **fields,
    )


def test_the_tenant_over_its_share_is_shed_and_the_other_admitted_on_the_same_load() -> None:
    load = split(waiting("burst", 20_000, count=10))
    steady = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="steady")
    burst = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="burst")
    # steady: its prompt, and of burst's queue only as much again (equal weights): one chunk
    assert work_ahead(load, steady).tokens == 2000
    admitted = FORECASTER.forecast(load, steady)
    assert admitted.feasible and admitted.ttft_s == pytest.approx(0.05)
    # burst: its whole queue is ahead of its own request
    assert work_ahead(load, burst).tokens == 21_000
    assert not FORECASTER.forecast(load, burst).feasible
    # the same queue reported without the split: all of it is ahead of everyone, as before
    totals = idle_load(num_rt_waiting=10, rt_waiting_prompt_tokens=20_000)
    assert not FORECASTER.forecast(totals, steady).feasible


def test_equal_weights_and_equal_backlogs_forecast_as_one_queue() -> None:
    load = split(waiting("a", 5000, count=3), waiting("b", 5000, count=3), iteration_s=0.02)
    whole = idle_load(num_rt_waiting=6, rt_waiting_prompt_tokens=10_000, iteration_s=0.02)
    for tenant_id in ("a", "b"):
        ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tpot_target_s=0.2, tenant_id=tenant_id)
        assert work_ahead(load, ask).tokens == 11_000
        assert FORECASTER.forecast(load, ask) == FORECASTER.forecast(whole, ask)


def test_weights_two_to_one_shift_the_split() -> None:
    load = split(waiting("heavy", 10_000, weight=2.0), waiting("light", 10_000, weight=1.0))
    heavy = SloAsk(prompt_tokens=1000, ttft_target_s=0.6, tenant_id="heavy", weight=2.0)
    light = SloAsk(prompt_tokens=1000, ttft_target_s=0.6, tenant_id="light", weight=1.0)
    # heavy: its 11K, and light's half of that; light: its 11K, and all of heavy's 10K (≤ 22K)
    assert work_ahead(load, heavy).tokens == 11_000 + 5_500
    assert work_ahead(load, light).tokens == 11_000 + 10_000
    assert FORECASTER.forecast(load, heavy).feasible  # 8 chunks + 500 tokens: 0.42 s ≤ 0.48
    assert not FORECASTER.forecast(load, light).feasible  # 10 chunks + 1000: 0.53 s


def test_an_active_tenant_counts_its_whole_share_ahead() -> None:
    # burst queued 20K; steady has nothing waiting but requests decoding: it keeps sending,
    # and what it sends while burst's request waits is served first, up to its share
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="burst")
    idle_steady = split(waiting("burst", 20_000, count=10), waiting("steady", 0, count=0))
    assert work_ahead(idle_steady, ask).tokens == 21_000
    active = split(waiting("burst", 20_000, count=10), waiting("steady", 0, count=0, running=3))
    assert work_ahead(active, ask).tokens == 42_000
    # and for steady's own request burst's share is bounded by steady's own work either way
    steady = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="steady")
    assert work_ahead(active, steady).tokens == 2000


def test_the_tenant_served_more_waits_for_the_other_to_catch_up() -> None:
    # both backlogged, equal weights; steady's counter is 3000 tokens above burst's (its
    # decodes were charged while burst idled): burst is served 3000 more before steady's turn
    load = split(
        waiting("steady", 1000, counter=53_000, running=2),
        waiting("burst", 20_000, count=10, counter=50_000, running=2),
    )
    steady = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="steady")
    burst = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="burst")
    assert work_ahead(load, steady).tokens == 2000 + 2000 + 3000
    # burst's own 21K, and of steady's queue its share less what burst is owed: 21K − 3K
    assert work_ahead(load, burst).tokens == 21_000 + 18_000
    # the same state without counters (a policy that keeps none): the split by work alone
    plain = split(waiting("steady", 1000, running=2), waiting("burst", 20_000, count=10, running=2))
    assert work_ahead(plain, steady).tokens == 4000


def test_a_tenant_back_from_idle_is_lifted_to_the_least_waiting_counter() -> None:
    # steady idled long (counter far below) and sends again: the engine lifts it to burst's
    # counter, so it gets no credit for the idle time — and none is owed to it either
    load = split(
        waiting("steady", 0, count=0, counter=1_000),
        waiting("burst", 20_000, count=10, counter=50_000, running=2),
    )
    steady = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="steady")
    assert work_ahead(load, steady).tokens == 1000 + 1000
    # burst has nothing waiting but decodes; steady waits: burst's next prompt is lifted to
    # steady's counter, so it is owed nothing beyond its share
    load = split(
        waiting("steady", 4000, count=2, counter=60_000),
        waiting("burst", 0, count=0, counter=50_000, running=2),
    )
    assert work_ahead(load, steady).tokens == 5000 + 5000


def test_own_decodes_beyond_the_share_stretch_the_wait_and_can_refuse() -> None:
    # steady decodes 40 requests, burst 10: every iteration charges steady 30 tokens more than
    # burst, which burst is owed in prompt tokens — on top of the work ahead
    load = split(
        waiting("steady", 0, count=0, counter=50_000, running=40),
        waiting("burst", 4000, count=2, counter=50_000, running=10),
    )
    steady = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="steady")
    burst = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="burst")
    assert work_ahead(load, steady).drift_tokens == 30.0
    assert work_ahead(load, burst).drift_tokens == 0.0
    plain = split(
        waiting("steady", 0, count=0, running=40), waiting("burst", 4000, count=2, running=10)
    )
    assert work_ahead(plain, steady).drift_tokens == 0.0  # no counters: no fair share to drift
    stretched = FORECASTER.forecast(load, steady)
    assert stretched.ttft_s > FORECASTER.forecast(plain, steady).ttft_s
    # decodes that take every iteration's whole chunk: the prompt waits for them to finish
    hogging = split(
        waiting("steady", 0, count=0, counter=50_000, running=5000),
        waiting("burst", 4000, count=2, counter=50_000, running=10),
    )
    late = FORECASTER.forecast(hogging, steady)
    assert not late.feasible and late.shortfall is not None
    assert late.shortfall.target == "ttft" and math.isfinite(late.shortfall.retry_after_s)


def test_the_gateway_backlog_counts_by_tenant_and_unattributed_work_in_full() -> None:
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, tenant_id="steady")
    load = split(waiting("steady", 1000))
    sent_by_burst = Backlog(8, 16_000, (waiting("burst", 16_000, count=8),))
    assert work_ahead(load, ask, sent_by_burst).tokens == 2000 + 2000
    sent_by_steady = Backlog(8, 16_000, (waiting("steady", 16_000, count=8),))
    assert work_ahead(load, ask, sent_by_steady).tokens == 18_000
    assert work_ahead(load, ask, Backlog(8, 16_000)).tokens == 18_000  # totals only


def test_load_of_splits_waiting_rt_work_by_tenant() -> None:
    chunked = make_req("c", prompt_len=3000, running=True, prefilled=1000)
    chunked.tenant_id, chunked.tenant_weight = "a", 2.0
    new_a, new_b = make_req("n1", prompt_len=700), make_req("n2", prompt_len=300)
    new_a.tenant_id, new_a.tenant_weight = "a", 2.0
    new_b.tenant_id = "b"
    snap = make_snapshot(running=[chunked], waiting=[new_a, new_b], kv_capacity=100_000)
    load = load_of(snap, iteration=1, at_unix_s=0.0, iteration_s=0.0)
    assert load.rt_by_tenant == (
        waiting("a", 2700, weight=2.0, count=2),
        waiting("b", 300),
    )
    decoding = make_req("d", prompt_len=100, running=True, generated=3)
    decoding.tenant_id = "b"
    snap = make_snapshot(running=[decoding], waiting=[new_b], kv_capacity=100_000)
    load = load_of(snap, iteration=1, at_unix_s=0.0, iteration_s=0.0)
    assert load.rt_by_tenant == (waiting("b", 300, running=1),)
    counted = load_of(
        snap, iteration=1, at_unix_s=0.0, iteration_s=0.0, rt_fair_counters={"b": 42.0, "x": 1.0}
    )
    assert counted.rt_by_tenant == (waiting("b", 300, running=1, counter=42.0),)


def test_load_of_leaves_an_overdue_prompt_out_of_the_work_ahead() -> None:
    # tandem serves a request past its TTFT deadline after every one that can still meet its
    # own, so its prompt is ahead of no new request; it still counts as waiting
    overdue, fresh = make_req("late", prompt_len=5000), make_req("new", prompt_len=300)
    overdue.ttft_due_s, fresh.ttft_due_s = 0.5, 2.5
    snap = make_snapshot(waiting=[overdue, fresh], kv_capacity=100_000, now_s=1.0)
    load = load_of(snap, iteration=1, at_unix_s=0.0, iteration_s=0.0)
    assert (load.num_rt_waiting, load.rt_waiting_prompt_tokens) == (2, 300)
    assert load.rt_by_tenant == (waiting(overdue.tenant_id, 300, count=2),)


def test_load_of_counts_a_prompt_ahead_once_tandem_serves_it_first() -> None:
    # more than rt_late_bound_frac of its target past its deadline, tandem serves it first
    # (one a plan): ahead of every new request again
    far, near = make_req("far", prompt_len=5000), make_req("near", prompt_len=700)
    far.arrival_s, far.ttft_due_s = 0.0, 0.5  # 2 s past a 0.5 s target
    near.arrival_s, near.ttft_due_s = 1.0, 2.3  # 0.2 s past a 1.3 s target
    fresh = make_req("new", prompt_len=300)
    fresh.ttft_due_s = 4.0
    snap = make_snapshot(waiting=[far, near, fresh], kv_capacity=100_000, now_s=2.5)
    bound = load_of(snap, iteration=1, at_unix_s=0.0, iteration_s=0.0, rt_late_bound_frac=1.0)
    assert (bound.num_rt_waiting, bound.rt_waiting_prompt_tokens) == (3, 5300)
    unbound = load_of(snap, iteration=1, at_unix_s=0.0, iteration_s=0.0)
    assert (unbound.num_rt_waiting, unbound.rt_waiting_prompt_tokens) == (3, 300)


def test_the_front_door_forecasts_for_the_arrivals_tenant() -> None:
    queued = [make_req(f"b{i}", prompt_len=2000) for i in range(10)]
    for r in queued:
        r.tenant_id = "burst"
    snap = make_snapshot(waiting=queued, kv_capacity=400_000)
    door = FrontDoor(FORECASTER, lambda: (1.0, 1.0, 1.0), "reject")
    steady = make_request(prompt_len=1000, ttft_target_s=0.5, tenant_id="steady")
    burst = make_request(prompt_len=1000, ttft_target_s=0.5, tenant_id="burst")
    assert door.admit(steady, snap, now_s=0.0) is steady
    assert door.admit(burst, snap, now_s=0.0) is None
    assert door.outcomes == {burst.rid: "shed"}


def test_the_front_door_follows_the_policys_fair_share_counters() -> None:
    # burst has 4K queued and keeps sending (one request decoding); steady has nothing waiting
    # but 10 requests decoding. Split by work alone steady's 1K prompt fits; with steady's
    # counter 20K tokens above burst's (its decodes were charged while burst idled), burst is
    # owed those first, and it does not
    queued = [make_req(f"b{i}", prompt_len=2000) for i in range(2)]
    decoding = [make_req(f"s{i}", prompt_len=100, running=True, generated=5) for i in range(11)]
    for r in queued + decoding[:1]:
        r.tenant_id = "burst"
    for r in decoding[1:]:
        r.tenant_id = "steady"
    snap = make_snapshot(waiting=queued, running=decoding, kv_capacity=400_000)
    steady = make_request(prompt_len=1000, ttft_target_s=0.5, tenant_id="steady")
    plain = FrontDoor(FORECASTER, lambda: (1.0, 1.0, 1.0), "reject")
    assert plain.admit(steady, snap, now_s=0.0) is steady
    counted = FrontDoor(
        FORECASTER,
        lambda: (1.0, 1.0, 1.0),
        "reject",
        rt_fair_counters=lambda: {"steady": 70_000.0, "burst": 50_000.0},
    )
    assert counted.admit(steady, snap, now_s=0.0) is None
    assert counted.outcomes == {steady.rid: "shed"}


def test_the_front_door_learns_from_outcomes_as_the_gateway_does() -> None:
    """With `ttft_feedback`, an admitted request whose first token came later than forecast
    (once finished, as the gateway's usage record of it) makes later forecasts add the lesson:
    a request the model alone admits is then shed."""
    snap = make_snapshot(waiting=[make_req("q", prompt_len=2000)], kv_capacity=400_000)
    first = make_request(rid="first", prompt_len=1000, ttft_target_s=0.5)
    later = make_request(rid="later", prompt_len=1000, ttft_target_s=0.5, arrival_s=2.0)
    blind = FrontDoor(FORECASTER, lambda: (1.0, 1.0, 1.0), "reject")
    taught = FrontDoor(FORECASTER, lambda: (1.0, 1.0, 1.0), "reject", feedback=TtftFeedback())
    for door in (blind, taught):
        assert door.admit(first, snap, now_s=0.0) is first
        door.learn("first", first_token_s=1.2, now_s=2.0)  # 1.2 s after admission, not ~0.1
    assert blind.admit(later, snap, now_s=2.0) is later
    assert taught.admit(later, snap, now_s=2.0) is None
    assert taught.outcomes == {"later": "shed"}
    taught.learn("unknown", first_token_s=1.0, now_s=2.0)  # shed or never forecast: no lesson


def test_the_simulators_admission_learns_only_when_asked_and_for_one_engine() -> None:
    from backend.policy.placement import make_router
    from backend.sim.pool import simulate_pool

    config = SimConfig(kv_capacity_tokens=100_000, ttft_feedback=True)
    with pytest.raises(ValueError, match="one engine"):
        simulate_pool(ListSource([]), [make_policy()], LATENCY, config, make_router("round-robin"))


def test_the_forecast_follows_an_engine_that_runs_prompts_and_decodes_apart() -> None:
    """tandem's `split_mixed`: where the model says 20 decodes cost 100 ms more beside a prompt
    than alone, the engine runs the prompt chunks alone and the decodes after them, and the
    forecast counts those cycles, not the mixed iterations it would not run."""
    penalty = LatencyModel([0.010, 0.020, 0.001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.005])
    load = idle_load(num_rt_running=20, rt_context_tokens=20_000)
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5)
    mixed = SloForecaster(penalty, iteration_budget_s=0.05, headroom=0.8).forecast(load, ask)
    apart = SloForecaster(
        penalty, iteration_budget_s=0.05, headroom=0.8, split_min_gain=0.1
    ).forecast(load, ask)
    # mixed: no chunk fits 50 ms beside the decodes (130 ms with any prompt): 16-token chunks
    assert not mixed.feasible
    # apart: the whole prompt alone (10 + 20 + 5 ms of its own square), then the decodes
    # (10 + 20 ms): 65 ms
    assert apart.feasible and apart.ttft_s == pytest.approx(0.065, rel=0.02)
    # a model without the penalty: nothing to gain apart, the same forecast either way
    plain = FORECASTER.forecast(load, ask)
    split = SloForecaster(
        LATENCY, iteration_budget_s=0.05, headroom=0.8, split_min_gain=0.1
    ).forecast(load, ask)
    assert split.ttft_s == plain.ttft_s


def test_the_prompts_iteration_gets_what_the_decodes_leave_of_their_tpot() -> None:
    """With the split, the prompts' iteration and the decodes' one come before the decodes'
    next token, as tandem's `split_pays` sizes them: on an engine whose decodes take most of
    their TPOT, the prompts get a small chunk a cycle — forecast so, not a chunk as large as
    the iteration budget (the real engine 3× slower than planned: first tokens 2-4 s late)."""
    penalty = LatencyModel([0.010, 0.020, 0.001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.005])
    forecaster = SloForecaster(penalty, iteration_budget_s=0.05, headroom=0.8, split_min_gain=0.1)
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5)
    loose = idle_load(num_rt_running=20, rt_context_tokens=20_000, rt_tpot_target_min_s=1.0)
    # the decodes (30 ms alone) leave 0.9 × 60 − 30 = 24 ms a cycle for the prompts' iteration
    tight = msgspec_replace(loose, rt_tpot_target_min_s=0.06, rt_decode_margin=0.1)
    free = forecaster.forecast(loose, ask)
    bound = forecaster.forecast(tight, ask)
    assert free.ttft_s == pytest.approx(0.065, rel=0.02)  # one cycle: the whole prompt alone
    # chunks of what fits 24 ms (10 ms fixed, 20 ms per 1K): two cycles of at most 54 ms
    assert 0.065 < bound.ttft_s <= 2 * 0.054
    # decodes that leave nothing (a 30 ms TPOT bound by 27 ms): no split — the mixed forecast
    none_left = msgspec_replace(loose, rt_tpot_target_min_s=0.03, rt_decode_margin=0.1)
    assert not forecaster.forecast(none_left, ask).feasible


def test_load_of_reports_the_tightest_tpot_of_the_rt_decodes_and_the_policys_margin() -> None:
    decoding = [make_req(f"d{i}", prompt_len=100, generated=5, running=True) for i in range(3)]
    for r, tpot_s in zip(decoding, (0.2, 0.05, None), strict=True):
        r.tpot_target_s = tpot_s
    prompt = make_req("p", prompt_len=100, running=True, prefilled=10)
    prompt.tpot_target_s = 0.01  # still prefilling: no token of it is due yet
    snap = make_snapshot(running=[*decoding, prompt])
    load = load_of(snap, iteration=1, at_unix_s=0.0, iteration_s=0.01, rt_decode_margin=0.1)
    assert (load.rt_tpot_target_min_s, load.rt_decode_margin) == (0.05, 0.1)
    quiet = load_of(make_snapshot(running=[prompt]), iteration=1, at_unix_s=0.0, iteration_s=0.01)
    assert quiet.rt_tpot_target_min_s is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="headroom"):
        SloForecaster(LATENCY, headroom=1.5)
    with pytest.raises(ValueError, match="iteration_budget_s"):
        SloForecaster(LATENCY, iteration_budget_s=0.0)


def test_load_of_counts_what_the_engine_holds() -> None:
    snap = make_snapshot(
        running=[
            make_req("rt-dec", tier="rt", prompt_len=500, generated=20, running=True),
            make_req("rt-chunk", tier="rt", prompt_len=3000, running=True, prefilled=1000),
            make_req("be-dec", tier="be", prompt_len=400, generated=10, running=True),
        ],
        waiting=[make_req("rt-new", prompt_len=700), make_req("be-new", tier="be")],
        kv_capacity=100_000,
    )
    factors = (2.0, 1.0, 2.0)
    load = load_of(snap, iteration=7, at_unix_s=1.0, iteration_s=0.02, latency_factors=factors)
    assert (load.num_rt_running, load.rt_context_tokens) == (1, 520)
    # the chunked prompt's 2000 tokens left plus the new prompt
    assert (load.num_rt_waiting, load.rt_waiting_prompt_tokens) == (2, 2700)
    assert (load.num_be_running, load.num_be_waiting, load.be_context_tokens) == (1, 1, 410)
    assert load.be_kv_tokens == 410
    assert load.kv_capacity_tokens == 100_000
    assert load.latency_factors == factors


def test_load_of_reports_the_request_cap_and_the_rt_prompts_holding_a_slot() -> None:
    snap = make_snapshot(
        running=[
            make_req("rt-dec", prompt_len=500, generated=20, running=True),
            make_req("rt-dec2", prompt_len=500, generated=90, running=True),
            make_req("rt-chunk", prompt_len=3000, running=True, prefilled=1000),
        ],
        waiting=[make_req("rt-new", prompt_len=700)],
        kv_capacity=100_000,
        max_running=8,
    )
    exact = {"rt_outputs": RtOutputs()}  # no history: each one's max_new_tokens − generated
    load = load_of(snap, iteration=1, at_unix_s=0.0, iteration_s=0.0, **exact)
    assert (load.num_rt_prefilling, load.max_running_requests) == (1, 8)
    assert load.rt_decode_steps_left == (10, 80)  # the decodes', fewest first
    # 4 RT requests of 64 slots: they cannot run out, and nothing is estimated
    roomy = msgspec_replace(snap, max_running=64)
    assert (
        load_of(roomy, iteration=1, at_unix_s=0.0, iteration_s=0.0, **exact).rt_decode_steps_left
        == ()
    )
    uncapped = load_of(
        make_snapshot(kv_capacity=100_000), iteration=1, at_unix_s=0.0, iteration_s=0.0
    )
    assert (uncapped.max_running_requests, uncapped.rt_decode_steps_left) == (0, ())


def slots_full(queued_by_tenant: dict[str, int], steps: int = 10) -> EngineLoad:
    """64 request slots, every one held by an RT decode (the k-th to finish after k × *steps*
    decode steps); *queued_by_tenant*: RT prompts of 100 tokens waiting per tenant (each tenant
    with decodes running). A decode step of the 64 takes 10 ms + 12.8 ms (LATENCY)."""
    queued = sum(queued_by_tenant.values())
    return idle_load(
        max_running_requests=64,
        num_rt_running=64,
        rt_context_tokens=64 * 200,
        num_rt_waiting=queued,
        rt_waiting_prompt_tokens=100 * queued,
        rt_decode_steps_left=tuple(steps * (i + 1) for i in range(64)),
        rt_by_tenant=tuple(
            TenantLoad(tenant_id=t, num_waiting=n, waiting_prompt_tokens=100 * n, num_running=32)
            for t, n in queued_by_tenant.items()
        ),
    )


STEP_S = 0.010 + 0.001 * 12.8  # one decode step of the 64 running (LATENCY)


def test_with_every_slot_held_by_rt_a_prompt_waits_for_rt_requests_to_finish() -> None:
    """W6 on the real engine: a bursting tenant's requests were admitted on the prompt work
    ahead (0.4-0.8 s) while all 64 slots were RT's, and waited 2-4 s for one."""
    ask = SloAsk(prompt_tokens=100, ttft_target_s=2.0, tenant_id="burst")
    # 20 queued ahead and it: the 21st RT decode to finish frees its slot, after 210 steps
    full = FORECASTER.forecast(slots_full({"burst": 20}), ask)
    assert full.ttft_s == pytest.approx(210 * STEP_S, rel=0.05)
    assert not full.feasible and full.shortfall is not None and full.shortfall.target == "ttft"
    assert full.shortfall.slot_wait_s == pytest.approx(210 * STEP_S, rel=0.01)
    assert "waiting for one of the engine's request slots" in full.shortfall.describe()
    # the same queue with slots to spare: the prompt work alone (21 × 100 tokens, ~0.1 s)
    spare = FORECASTER.forecast(
        msgspec_replace(slots_full({"burst": 20}), max_running_requests=128), ask
    )
    assert spare.ttft_s < 0.2 and spare.feasible
    # a miss for the prompt work ahead, with slots to spare, names no slot
    backlogged = msgspec_replace(
        slots_full({"burst": 20}), max_running_requests=128, rt_waiting_prompt_tokens=200_000
    )
    [late] = [FORECASTER.forecast(backlogged, ask).shortfall]
    assert late is not None and late.slot_wait_s == 0.0 and "slots" not in late.describe()
    # an engine that reports no cap, or no estimate of when its decodes finish: no slot wait
    for unknown in ({"max_running_requests": 0}, {"rt_decode_steps_left": ()}):
        blind = FORECASTER.forecast(msgspec_replace(slots_full({"burst": 20}), **unknown), ask)
        assert blind.ttft_s == pytest.approx(spare.ttft_s)
    # more slots needed than decodes reported: the reported ones turn over again
    short_list = msgspec_replace(slots_full({"burst": 20}), rt_decode_steps_left=(10, 20))
    assert FORECASTER.forecast(short_list, ask).ttft_s == pytest.approx(
        (10 * 20 + 10) * STEP_S, rel=0.05
    )
    # more slots needed than decodes run, every one reported: the requests that take the freed
    # slots run a new request's length (8 slots: 150 steps, while those running now all end
    # within 16; 8 queued ahead and it: the 9th slot frees when the request that took the
    # 1st, freed after 2 steps, has run its 150)
    step_8_s = 0.010 + 0.001 * 8 * 200 / 1000  # LATENCY: 8 decodes of 200 tokens
    burst = idle_load(
        max_running_requests=8,
        num_rt_running=8,
        rt_context_tokens=8 * 200,
        num_rt_waiting=8,
        rt_waiting_prompt_tokens=100 * 8,
        rt_decode_steps_left=(2, 4, 6, 8, 10, 12, 14, 16),
        rt_new_decode_steps=150,
        rt_by_tenant=(
            TenantLoad(tenant_id="burst", num_waiting=8, waiting_prompt_tokens=800, num_running=8),
        ),
    )
    turned = FORECASTER.forecast(burst, msgspec_replace(ask, ttft_target_s=1.5))
    assert turned.shortfall is not None
    assert turned.shortfall.slot_wait_s == pytest.approx((150 + 2) * step_8_s, rel=0.01)
    unknown = FORECASTER.forecast(
        msgspec_replace(burst, rt_new_decode_steps=0), msgspec_replace(ask, ttft_target_s=1.5)
    )
    assert unknown.ttft_s < turned.ttft_s  # without it: the longest running one's 16 steps


def test_the_headroom_is_for_what_the_forecast_guesses_not_for_what_it_counts() -> None:
    """W1 on the real engine (64 slots, all RT's): a forecast of 1,070 ms, 829 ms of it the slot
    wait, was refused against 0.65 × 1,500 ms; the admitted ones got their first token within
    1,196 ms. The time waited is spent; a slot wait, a sum of many decode steps at the engine's
    worst recent pace, strays less than the rest and gets the square root of the headroom."""
    forecaster = SloForecaster(LATENCY, iteration_budget_s=0.05, headroom=0.65)
    # 4 queued ahead and it: the 5th decode to finish frees its slot, after 50 steps (~1.14 s)
    ask = SloAsk(prompt_tokens=100, ttft_target_s=1.5, tenant_id="t")
    slot_bound = forecaster.forecast(slots_full({"t": 4}), ask)
    assert 0.65 * 1.5 < slot_bound.ttft_s < 1.5 and slot_bound.feasible
    slot_s = 50 * STEP_S  # within √0.65 of the target: 0.91 s of the 1.5 s
    budget_s = slot_s + 0.65 * (1.5 - slot_s / math.sqrt(0.65))
    assert slot_bound.ttft_budget_s == pytest.approx(budget_s, rel=0.01)
    # a slot wait that leaves the rest of the forecast no room is still refused, and says so
    late = forecaster.forecast(slots_full({"t": 5}, steps=12), ask)
    assert late.shortfall is not None and late.shortfall.slot_wait_s > 0.0
    assert late.shortfall.budget_s == pytest.approx(late.ttft_budget_s)
    assert late.ttft_s > late.ttft_budget_s
    # the time already waited is spent: the headroom is of what is left of the target
    busy = idle_load(num_rt_waiting=3, rt_waiting_prompt_tokens=6_000, num_rt_running=2)
    fresh = forecaster.forecast(busy, SloAsk(prompt_tokens=100, ttft_target_s=1.0))
    assert 0.1 < fresh.ttft_s < 0.2 and fresh.feasible
    waited = forecaster.forecast(busy, SloAsk(prompt_tokens=100, ttft_target_s=1.0, waited_s=0.55))
    assert waited.ttft_s > 0.65 * 1.0  # scaled whole, the time waited would refuse it
    assert waited.feasible and waited.ttft_budget_s == pytest.approx(0.55 + 0.65 * 0.45)
    # and without a slot wait or a wait behind it, the budget is the headroom of the target
    assert fresh.ttft_budget_s == pytest.approx(0.65)


def test_a_slot_wait_takes_the_noise_of_one_iteration_over_the_root_of_its_steps() -> None:
    """W1 on the real engine at its capacity: slot waits of ~10 decode steps at the p90 pace
    were forecast 0.2-0.4 s above the first token of the worst admitted request queued
    beside them, and refused requests that would have met their contract."""
    ask = SloAsk(prompt_tokens=100, ttft_target_s=1.8, tpot_target_s=0.1, tenant_id="t")
    steady = FORECASTER.forecast(slots_full({"t": 4}), ask)  # the 5th to finish: 50 steps
    noisy = msgspec_replace(slots_full({"t": 4}), pace_ratio_p90=1.5, pace_ratio_recent_mean=1.0)
    averaged = FORECASTER.forecast(noisy, ask)
    at_p90 = SloForecaster(LATENCY, iteration_budget_s=0.05, headroom=0.8, pace_averaging=False)
    whole = at_p90.forecast(noisy, ask)
    assert steady.shortfall is None and whole.shortfall is not None
    assert whole.shortfall.slot_wait_s == pytest.approx(1.5 * 50 * STEP_S, rel=0.01)
    # 50 steps and its prompt's one chunk: 1 + 0.5 ÷ √51 of the steady forecast
    assert averaged.ttft_s == pytest.approx(steady.ttft_s * (1 + 0.5 / math.sqrt(51)), rel=0.01)
    assert averaged.feasible
    # the engine slowed down: the pace now is 1.5× as well, and the wait takes it whole
    slowed = FORECASTER.forecast(msgspec_replace(noisy, pace_ratio_recent_mean=1.5), ask)
    assert slowed.ttft_s == pytest.approx(whole.ttft_s) and not slowed.feasible
    # a TPOT is forecast per iteration: the p90 whatever the wait
    assert averaged.tpot_s == whole.tpot_s == pytest.approx(1.5 * (steady.tpot_s or 0.0))


def test_a_slot_comes_sooner_to_the_tenant_fair_share_serves_first() -> None:
    load = slots_full({"steady": 1, "burst": 20})
    steady = FORECASTER.forecast(
        load, SloAsk(prompt_tokens=100, ttft_target_s=2.0, tenant_id="steady")
    )
    burst = FORECASTER.forecast(
        load, SloAsk(prompt_tokens=100, ttft_target_s=2.0, tenant_id="burst")
    )
    # steady: its own queued prompt, the burster's share of as much, and it: 4 slots
    assert steady.ttft_s == pytest.approx(40 * STEP_S, rel=0.1) and steady.feasible
    assert burst.ttft_s > 2.0 and not burst.feasible


def test_rt_outputs_learn_how_long_rt_requests_run_from_the_finished_ones() -> None:
    outputs = RtOutputs()
    early = make_req("x", running=True, generated=10, max_new_tokens=1000)
    assert outputs.steps_left(early) == 990  # no history: only its cap is known
    done = [make_req(f"d{i}", running=True, generated=n - 1) for i, n in enumerate((20, 40, 60))]
    kept = make_req("e", running=True, generated=5)
    outputs.observe(make_snapshot(running=[*done, kept]))
    evicted = make_req("e")  # back in the queue: it has not finished
    outputs.observe(make_snapshot(waiting=[evicted]))
    # finished at 20, 40 and 60 tokens; at 10 generated all three are longer: 40 - 10 left
    assert outputs.steps_left(early) == 30
    at_30 = make_req("y", running=True, generated=30, max_new_tokens=1000)
    assert outputs.steps_left(at_30) == 20  # (40 + 60) / 2 - 30
    capped = make_req("z", running=True, generated=30, max_new_tokens=35)
    assert outputs.steps_left(capped) == 5  # never past its max_new_tokens
    outlived = make_req("o", running=True, generated=70, max_new_tokens=1000)
    assert outputs.steps_left(outlived) == 930  # longer than every one seen
    assert outputs.new_request_steps() == 40  # a request starting now: the mean length
    assert RtOutputs().new_request_steps() == 0  # none finished yet
    with pytest.raises(ValueError, match="history"):
        RtOutputs(history=0)


def _finished(lengths: list[int], quantile: float | None = 0.9) -> RtOutputs:
    """An RtOutputs that saw RT requests of these output *lengths* run and finish."""
    outputs = RtOutputs(quantile=quantile)
    running = [
        make_req(f"f{i}", running=True, generated=n - 1, max_new_tokens=4096)
        for i, n in enumerate(lengths)
    ]
    outputs.observe(make_snapshot(running=running))
    outputs.observe(make_snapshot())
    return outputs


def _decoding(*generated: int, max_new_tokens: int = 1000) -> list[ReqState]:
    return [
        make_req(f"d{i}", running=True, generated=g, max_new_tokens=max_new_tokens)
        for i, g in enumerate(generated)
    ]


def test_the_kth_slot_frees_within_the_steps_reported_as_often_as_the_quantile_says() -> None:
    """What a user of the forecast needs: the k-th request slot is free within the reported
    steps in (about) the quantile of the cases, neither far more nor far less — checked by
    drawing the running requests' lengths from the same history (16 running: exact; 40:
    normal)."""
    rng = random.Random(7)
    history = [max(4, int(rng.lognormvariate(math.log(120), 0.8))) for _ in range(256)]
    for running, quantile in ((16, 0.9), (16, 0.95), (40, 0.9)):
        outputs = _finished(history, quantile)
        decoding = _decoding(*(rng.randint(0, 200) for _ in range(running)), max_new_tokens=4096)
        reported = outputs.slots_free_steps(decoding, 128)
        assert len(reported) == running and list(reported) == sorted(reported)
        draws = 4000
        within = [0] * running
        for _ in range(draws):
            left = sorted(
                rng.choice([n for n in history if n > r.generated] or [4096]) - r.generated
                for r in decoding
            )
            for k in range(running):
                within[k] += left[k] <= reported[k]
        for k in (0, 1, 3, running // 2):
            assert quantile - 0.04 <= within[k] / draws <= quantile + 0.08, (k, within[k] / draws)


def test_equal_lengths_free_the_slots_exactly_when_they_end() -> None:
    outputs = _finished([150] * 200)
    assert outputs.slots_free_steps(_decoding(120, 100, 140), 8) == (10, 30, 50)
    assert outputs.slots_free_steps(_decoding(120, 100, 140), 2) == (10, 30)  # the fewest
    assert outputs.slots_free_steps([], 8) == ()
    capped = _decoding(100, max_new_tokens=110)
    assert outputs.slots_free_steps(capped, 8) == (10,)  # never past its max_new_tokens
    # none finished yet: only the caps are known
    assert RtOutputs().slots_free_steps(_decoding(10, 20, max_new_tokens=100), 8) == (80, 90)
    # few seen: one may run past the longest of them (the phantom), so the last of three
    # together is not promised at 150 (0.95³ < 0.9)
    assert _finished([150] * 20).slots_free_steps(_decoding(120, 100, 140), 8)[2] > 50


def test_with_hundreds_decoding_the_first_slots_do_not_depend_on_how_many_are_asked() -> None:
    """Past `EXACT_SLOTS` the steps are searched a block of the grid at a time and the search
    stops at the last slot asked for: asking for 8 slots or for 128 gives the same first 8,
    each later slot no sooner, and the last one is never past the last cap."""
    rng = random.Random(11)
    history = [max(4, int(rng.lognormvariate(math.log(120), 0.8))) for _ in range(256)]
    outputs = _finished(history, 0.95)
    decoding = _decoding(*(rng.randint(0, 300) for _ in range(256)), max_new_tokens=4096)
    every = outputs.slots_free_steps(decoding, 256)
    assert outputs.slots_free_steps(decoding, 8) == every[:8]
    assert outputs.slots_free_steps(decoding, 128) == every[:128]
    assert list(every) == sorted(every) and every[-1] <= 4096 - min(r.generated for r in decoding)
    assert every[0] < every[127] < every[-1]


def test_where_every_request_runs_to_its_cap_the_slots_free_at_the_caps() -> None:
    """A client that sets max_tokens to what it wants (a bench's exact lengths): every output
    ran to its cap, none ended on its own, so none is expected to end before its cap — drawn
    from the lengths alone, many decodes together looked sure to free a slot within a few
    steps (the real engine's W1 at 15 req/s, 64 slots: 1.3 % of the admitted came late)."""
    outputs = RtOutputs(quantile=0.95)
    capped = [
        make_req(f"c{i}", running=True, generated=n - 1, max_new_tokens=n)
        for i, n in enumerate(range(20, 300, 7))
    ]
    outputs.observe(make_snapshot(running=capped))
    outputs.observe(make_snapshot())
    decoding = [
        make_req(f"d{i}", running=True, generated=g, max_new_tokens=g + left)
        for i, (g, left) in enumerate(zip(range(10, 330, 10), range(200, 40, -5), strict=True))
    ]
    lefts = sorted(r.max_new_tokens - r.generated for r in decoding)
    assert outputs.slots_free_steps(decoding, 128) == tuple(lefts)
    # the same lengths ended on their own: a slot is likely to free before the first cap
    assert _finished(list(range(20, 300, 7)), 0.95).slots_free_steps(decoding, 128)[0] < lefts[0]


def test_requests_still_running_and_past_the_longest_seen_keep_the_slot_wait_honest() -> None:
    """The finished lengths alone are the short ones first, and end every request at the
    longest seen: the mean forecast (quantile None) frees a slot when one that ran to 60
    tokens ended, though five others run past 80 already; and one past the longest seen
    (371) is taken to end with it. Counting the running ones (Kaplan–Meier) and one longer
    than any, neither frees a slot that soon."""
    mean = _finished([20, 20, 60], quantile=None)
    counted = _finished([20, 20, 60])
    decoding = _decoding(50, 80, 81, 82, 83, 84)
    assert mean.slots_free_steps(decoding, 8)[0] == 10
    assert counted.slots_free_steps(decoding, 8)[0] > 10
    history = [22, 36, 45, 54, 71, 95, 107, 123, 146, 170, 193, 221, 233, 301, 371]
    assert _finished(history, quantile=None).slots_free_steps(_decoding(360), 8) == (11,)
    assert _finished(history).slots_free_steps(_decoding(360), 8)[0] > 100


def test_the_slot_free_quantile_must_be_a_probability() -> None:
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="quantile"):
            RtOutputs(quantile=bad)
        with pytest.raises(ValueError, match="slo_slot_free_quantile"):
            make_policy(slo_slot_free_quantile=bad)


def _random_lengths_stream(quantile: float | None, seed: int) -> list[RequestRecord]:
    """The slot-bound stream with outputs the engine cannot know: 8 slots, RT at 15 req/s
    (Poisson), 50–250 output tokens (uniform), TTFT 0.5 s, judged again at the door."""
    rng = random.Random(seed)
    rt, at_s = [], 0.0
    for _ in range(300):
        at_s += rng.expovariate(15.0)
        rt.append(
            make_request(
                tier="rt",
                prompt_len=50,
                output_len=rng.randint(50, 250),
                max_new_tokens=1000,
                arrival_s=at_s,
                ttft_target_s=0.5,
                tpot_target_s=0.2,
            )
        )
    config = SimConfig(kv_capacity_tokens=400_000, max_running=8, slo_recheck_frac=0.5)
    policy = make_policy(latency_budget_s=0.05, slo_slot_free_quantile=quantile)
    return simulate(ListSource(rt), policy, LATENCY, config).requests


def test_outputs_the_engine_cannot_know_leave_the_admitted_on_time() -> None:
    """A slot wait forecast at the mean of each request's steps left was a coin toss: the
    admitted requests of these streams came late 1 in 28 (11 of 309). At the quantile of
    when the k-th slot frees, at most 1 in 100 comes late (none of 297), and about as many
    get in."""
    quantile, mean = [], []
    for seed in range(3):
        quantile += _random_lengths_stream(0.95, seed)
        mean += _random_lengths_stream(None, seed)

    def admitted(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r for r in records if r.admission != "shed"]

    late_quantile = sum(not _met(r) for r in admitted(quantile))
    late_mean = sum(not _met(r) for r in admitted(mean))
    assert late_quantile <= 0.01 * len(admitted(quantile)), late_quantile
    assert late_mean >= 3 * max(1, late_quantile), (late_mean, late_quantile)
    assert len(admitted(quantile)) >= 0.93 * len(admitted(mean))  # 297 against 309


def _rt_requests(count: int, gap_s: float, prompt_len: int, output_len: int) -> list[SimRequest]:
    """*count* RT requests (TTFT 0.5 s, TPOT 0.2 s), one every *gap_s*."""
    return [
        make_request(
            tier="rt",
            prompt_len=prompt_len,
            output_len=output_len,
            arrival_s=i * gap_s,
            ttft_target_s=0.5,
            tpot_target_s=0.2,
        )
        for i in range(count)
    ]


def _rt_stream(
    count: int, gap_s: float, prompt_len: int, output_len: int, **sim: Any
) -> list[RequestRecord]:
    """*count* RT requests (`_rt_requests`) through tandem with its SLO admission; *sim*: the
    SimConfig's other fields."""
    rt = _rt_requests(count, gap_s, prompt_len, output_len)
    config = SimConfig(kv_capacity_tokens=400_000, **sim)
    return simulate(ListSource(rt), make_policy(latency_budget_s=0.05), LATENCY, config).requests


def _slot_bound(max_running: int) -> list[RequestRecord]:
    """10 s of short RT prompts with long outputs, arriving faster than *max_running* slots
    free up (each request decodes for ~2 s; 20 arrive a second): prompt work is light, slots
    are what runs out."""
    return _rt_stream(200, 0.05, 50, 150, max_running=max_running)


def test_the_admitted_keep_their_ttft_when_request_slots_run_out() -> None:
    capped = _slot_bound(8)
    admitted = [r for r in capped if r.admission != "shed"]
    assert len(admitted) < len(capped)  # slots ran out: some were refused
    assert all(_met(r) for r in admitted), [
        round((r.first_token_s or math.inf) - r.arrival_s, 2) for r in admitted if not _met(r)
    ]
    assert all(r.admission != "shed" and _met(r) for r in _slot_bound(1024))  # slots to spare


def test_judged_again_as_slots_free_more_are_admitted_and_they_keep_their_ttft() -> None:
    """The gateway's recheck (`slo_recheck_frac`), in the simulator's front door: a request
    refused only for a request slot is judged again at each iteration boundary. In the
    slot-bound stream (the slots, not the forecast, bound how many get in) as many get in as
    when judged once, none is lost or left pending, and the admitted keep their TTFT though
    some waited at the door."""
    once = _slot_bound(8)
    rechecked = _rt_stream(200, 0.05, 50, 150, max_running=8, slo_recheck_frac=0.5)
    assert len(rechecked) == len(once) == 200  # each one admitted or shed, none left pending
    admitted = [r for r in rechecked if r.admission != "shed"]
    assert len(admitted) >= sum(r.admission != "shed" for r in once)
    assert all(_met(r) for r in admitted)
    assert {r.rid for r in admitted} != {r.rid for r in once if r.admission != "shed"}


def test_the_simulator_learns_how_long_rt_requests_run_from_every_iteration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The front door's slot forecast learns the RT output lengths from the engine's state
    after every iteration, as the real engine's reports carry them, not only from the states
    it sees when a request arrives: a request that finished between two arrivals was counted
    as long as it was when last seen, so every running request's steps left, and the slot
    wait, were forecast short (slot-bound bursts: admitted attainment 0.93, 0.97 with it).
    Every output here is 150 tokens; the cap (1,000) tells nothing."""
    doors: list[FrontDoor] = []

    def keep_door(*args: Any, **kwargs: Any) -> FrontDoor | None:
        door = front_door_for(*args, **kwargs)
        if door is not None:
            doors.append(door)
        return door

    monkeypatch.setattr("backend.sim.engine.front_door_for", keep_door)
    rt = [
        make_request(
            tier="rt",
            prompt_len=50,
            output_len=150,
            max_new_tokens=1000,
            arrival_s=i * 0.4,  # 40 decode steps or so between two arrivals
            ttft_target_s=1.5,
            tpot_target_s=0.2,
        )
        for i in range(40)
    ]
    config = SimConfig(kv_capacity_tokens=400_000, max_running=8)
    simulate(ListSource(rt), make_policy(latency_budget_s=0.05), LATENCY, config)
    (door,) = doors
    assert door.rt_outputs.new_request_steps() == 150
    running = make_req("r", running=True, generated=100, max_new_tokens=1000)
    assert door.rt_outputs.steps_left(running) == 50


@pytest.mark.parametrize("slo_unattainable", ["reject", "downgrade"])
def test_requests_still_judged_again_when_the_run_ends_get_their_contracts_answer(
    slo_unattainable: SloUnattainable,
) -> None:
    """Arrivals stop at the horizon while requests wait at the door for a slot: each still
    gets a record with its contract's answer (shed, or BE), none is lost."""
    records = _rt_stream(
        200,
        0.05,
        50,
        150,
        max_running=8,
        slo_recheck_frac=0.5,
        horizon_s=5.0,
        slo_unattainable=slo_unattainable,
    )
    arrived = sum(1 for i in range(200) if i * 0.05 < 5.0)
    assert len(records) == arrived
    assert {r.admission for r in records} == {
        "admitted",
        {"reject": "shed"}.get(slo_unattainable, "downgraded"),
    }


def test_a_pool_places_a_request_waiting_for_a_slot_again_as_iterations_end() -> None:
    """Two replicas of 8 slots each in the slot-bound stream, judged again as in the gateway's
    pool: every request gets a verdict, more or as many get in as when judged once, and the
    admitted keep their TTFT."""
    from backend.policy.placement import make_router
    from backend.sim.pool import simulate_pool

    rt = _rt_requests(300, 0.025, 50, 150)

    def run(frac: float) -> list[RequestRecord]:
        config = SimConfig(kv_capacity_tokens=400_000, max_running=8, slo_recheck_frac=frac)
        policies = [make_policy(latency_budget_s=0.05) for _ in range(2)]
        pool = simulate_pool(ListSource(rt), policies, LATENCY, config, make_router("round-robin"))
        return pool.result.requests

    once, rechecked = run(0.0), run(0.5)
    assert len(rechecked) == len(once) == 300
    admitted = [r for r in rechecked if r.admission != "shed"]
    assert len(admitted) >= sum(r.admission != "shed" for r in once)
    assert all(_met(r) for r in admitted)
    assert {r.rid for r in admitted} != {r.rid for r in once if r.admission != "shed"}


def test_the_front_door_keeps_a_later_arrival_behind_the_ones_kept_for_a_slot() -> None:
    """The gateway's `SlotLine` in the simulator's front door: with requests kept for a slot
    (`pending`: they came first), a later one whose forecast meets its contract but waits for
    a slot is kept too — sent first, it would take their slot; one a free slot is there for,
    or whose recheck time is up, is not; with the line off each is judged on its own."""
    door = FrontDoor(SloForecaster(LATENCY), lambda: (1.0, 1.0, 1.0), "reject", recheck_frac=0.5)
    door.slot_line = True
    ask = SloAsk(prompt_tokens=50, ttft_target_s=1.0, tpot_target_s=0.2, waited_s=0.1)
    waits = Forecast(ttft_s=0.6, tpot_s=0.05, shortfall=None, ttft_budget_s=0.8, slot_wait_s=0.4)
    free = msgspec_replace(waits, slot_wait_s=0.0)
    req = make_request(tier="rt", ttft_target_s=1.0)
    assert not door.kept(req, waits, ask)  # no one kept before it
    door.pending.append(make_request(tier="rt", ttft_target_s=1.0))
    assert door.kept(req, waits, ask) and not door.kept(req, free, ask)
    assert not door.kept(req, waits, msgspec_replace(ask, waited_s=0.5))  # its recheck time is up
    door.slot_line = False
    assert not door.kept(req, waits, ask)


def _overload(slo_unattainable: SloUnattainable) -> list[RequestRecord]:
    """8 s of 2000-token RT prompts at about twice what the engine can prefill in time."""
    return _rt_stream(400, 0.02, 2000, 4, slo_unattainable=slo_unattainable)


def _met(rec: RequestRecord) -> bool:
    return (
        rec.first_token_s is not None
        and rec.ttft_target_s is not None
        and rec.first_token_s - rec.arrival_s <= rec.ttft_target_s + 1e-9
    )


def test_reject_sheds_what_cannot_be_met_and_the_admitted_keep_their_slo() -> None:
    records = _overload("reject")
    shed = [r for r in records if r.admission == "shed"]
    admitted = [r for r in records if r.admission == "admitted"]
    assert len(shed) + len(admitted) == 400
    assert 0 < len(shed) < 400 and all(r.generated == 0 for r in shed)
    assert sum(_met(r) for r in admitted) >= 0.99 * len(admitted)


def test_downgrade_runs_the_unmeetable_as_be_and_loses_none() -> None:
    records = _overload("downgrade")
    downgraded = [r for r in records if r.admission == "downgraded"]
    assert downgraded and all(r.tier == "be" for r in downgraded)
    assert all(r.finish_s is not None for r in records)  # every request ran to the end
    rt = [r for r in records if r.admission == "admitted"]
    assert sum(_met(r) for r in rt) >= 0.99 * len(rt)


def test_a_tenants_own_outcome_overrides_the_runs() -> None:
    """Two tenants in one overloaded stream, the run's outcome reject: the one whose contract
    says accept has its forecast misses run as RT, the other's are shed."""
    rt = [
        msgspec_replace(
            r,
            tenant_id="patient" if i % 2 else "strict",
            on_unattainable="accept" if i % 2 else None,
        )
        for i, r in enumerate(_rt_requests(400, 0.02, 2000, 4))
    ]
    config = SimConfig(kv_capacity_tokens=400_000)
    records = simulate(ListSource(rt), make_policy(latency_budget_s=0.05), LATENCY, config).requests
    outcomes = {
        tenant: {r.admission for r in records if r.tenant_id == tenant}
        for tenant in ("patient", "strict")
    }
    assert outcomes == {"patient": {"admitted", "accepted"}, "strict": {"admitted", "shed"}}


def test_accept_runs_everything_as_rt() -> None:
    records = _overload("accept")
    accepted = [r for r in records if r.admission == "accepted"]
    assert accepted and all(r.tier == "rt" for r in records)
    assert all(r.finish_s is not None for r in records)
    # without shedding, the late ones are late
    assert sum(_met(r) for r in accepted) < len(accepted)
