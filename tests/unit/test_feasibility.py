"""The SLO admission's forecast (backend/policy/feasibility.py) on hand-built engine states, and
the simulator's front door that applies it (each contract outcome)."""

from __future__ import annotations

from typing import Any

import pytest

from backend.policy.feasibility import Backlog, SloAsk, SloForecaster, load_of
from backend.sim.config import SimConfig, SloUnattainable
from backend.sim.engine import simulate
from backend.sim.records import RequestRecord
from backend.sim.source import ListSource
from common.wire import EngineLoad
from tests.unit.sim_factories import LATENCY, make_req, make_request, make_snapshot
from tests.unit.tandem_factories import make_policy

# LATENCY: 10 ms per iteration + 20 ms per 1K prefill tokens + 1 ms per 1K decode context.
FORECASTER = SloForecaster(LATENCY, iteration_budget_s=0.05, headroom=0.8)


def idle(**fields: Any) -> EngineLoad:
    """An engine state after its first iteration: empty unless *fields* say otherwise."""
    return EngineLoad(iteration=1, at_unix_s=0.0, **fields)


def test_an_idle_engine_meets_a_short_prompt() -> None:
    forecast = FORECASTER.forecast(idle(), SloAsk(prompt_tokens=1000, ttft_target_s=1.0))
    # one chunk of 1000 tokens: 10 ms + 20 ms
    assert forecast.ttft_s == pytest.approx(0.030)
    assert forecast.feasible


def test_rt_prompts_ahead_delay_the_first_token_and_the_excess_is_named() -> None:
    load = idle(num_rt_waiting=10, rt_waiting_prompt_tokens=20_000, iteration_s=0.05)
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


def test_a_slower_engine_turns_a_feasible_request_away() -> None:
    load = idle(num_rt_waiting=4, rt_waiting_prompt_tokens=8000)
    ask = SloAsk(prompt_tokens=2000, ttft_target_s=0.5)
    assert FORECASTER.forecast(load, ask).feasible  # 5 chunks of 50 ms
    slow = idle(num_rt_waiting=4, rt_waiting_prompt_tokens=8000, latency_factors=(3.0, 3.0, 3.0))
    assert not FORECASTER.forecast(slow, ask).feasible


def test_work_sent_but_not_yet_reported_counts_like_the_queue() -> None:
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5)
    queued = FORECASTER.forecast(idle(num_rt_waiting=8, rt_waiting_prompt_tokens=16_000), ask)
    in_flight = FORECASTER.forecast(idle(), ask, Backlog(num_requests=8, prompt_tokens=16_000))
    assert in_flight.ttft_s == pytest.approx(queued.ttft_s)
    assert not in_flight.feasible


def test_time_already_waited_counts_against_the_ttft_target() -> None:
    ask = SloAsk(prompt_tokens=1000, ttft_target_s=0.5, waited_s=0.45)
    forecast = FORECASTER.forecast(idle(), ask)
    assert forecast.ttft_s == pytest.approx(0.48)
    assert not forecast.feasible


def test_too_many_rt_decodes_miss_the_tpot_target() -> None:
    # 300 decodes of 1000 context: 10 ms + 300 ms per iteration
    load = idle(num_rt_running=299, rt_context_tokens=299_000)
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


def _overload(slo_unattainable: SloUnattainable) -> list[RequestRecord]:
    """8 s of 2000-token RT prompts at about twice what the engine can prefill in time."""
    rt = [
        make_request(
            tier="rt",
            prompt_len=2000,
            output_len=4,
            arrival_s=i * 0.02,
            ttft_target_s=0.5,
            tpot_target_s=0.2,
        )
        for i in range(400)
    ]
    result = simulate(
        ListSource(rt),
        make_policy(latency_budget_s=0.05),
        LATENCY,
        SimConfig(kv_capacity_tokens=400_000, slo_unattainable=slo_unattainable),
    )
    return result.requests


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


def test_accept_runs_everything_as_rt() -> None:
    records = _overload("accept")
    accepted = [r for r in records if r.admission == "accepted"]
    assert accepted and all(r.tier == "rt" for r in records)
    assert all(r.finish_s is not None for r in records)
    # without shedding, the late ones are late
    assert sum(_met(r) for r in accepted) < len(accepted)
