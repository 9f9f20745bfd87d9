"""The SLO admission on hand-built engine states: a request whose forecast meets its contract is
admitted as RT; one forecast to miss gets what its tenant's contract says (reject → 429
`slo_unattainable` naming the target and the excess, downgrade → the same request as BE,
accept → RT anyway); without engine state it is admitted unchecked. Every verdict is counted,
written to the usage record, and a downgrade is announced in a response header."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import msgspec
import pytest
from aiohttp import web

from backend.policy.feasibility import (
    Backlog,
    Shortfall,
    SloAsk,
    SloForecaster,
    TtftFeedback,
    TtftFeedbackByEngine,
)
from backend.policy.latency import LatencyModel, load_profile
from backend.policy.placement import CACHE_SHARE_CUT, CACHE_SHARE_STEP, SloAware, make_router
from backend.policy.profiles import resolve_profile
from common.config import Config, GatewayConfig
from common.wire import PRIORITY_RT, EngineLoad, TenantLoad, meta_from_custom_params
from gateway.engine.load import LoadWatcher
from gateway.metrics import GatewayMetrics
from gateway.pipeline.admission import (
    Admitted,
    Pending,
    Placer,
    SloCheck,
    admission_checks,
    decide_slo,
    slo_ask,
)
from gateway.pipeline.admission_log import RefusalLog
from gateway.pipeline.outcome import Refused
from gateway.pipeline.placement import EngineHandle, Placement, decide, place_request
from gateway.pipeline.slot_line import SlotLine
from gateway.pipeline.stages import (
    DOWNGRADED_HEADER,
    admit,
    admit_rechecking,
    place,
    prepare,
    record,
    response_headers,
    run,
)
from gateway.state import (
    CONFIG,
    ENGINE,
    LOADS,
    METRICS,
    QUOTAS,
    ROUTER,
    SLO_FORECASTER,
    SLOT_LINE,
    TTFT_FEEDBACK,
)
from gateway.store.types import Quota
from tests.unit.pipeline_factories import (
    FakeEngine,
    chat_body,
    chunk,
    make_app,
    make_flight,
    make_principal,
    make_prompt,
    make_request,
    make_tenant,
    replies,
    usage_of,
)

NOW_S = 1_000_000.0
IDLE = EngineLoad(iteration=10, at_unix_s=NOW_S - 0.01)
"""An engine with nothing to do: any modest contract holds."""
SWAMPED = EngineLoad(
    iteration=10,
    at_unix_s=NOW_S - 0.01,
    iteration_s=0.05,
    num_rt_waiting=20,
    rt_waiting_prompt_tokens=40_000,
    num_rt_running=30,
    rt_context_tokens=30_000,
)
"""40k RT prompt tokens queued ahead: a 300 ms TTFT cannot hold (the model says ~0.8 s)."""


@pytest.fixture(scope="module")
def forecaster() -> SloForecaster:
    profile = load_profile(resolve_profile("h100-llama8b-analytic"))
    return SloForecaster(LatencyModel.fit(profile.samples))


def rt_tenant(on_unattainable: str = "reject", **slo: Any) -> Any:
    contract = {"ttft_target_ms": 300, "tpot_target_ms": 50, **slo}
    return make_tenant("rt", on_unattainable=on_unattainable, **contract)


def ask(ttft_target_s: float = 0.3, tpot_target_s: float | None = 0.05) -> SloAsk:
    return SloAsk(prompt_tokens=10, ttft_target_s=ttft_target_s, tpot_target_s=tpot_target_s)


def watched(load: EngineLoad | None) -> LoadWatcher:
    watcher = LoadWatcher("engine")
    watcher.latest = load
    return watcher


def handle(watcher: LoadWatcher | None, name: str = "engine") -> EngineHandle:
    return EngineHandle(name=name, client=FakeEngine(replies()), load=watcher)  # type: ignore[arg-type]


def on_engine(watcher: LoadWatcher | None) -> Placer:
    """A placer with one engine, watched by *watcher* (None: it reports no state)."""
    return lambda request, ask, now: Placement(engine=handle(watcher))


def check(forecaster: SloForecaster, load: EngineLoad | None) -> tuple[SloCheck, GatewayMetrics]:
    metrics = GatewayMetrics()
    return SloCheck(forecaster, on_engine(watched(load)), metrics, clock=lambda: NOW_S), metrics


def watcher_of(slo_check: SloCheck) -> LoadWatcher:
    """The watcher of the one engine a `check` judges on."""
    placement = slo_check.place(None, None, NOW_S)  # type: ignore[arg-type]
    assert placement is not None and placement.engine.load is not None
    return placement.engine.load


def candidate(tenant: Any, tier: str = "rt", prompt_len: int = 10) -> Admitted:
    request = make_request(make_principal(tenant), prompt_len=prompt_len, tier=tier)
    return Admitted(tenant=tenant, origin="api", request=request)


def counted(metrics: GatewayMetrics, outcome: str, target: str) -> float:
    value = metrics.registry.get_sample_value(
        "tandem_slo_admissions_total",
        {"tenant": "ten_rt", "outcome": outcome, "target": target},
    )
    return value or 0.0


# ---------------------------------------------------------------------------------- the decision


def test_a_contract_the_forecast_meets_is_admitted(forecaster: SloForecaster) -> None:
    decision = decide_slo(forecaster, rt_tenant().slo, ask(), IDLE, Backlog())
    assert decision.outcome == "admitted" and decision.shortfall is None


@pytest.mark.parametrize(
    ("on_unattainable", "outcome"),
    [("reject", "shed"), ("downgrade", "downgraded"), ("accept", "accepted")],
)
def test_a_contract_forecast_to_miss_gets_what_the_tenant_chose(
    forecaster: SloForecaster, on_unattainable: str, outcome: str
) -> None:
    decision = decide_slo(forecaster, rt_tenant(on_unattainable).slo, ask(), SWAMPED, Backlog())
    assert decision.outcome == outcome
    assert decision.shortfall is not None and decision.shortfall.target == "ttft"
    assert decision.shortfall.predicted_s > 0.3


def test_the_backlog_sent_since_the_last_state_counts(forecaster: SloForecaster) -> None:
    contract = rt_tenant().slo
    assert decide_slo(forecaster, contract, ask(), IDLE, Backlog()).outcome == "admitted"
    backlog = Backlog(num_requests=20, prompt_tokens=40_000)
    assert decide_slo(forecaster, contract, ask(), IDLE, backlog).outcome == "shed"


def test_a_tpot_the_running_rt_decodes_cannot_keep_is_named(forecaster: SloForecaster) -> None:
    crowded = EngineLoad(
        iteration=1, at_unix_s=NOW_S, num_rt_running=400, rt_context_tokens=2_000_000
    )
    decision = decide_slo(
        forecaster,
        rt_tenant().slo,
        ask(ttft_target_s=1000.0, tpot_target_s=0.001),
        crowded,
        Backlog(),
    )
    assert decision.outcome == "shed" and decision.target == "tpot"


def test_without_engine_state_or_model_a_request_is_admitted_unchecked(
    forecaster: SloForecaster,
) -> None:
    contract = rt_tenant().slo
    assert decide_slo(forecaster, contract, ask(), None, Backlog()).outcome == "unchecked"
    assert decide_slo(None, contract, ask(), SWAMPED, Backlog()).outcome == "unchecked"


def test_the_ask_counts_the_time_already_waited() -> None:
    request = make_request(make_principal(rt_tenant()), prompt_len=7)
    got = slo_ask(request, request.meta.arrival_unix_s + 0.25)
    assert got is not None
    assert (got.prompt_tokens, got.ttft_target_s, got.tpot_target_s) == (7, 0.3, 0.05)
    assert got.waited_s == pytest.approx(0.25)
    assert (got.tenant_id, got.weight) == ("ten_rt", 1.0)
    heavy = make_request(make_principal(rt_tenant(weight=3.0)), prompt_len=7)
    got = slo_ask(heavy, NOW_S)
    assert got is not None and (got.tenant_id, got.weight) == ("ten_rt", 3.0)
    be = make_request(make_principal(make_tenant("be")), tier="be")
    assert slo_ask(be, NOW_S) is None  # BE has no contract to forecast


# ---------------------------------------------------------------------------------- the check


def test_reject_is_a_429_naming_the_target_and_the_excess_with_retry_after(
    forecaster: SloForecaster,
) -> None:
    slo_check, metrics = check(forecaster, SWAMPED)
    outcome = slo_check(candidate(rt_tenant("reject")))
    assert isinstance(outcome, Refused)
    assert (outcome.http_status, outcome.code, outcome.kind) == (
        429,
        "slo_unattainable",
        "slo_unattainable",
    )
    assert outcome.retryable and outcome.retry_after_s is not None and outcome.retry_after_s >= 1
    assert "time to first token target of 300 ms" in outcome.message
    assert "ms over" in outcome.message
    error = outcome.api_error()
    assert error.headers == {"Retry-After": str(outcome.retry_after_s)}
    assert counted(metrics, "shed", "ttft") == 1


def test_downgrade_runs_the_same_request_as_be(forecaster: SloForecaster) -> None:
    slo_check, metrics = check(forecaster, SWAMPED)
    given = candidate(rt_tenant("downgrade", deadline_s=60.0))
    outcome = slo_check(given)
    assert isinstance(outcome, Admitted) and outcome.slo is not None
    assert outcome.slo.outcome == "downgraded" and outcome.slo.target == "ttft"
    request = outcome.request
    assert request.rid == given.request.rid and request.input_ids == given.request.input_ids
    assert request.meta.tier == "be" and request.meta.ttft_target_ms is None
    assert request.meta.deadline_s == 60.0
    assert request.payload["priority"] != PRIORITY_RT
    sent = meta_from_custom_params(request.payload["sampling_params"]["custom_params"])
    assert sent == request.meta  # the engine sees the BE terms
    assert counted(metrics, "downgraded", "ttft") == 1
    assert watcher_of(slo_check).backlog(NOW_S) == Backlog()  # not RT
    assert outcome.placement is None  # placed again, as BE


def test_accept_runs_it_as_rt_and_counts_it_as_sent(forecaster: SloForecaster) -> None:
    slo_check, metrics = check(forecaster, SWAMPED)
    outcome = slo_check(candidate(rt_tenant("accept"), prompt_len=12))
    assert isinstance(outcome, Admitted) and outcome.slo is not None
    assert outcome.slo.outcome == "accepted" and outcome.request.meta.tier == "rt"
    assert counted(metrics, "accepted", "ttft") == 1
    assert watcher_of(slo_check).backlog(NOW_S) == Backlog(
        num_requests=1,
        prompt_tokens=12,
        by_tenant=(
            TenantLoad(tenant_id="ten_rt", weight=1.0, num_waiting=1, waiting_prompt_tokens=12),
        ),
    )


def test_an_admitted_request_joins_the_backlog_of_the_next_forecast(
    forecaster: SloForecaster,
) -> None:
    slo_check, metrics = check(forecaster, IDLE)
    tenant = rt_tenant(ttft_target_ms=1000)  # one 30k-token prompt fits (~0.6 s), two do not
    outcome = slo_check(candidate(tenant, prompt_len=30_000))
    assert isinstance(outcome, Admitted) and outcome.slo is not None
    assert outcome.slo.outcome == "admitted"
    # the engine has not reported it yet, but the next forecast knows it is ahead
    second = slo_check(candidate(tenant, prompt_len=30_000))
    assert isinstance(second, Refused) and second.code == "slo_unattainable"
    assert counted(metrics, "admitted", "") == 1 and counted(metrics, "shed", "ttft") == 1


def test_the_check_forecasts_for_the_requests_tenant(forecaster: SloForecaster) -> None:
    # another tenant has 40k prompt tokens queued (SWAMPED's queue, all of it one tenant's)
    burst = msgspec.structs.replace(
        SWAMPED,
        rt_by_tenant=(
            TenantLoad(
                tenant_id="ten_burst", weight=1.0, num_waiting=20, waiting_prompt_tokens=40_000
            ),
        ),
    )
    slo_check, metrics = check(forecaster, burst)
    outcome = slo_check(candidate(rt_tenant("reject")))  # ten_rt: under its share
    assert isinstance(outcome, Admitted) and outcome.slo is not None
    assert outcome.slo.outcome == "admitted"
    # the same request of the tenant that queued all of it waits behind its own queue
    over = msgspec.structs.replace(rt_tenant("reject"), id="ten_burst")
    refused = slo_check(candidate(over))
    assert isinstance(refused, Refused) and refused.code == "slo_unattainable"
    assert counted(metrics, "admitted", "") == 1


def test_be_requests_are_not_judged(forecaster: SloForecaster) -> None:
    slo_check, metrics = check(forecaster, SWAMPED)
    given = candidate(make_tenant("be"), tier="be")
    assert slo_check(given) is given
    assert b"tandem_slo_admissions_total{" not in metrics.render()


def test_no_watcher_admits_unchecked(forecaster: SloForecaster) -> None:
    metrics = GatewayMetrics()
    outcome = SloCheck(forecaster, on_engine(None), metrics)(candidate(rt_tenant()))
    assert isinstance(outcome, Admitted) and outcome.slo is not None
    assert outcome.slo.outcome == "unchecked" and counted(metrics, "unchecked", "") == 1


def test_the_app_judges_on_the_engine_its_router_places_on(forecaster: SloForecaster) -> None:
    app = make_app(FakeEngine(replies()))
    request = make_request(make_principal(rt_tenant()))
    rt = slo_ask(request, NOW_S)
    assert rt is not None
    placement = place_request(app, request, rt, NOW_S)
    assert placement is not None and placement.engine.load is None  # no state watched
    mine = LoadWatcher(FakeEngine.base_url)
    app[LOADS] = {"other": LoadWatcher("other"), FakeEngine.base_url: mine}
    placement = place_request(app, request, rt, NOW_S)
    assert placement is not None and placement.engine.load is mine


def pool_check(
    forecaster: SloForecaster,
    router: Any,
    loads: dict[str, EngineLoad],
    feedback: TtftFeedbackByEngine | None = None,
) -> tuple[SloCheck, GatewayMetrics]:
    """An SLO check over a pool of engines in states *loads* (by name), placing with *router*."""
    handles = [handle(watched(load), name) for name, load in loads.items()]

    def place(request: Any, ask: SloAsk, now: float) -> Placement:
        return decide(request, handles, router, ask, now, feedback)

    metrics = GatewayMetrics()
    return SloCheck(forecaster, place, metrics, clock=lambda: NOW_S, feedback=feedback), metrics


def test_in_a_pool_each_request_is_judged_on_the_engine_it_is_placed_on(
    forecaster: SloForecaster,
) -> None:
    # round-robin places every other request on the swamped engine: those are judged there
    # (and shed), not on the idle one that the pool also has
    loads = {"idle": IDLE, "swamped": SWAMPED}
    slo_check, metrics = pool_check(forecaster, make_router("round-robin"), loads)
    first, second = (slo_check(candidate(rt_tenant("reject"))) for _ in range(2))
    assert isinstance(first, Admitted) and first.placement is not None
    assert first.placement.engine.name == "idle" and first.slo is not None
    assert first.slo.engine == "idle"
    assert isinstance(second, Refused) and second.code == "slo_unattainable"
    # the slo router places each where the forecast has the most slack: both are admitted there
    slo_check, metrics = pool_check(forecaster, make_router("slo", forecaster), loads)
    outcomes = [slo_check(candidate(rt_tenant("reject"))) for _ in range(2)]
    assert all(isinstance(o, Admitted) and o.placement is not None for o in outcomes)
    assert {
        o.placement.engine.name for o in outcomes if isinstance(o, Admitted) and o.placement
    } == {"idle"}
    assert counted(metrics, "admitted", "") == 2


def test_late_first_tokens_on_one_engine_make_only_that_engine_stricter(
    forecaster: SloForecaster,
) -> None:
    # requests on "slow" got their first token a second later than forecast (a neighbour took
    # its host's CPU); "fast" served as forecast. Both report an idle engine.
    feedback = TtftFeedbackByEngine(lambda: TtftFeedback(decay_s=1e9))
    feedback.of("slow").observe(0.01, 1.0, NOW_S)
    feedback.of("fast").observe(0.01, 0.01, NOW_S)
    loads = {"slow": IDLE, "fast": IDLE}
    slo_check, _ = pool_check(forecaster, make_router("round-robin"), loads, feedback)
    on_slow, on_fast = (slo_check(candidate(rt_tenant("reject"))) for _ in range(2))
    assert isinstance(on_slow, Refused) and "time to first token" in on_slow.message
    assert isinstance(on_fast, Admitted) and on_fast.slo is not None
    assert on_fast.slo.outcome == "admitted"
    # the slo router sends them all to the engine whose outcomes were as forecast
    slo_check, metrics = pool_check(forecaster, make_router("slo", forecaster), loads, feedback)
    for _ in range(3):
        outcome = slo_check(candidate(rt_tenant("reject")))
        assert isinstance(outcome, Admitted) and outcome.placement is not None
        assert outcome.placement.engine.name == "fast"
    taught = metrics.registry.get_sample_value(
        "tandem_slo_ttft_feedback_seconds", {"engine": "fast"}
    )
    assert taught == 0.0


# ---------------------------------------------------------------------------------- the stages


def staged_app(forecaster: SloForecaster, load: EngineLoad | None) -> web.Application:
    app = make_app(FakeEngine(replies()))
    app[SLO_FORECASTER] = forecaster
    app[LOADS] = {FakeEngine.base_url: watched(load)}
    return app


@pytest.mark.parametrize(
    ("on_unattainable", "admission", "tier", "status"),
    [
        ("reject", "shed", "rt", "slo_unattainable"),
        ("downgrade", "downgraded", "be", "client_disconnected"),
        ("accept", "accepted", "rt", "client_disconnected"),
    ],
)
def test_the_usage_record_says_how_admission_treated_it(
    forecaster: SloForecaster, on_unattainable: str, admission: str, tier: str, status: str
) -> None:
    app = staged_app(forecaster, SWAMPED)
    flight = make_flight(make_principal(rt_tenant(on_unattainable)))
    prepare(app, flight, chat_body(), make_prompt())
    admit(app, flight)
    record(app, flight, cancelled=True)  # the run is not what these tests are about
    (usage,) = usage_of(app).records
    assert (usage.admission, usage.tier, usage.status) == (admission, tier, status)
    if admission == "shed":
        assert usage.http_status == 429 and usage.slo_met is None
    headers = response_headers(app, flight)
    assert headers == ({DOWNGRADED_HEADER: "ttft"} if admission == "downgraded" else {})


def test_a_request_admitted_without_a_miss_records_admitted(forecaster: SloForecaster) -> None:
    app = staged_app(forecaster, IDLE)
    flight = make_flight(make_principal(rt_tenant()))
    prepare(app, flight, chat_body(), make_prompt())
    assert isinstance(admit(app, flight), Admitted)
    record(app, flight, cancelled=True)
    assert usage_of(app).records[0].admission == "admitted"


def test_the_place_stage_runs_a_request_where_it_was_judged(forecaster: SloForecaster) -> None:
    app = staged_app(forecaster, IDLE)
    flight = make_flight(make_principal(rt_tenant()))
    prepare(app, flight, chat_body(), make_prompt())
    admitted = admit(app, flight)
    assert isinstance(admitted, Admitted) and admitted.placement is not None
    assert place(app, flight) is admitted.placement
    # failing over (its engine would not take it) places it elsewhere or nowhere, never there
    assert place(app, flight, avoid=FakeEngine.base_url) is None


def test_first_tokens_later_than_forecast_teach_the_admission_to_shed(
    forecaster: SloForecaster,
) -> None:
    # the engine's state says idle (7 ms to a first token), but every admitted request's first
    # token comes 1 s after its arrival (time outside the engine model: a host CPU taken by
    # another process); the contract's TTFT is 300 ms
    app = staged_app(forecaster, IDLE)
    app[TTFT_FEEDBACK] = feedbacks = TtftFeedbackByEngine(lambda: TtftFeedback(decay_s=1e9))
    feedback = feedbacks.of(FakeEngine.base_url)
    outcomes = []
    for _ in range(4):
        flight = make_flight(make_principal(rt_tenant()))
        prepare(app, flight, chat_body(), make_prompt())
        outcome = admit(app, flight)
        outcomes.append("shed" if isinstance(outcome, Refused) else "admitted")
        if not isinstance(outcome, Refused):
            flight.timer.start_s -= 1.0
            flight.timer.on_tokens(1)
        record(app, flight, cancelled=True)
    assert outcomes == ["admitted", "shed", "shed", "shed"]  # one miss is enough
    assert feedback.samples == 1  # only admitted ones teach
    assert feedback.extra_s(0.0) > 0.4
    gauge = app[METRICS].registry.get_sample_value(
        "tandem_slo_ttft_feedback_seconds", {"engine": FakeEngine.base_url}
    )
    assert gauge is not None and gauge > 0.4  # operators see the admission grow stricter
    labels = {"engine": FakeEngine.base_url}
    registry = app[METRICS].registry
    errors = registry.get_sample_value("tandem_slo_ttft_forecast_error_seconds_count", labels)
    assert errors == 1  # the one admitted: how far its first token came after its forecast

    def within(le: str) -> float | None:
        bucket = "tandem_slo_ttft_forecast_error_seconds_bucket"
        return registry.get_sample_value(bucket, {**labels, "le": le})

    assert (within("0.5"), within("1.0")) == (0, 1)  # about 1 s late


async def _admitted_and_run(app: web.Application, at_first_token: EngineLoad) -> Any:
    """One slot-bound RT request admitted and run to its end, the engine's report at its first
    token *at_first_token*; its admission's verdict."""
    flight = make_flight(make_principal(rt_tenant(ttft_target_ms=2000, tpot_target_ms=200)))
    prepare(app, flight, chat_body(), make_prompt())
    admitted = admit(app, flight)
    assert isinstance(admitted, Admitted) and admitted.slo is not None
    assert admitted.slo.slot_wait_s > 0.5 * (admitted.slo.forecast_ttft_s or 0.0)
    assert place(app, flight) is not None
    app[LOADS][FakeEngine.base_url].latest = at_first_token
    async for _ in run(app, flight):
        pass
    assert flight.first_token_load is at_first_token
    record(app, flight, cancelled=False)
    return admitted.slo


async def test_an_engine_running_faster_than_a_slot_waits_forecast_pace_teaches_its_scale(
    forecaster: SloForecaster,
) -> None:
    """Admitted requests whose forecast was mostly a wait for a request slot (every slot RT's,
    the first to free 100 steps away). When the engine's reports at their first tokens show its
    iterations ran at a fifth of the forecast step meanwhile, that teaches the engine's
    slot-wait scale, down to its floor; when they show the forecast pace, nothing is cut, however
    soon the slot came (fewer steps than the quantile forecast are its margin, not its error)."""
    for pace, scale in ((0.2, "floor"), (1.0, 1.0)):
        now_s = time.time()
        load = slot_bound(now_s, 100)
        app = staged_app(forecaster, load)
        app[ENGINE] = FakeEngine(replies(chunk("a", 1), chunk("b", 2, finish="length")))
        app[TTFT_FEEDBACK] = feedbacks = TtftFeedbackByEngine(lambda: TtftFeedback(decay_s=1e9))
        for _ in range(4):
            app[LOADS][FakeEngine.base_url].latest = load
            slo = await _admitted_and_run(app, load)  # no iteration since: too few to tell
        feedback = feedbacks.of(FakeEngine.base_url)
        assert feedback.slot_wait_scale(time.time()) == 1.0
        for _ in range(4):
            app[LOADS][FakeEngine.base_url].latest = load
            ten_steps = msgspec.structs.replace(
                load,
                iteration=load.iteration + 10,
                at_unix_s=load.at_unix_s + 10 * pace * slo.slot_step_s,
            )
            slo = await _admitted_and_run(app, ten_steps)
        expected = feedback.slot_wait_floor if scale == "floor" else scale
        assert feedback.slot_wait_scale(time.time()) == pytest.approx(expected)


def test_a_cache_claim_the_engine_did_not_hold_shrinks_the_prefix_memory_not_the_forecast(
    forecaster: SloForecaster,
) -> None:
    # The router forecast a turn with 2,000 tokens of history cached, but the engine had
    # evicted it and computed the whole prompt: its late first token says nothing about the
    # engine's pace (TtftFeedback is not taught), and the router's prefix memory shrinks.
    app = staged_app(forecaster, IDLE)
    app[ROUTER] = router = SloAware(forecaster)
    app[TTFT_FEEDBACK] = feedbacks = TtftFeedbackByEngine(lambda: TtftFeedback(decay_s=1e9))
    feedback = feedbacks.of(FakeEngine.base_url)

    def turn(engine_cached_tokens: int) -> None:
        flight = make_flight(make_principal(rt_tenant()))
        prepare(app, flight, chat_body(), make_prompt())
        assert not isinstance(admit(app, flight), Refused)
        placement = place(app, flight)
        assert placement is not None
        flight.placement = msgspec.structs.replace(placement, cached_tokens=2000)
        flight.timer.start_s -= 1.0  # a second late
        flight.timer.on_tokens(1)
        flight.progress.completion_tokens = 1
        flight.progress.cached_tokens = engine_cached_tokens
        flight.progress.finish_reason = "length"  # ended: nothing to abort
        record(app, flight, cancelled=True)

    turn(engine_cached_tokens=0)
    assert router.cache_share == pytest.approx(CACHE_SHARE_CUT)
    assert feedback.samples == 0
    turn(engine_cached_tokens=2000)  # held: the lateness is the engine's, and it teaches
    assert router.cache_share == pytest.approx(CACHE_SHARE_CUT + CACHE_SHARE_STEP)
    assert feedback.samples == 1


def test_an_admitted_request_that_misses_is_logged_with_its_forecast_and_the_engine_state(
    forecaster: SloForecaster, caplog: pytest.LogCaptureFixture
) -> None:
    # an operator asking why an admitted request missed reads one line: what the forecast said,
    # what came, and the engine's state it was made on
    busy = msgspec.structs.replace(IDLE, num_rt_running=3, rt_context_tokens=900)
    app = staged_app(forecaster, busy)
    flight = make_flight(make_principal(rt_tenant()))
    prepare(app, flight, chat_body(), make_prompt())
    assert isinstance(admit(app, flight), Admitted)
    flight.timer.start_s -= 1.0  # its first token comes a second after it arrived
    flight.timer.on_tokens(1)
    with caplog.at_level("INFO", logger="gateway.pipeline.stages"):
        record(app, flight, cancelled=False)
    (usage,) = usage_of(app).records
    assert usage.slo_met is False
    (line,) = [r.getMessage() for r in caplog.records if "missed its contract" in r.getMessage()]
    assert usage.request_id in line
    assert "target 300 ms" in line and "forecast" in line
    assert "3 RT decoding (900 context tokens)" in line


def test_an_admitted_request_that_meets_its_contract_is_not_logged(
    forecaster: SloForecaster, caplog: pytest.LogCaptureFixture
) -> None:
    app = staged_app(forecaster, IDLE)
    flight = make_flight(make_principal(rt_tenant()))
    prepare(app, flight, chat_body(), make_prompt())
    assert isinstance(admit(app, flight), Admitted)
    flight.timer.on_tokens(1)
    with caplog.at_level("INFO", logger="gateway.pipeline.stages"):
        record(app, flight, cancelled=False)
    assert usage_of(app).records[0].slo_met is True
    assert not [r for r in caplog.records if "missed its contract" in r.getMessage()]


# ---------------------------------------------------------------------------------- rechecks


def slot_bound(now_unix_s: float, steps_to_first_free: int, iteration: int = 10) -> EngineLoad:
    """64 request slots, every one held by an RT decode; the first to finish has
    *steps_to_first_free* decode steps left (the others one step more each)."""
    return EngineLoad(
        iteration=iteration,
        at_unix_s=now_unix_s,
        iteration_s=0.01,
        max_running_requests=64,
        num_rt_running=64,
        rt_context_tokens=64 * 300,
        rt_decode_steps_left=tuple(steps_to_first_free + i for i in range(64)),
    )


def freed(now_unix_s: float, iteration: int = 11) -> EngineLoad:
    """The engine a step later: one of the 64 RT decodes finished, its slot is free."""
    return msgspec.structs.replace(
        slot_bound(now_unix_s, 1, iteration),
        num_rt_running=63,
        rt_decode_steps_left=tuple(range(1, 64)),
    )


def rechecking_app(forecaster: SloForecaster, load: EngineLoad, frac: float) -> web.Application:
    app = staged_app(forecaster, load)
    app[CONFIG] = Config(gateway=GatewayConfig(slo_recheck_frac=frac))
    return app


def rechecks(metrics: GatewayMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "tandem_slo_rechecks_total", {"tenant": "ten_rt", "outcome": outcome}
    )
    return value or 0.0


def test_a_miss_only_for_a_request_slot_is_pending_when_rechecking(
    forecaster: SloForecaster,
) -> None:
    """Every slot RT's, the first to free 400 steps away: over a 2 s TTFT. Judged once it is
    refused; rechecking it is pending (nothing counted) — the slots free one at a time, and
    the next report may show one free."""
    load = slot_bound(NOW_S, 400)
    metrics = GatewayMetrics()
    tenant = rt_tenant(ttft_target_ms=2000, tpot_target_ms=200)
    once = SloCheck(forecaster, on_engine(watched(load)), metrics, clock=lambda: NOW_S)
    refused = once(candidate(tenant))
    assert isinstance(refused, Refused) and "request slots" in refused.message
    pending = replace(once, recheck=True)(candidate(tenant))
    assert isinstance(pending, Pending) and pending.shortfall.slot_wait_s > 0.0
    assert counted(metrics, "shed", "ttft") == 1.0  # the final verdict only
    # a miss for the prompt work queued ahead (slots to spare) is answered at once
    swamped = SloCheck(forecaster, on_engine(watched(SWAMPED)), metrics, clock=lambda: NOW_S)
    assert isinstance(replace(swamped, recheck=True)(candidate(rt_tenant())), Refused)


def one_request_a_minute() -> Any:
    """An RT tenant (2 s TTFT) whose quota admits one request a minute, one at a time."""
    quota = Quota(requests_per_min=1, max_concurrent=1)
    return make_tenant("rt", quota=quota, ttft_target_ms=2000, tpot_target_ms=200)


async def pending(app: web.Application, flight: Any) -> asyncio.Task[Any]:
    """admit_rechecking under way, once it waits for the engine's next report."""
    admitting = asyncio.create_task(admit_rechecking(app, flight))
    while flight.slo_rechecks == 0:
        assert not admitting.done(), admitting.result()
        await asyncio.sleep(0)  # yield: the task runs to its wait
    return admitting


async def test_a_pending_request_is_admitted_once_a_report_shows_a_free_slot(
    forecaster: SloForecaster,
) -> None:
    """...and its quota is taken once, however many times the SLO check judges it (the tenant
    may send one request a minute: taken twice, the second judgement would be a 429)."""
    now = time.time()
    app = rechecking_app(forecaster, slot_bound(now, 400), frac=0.9)
    flight = make_flight(make_principal(one_request_a_minute()))
    prepare(app, flight, chat_body(), make_prompt())
    admitting = await pending(app, flight)
    watcher = app[LOADS][FakeEngine.base_url]
    watcher.update(slot_bound(time.time(), 390, iteration=11))  # still every slot RT's
    while flight.slo_rechecks < 2:
        assert not admitting.done(), admitting.result()
        await asyncio.sleep(0)  # yield: the task runs to its wait
    watcher.update(freed(time.time(), iteration=12))
    admitted = await admitting
    assert isinstance(admitted, Admitted) and flight.admission == "admitted"
    assert len(admitted.holds) == 1 and app[QUOTAS].in_flight() == {"ten_rt": 1}
    metrics = app[METRICS]
    assert rechecks(metrics, "admitted") == 1.0
    assert counted(metrics, "admitted", "") == 1.0 and counted(metrics, "shed", "ttft") == 0.0


async def test_a_pending_request_cancelled_gives_its_quota_back(
    forecaster: SloForecaster,
) -> None:
    app = rechecking_app(forecaster, slot_bound(time.time(), 400), frac=0.9)
    flight = make_flight(make_principal(one_request_a_minute()))
    prepare(app, flight, chat_body(), make_prompt())
    admitting = await pending(app, flight)
    assert app[QUOTAS].in_flight() == {"ten_rt": 1}  # held while it waits
    admitting.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await admitting
    assert app[QUOTAS].in_flight() == {}


async def test_a_pending_request_gets_its_contracts_answer_when_its_recheck_time_is_up(
    forecaster: SloForecaster,
) -> None:
    now = time.time()
    app = rechecking_app(forecaster, slot_bound(now, 400), frac=0.05)  # 100 ms of 2 s
    flight = make_flight(make_principal(rt_tenant(ttft_target_ms=2000, tpot_target_ms=200)))
    prepare(app, flight, chat_body(), make_prompt())
    refused = await admit_rechecking(app, flight)  # no report comes
    assert isinstance(refused, Refused) and refused.code == "slo_unattainable"
    assert flight.slo_rechecks >= 1 and flight.admission == "shed"
    metrics = app[METRICS]
    assert rechecks(metrics, "shed") == 1.0 and counted(metrics, "shed", "ttft") == 1.0


async def test_a_miss_for_the_work_queued_ahead_is_answered_without_waiting(
    forecaster: SloForecaster,
) -> None:
    app = rechecking_app(forecaster, SWAMPED, frac=0.9)
    flight = make_flight(make_principal(rt_tenant()))
    prepare(app, flight, chat_body(), make_prompt())
    refused = await admit_rechecking(app, flight)
    assert isinstance(refused, Refused) and flight.slo_rechecks == 0
    assert rechecks(app[METRICS], "shed") == 0.0


def lined_app(forecaster: SloForecaster, load: EngineLoad) -> web.Application:
    """A rechecking app (90 % of a TTFT target) whose kept requests form a `SlotLine`."""
    app = rechecking_app(forecaster, load, frac=0.9)
    app[SLOT_LINE] = SlotLine()
    return app


def rt_flight(app: web.Application, ttft_target_ms: int) -> Any:
    """An RT request prepared now, of a tenant with *ttft_target_ms* (TPOT 200 ms)."""
    tenant = rt_tenant(ttft_target_ms=ttft_target_ms, tpot_target_ms=200)
    flight = make_flight(make_principal(tenant))
    prepare(app, flight, chat_body(), make_prompt())
    return flight


async def test_a_request_kept_for_a_slot_goes_before_a_later_arrival(
    forecaster: SloForecaster,
) -> None:
    """Every slot RT's, the first to free 150 decode steps away (~1.3 s): a request with a 1 s
    TTFT is kept for a slot; one arriving after it with a 2 s TTFT would meet its contract
    after the same wait. Judged on its own it would be sent at once and take the slot the first
    waits for (in a crunch the later arrivals got in and the earlier were refused); it waits
    behind it instead, and when a slot frees the first gets it, the second the one after."""
    app = lined_app(forecaster, slot_bound(time.time(), 150))
    first = rt_flight(app, 1000)
    first_admitting = await pending(app, first)
    later = rt_flight(app, 2000)
    later_admitting = await pending(app, later)
    assert len(app[SLOT_LINE]) == 2
    app[LOADS][FakeEngine.base_url].update(freed(time.time()))
    admitted = await first_admitting, await later_admitting
    assert all(isinstance(a, Admitted) for a in admitted)
    assert (first.admission, later.admission) == ("admitted", "admitted")
    first_slo, later_slo = (a.slo for a in admitted if isinstance(a, Admitted))
    assert first_slo is not None and later_slo is not None
    assert first_slo.slot_wait_s == 0.0  # the free slot is the first one's
    assert later_slo.slot_wait_s > 0.0  # and the later one waits for the next
    assert len(app[SLOT_LINE]) == 0


async def test_without_the_line_a_later_arrival_takes_the_slot_an_earlier_waits_for(
    forecaster: SloForecaster,
) -> None:
    """The same two requests with the line off (`TandemConfig.slo_slot_line`): the later one is
    admitted at once, ahead of the one kept."""
    app = rechecking_app(forecaster, slot_bound(time.time(), 150), frac=0.9)
    first = rt_flight(app, 1000)
    first_admitting = await pending(app, first)
    later = rt_flight(app, 2000)
    admitted = await admit_rechecking(app, later)
    assert isinstance(admitted, Admitted) and later.slo_rechecks == 0
    assert not first_admitting.done()
    first_admitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first_admitting


async def test_the_line_holds_only_what_would_wait_for_a_slot_and_lets_go_of_the_gone(
    forecaster: SloForecaster,
) -> None:
    """A later request that needs no slot (one is free for it) is not held by the line; a
    request that leaves while kept (its client went away) leaves the line."""
    app = lined_app(forecaster, slot_bound(time.time(), 150))
    first = rt_flight(app, 1000)
    first_admitting = await pending(app, first)
    line = app[SLOT_LINE]
    slo_check = admission_checks(app, recheck=True)[1]
    assert isinstance(slo_check, SloCheck) and slo_check.line is line
    flight = rt_flight(app, 2000)  # arrived after the first
    assert flight.request is not None
    later = Admitted(tenant=flight.principal.tenant, origin="api", request=flight.request)
    assert isinstance(slo_check(later), Pending)
    watcher = app[LOADS][FakeEngine.base_url]
    watcher.latest = msgspec.structs.replace(freed(time.time()), num_rt_running=50)  # 14 free
    assert isinstance(slo_check(later), Admitted)
    first_admitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first_admitting
    assert len(line) == 0


def test_slot_waits_whose_steps_ran_faster_than_forecast_teach_the_admission(
    forecaster: SloForecaster,
) -> None:
    """Four admitted requests on this engine whose slot waits' steps ran at half the forecast
    pace: a request whose 1 s TTFT the forecast missed for its slot wait alone is admitted,
    judged on the wait scaled by what they taught; another engine learned nothing from them."""
    feedback = TtftFeedbackByEngine()
    for _ in range(4):
        feedback.of("engine").observe(
            1.0, 0.55, NOW_S, slot_wait_s=0.9, slot_step_s=0.01, iteration_s=0.005
        )
    load = slot_bound(NOW_S, 150)
    metrics = GatewayMetrics()
    tenant = rt_tenant(ttft_target_ms=1000, tpot_target_ms=200)
    taught = SloCheck(
        forecaster, on_engine(watched(load)), metrics, clock=lambda: NOW_S, feedback=feedback
    )
    admitted = taught(candidate(tenant))
    assert isinstance(admitted, Admitted) and admitted.slo is not None
    assert admitted.slo.slot_wait_scale == pytest.approx(0.5)
    gauge = metrics.registry.get_sample_value("tandem_slo_slot_wait_scale", {"engine": "engine"})
    assert gauge == pytest.approx(0.5)  # operators see what the admission learned
    assert feedback.slot_wait_scale("other", NOW_S) == 1.0
    untaught = replace(taught, feedback=TtftFeedbackByEngine())
    assert isinstance(untaught(candidate(tenant)), Refused)


def test_the_slot_line_orders_by_arrival_per_engine() -> None:
    line = SlotLine()
    line.join("a", "e1", 10.0)
    line.join("b", "e1", 11.0)
    line.join("c", "e2", 9.0)
    assert line.ahead("b", "e1", 11.0) == 1  # a; c waits for another engine
    assert line.ahead("a", "e1", 10.0) == 0  # b came later
    assert line.ahead("x", "e1", 12.0) == 2
    assert line.ahead("x", "e1", 10.0) == 1  # equal arrivals: by rid ("a" < "x")
    line.join("a", "e2", 10.0)  # judged on another engine this time: that engine's line
    assert line.ahead("x", "e1", 12.0) == 1 and line.ahead("x", "e2", 12.0) == 2
    line.leave("a")
    line.leave("a")  # gone already: nothing to do
    assert len(line) == 2 and line.ahead("x", "e2", 12.0) == 1


async def test_the_watcher_wakes_its_waiters_on_the_next_report_or_at_their_timeout() -> None:
    watcher = watched(IDLE)
    waiting = [asyncio.create_task(watcher.next_report(30.0)) for _ in range(2)]
    await _loop_turns()  # both wait now
    watcher.update(msgspec.structs.replace(IDLE, iteration=IDLE.iteration))  # nothing new
    await _loop_turns()  # a wake-up would have finished them by now
    assert not any(task.done() for task in waiting)
    watcher.update(msgspec.structs.replace(IDLE, iteration=IDLE.iteration + 1))
    await asyncio.wait_for(asyncio.gather(*waiting), timeout=30.0)
    await watcher.next_report(0.001)  # no report: back after its timeout


async def _loop_turns(turns: int = 5) -> None:
    """Lets the event loop run what is ready, *turns* times over (no wall-clock wait): a task
    woken by a resolved future finishes within two."""
    for _ in range(turns):
        await asyncio.sleep(0)


# ---------------------------------------------------------------------------------- refusal log


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_refusal_is_logged_with_its_forecast_and_the_slots_it_waited_for(
    forecaster: SloForecaster, caplog: pytest.LogCaptureFixture
) -> None:
    # an operator asking why a request was refused reads what the forecast said, the slot
    # wait in it, and the engine state it was judged on: slots, the decodes' fewest steps left
    load = slot_bound(NOW_S, 400)
    refusals = RefusalLog(interval_s=1.0, clock=Clock())
    metrics = GatewayMetrics()
    slo_check = SloCheck(
        forecaster, on_engine(watched(load)), metrics, clock=lambda: NOW_S, refusals=refusals
    )
    given = candidate(rt_tenant(ttft_target_ms=2000, tpot_target_ms=200))
    with caplog.at_level("INFO", logger="gateway.pipeline.admission_log"):
        assert isinstance(slo_check(given), Refused)
    (line,) = [r.getMessage() for r in caplog.records if "SLO admission refused" in r.getMessage()]
    assert given.request.rid in line and "ten_rt" in line
    assert "time to first token target of 2000 ms" in line and "request slots" in line
    assert "64 RT decoding" in line and "64 request slots" in line
    assert "slots free within [400, 401, 402, 403, 404, 405, 406, 407] decode steps" in line
    assert "(1 on this engine since the last such line)" in line


def test_refusals_are_logged_once_a_second_per_engine_with_the_count_between(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    refusals = RefusalLog(interval_s=1.0, clock=clock)
    miss = Shortfall("ttft", 0.3, 0.9, 1.0)

    def note(rid: str, engine: str) -> bool:
        return refusals.note(
            "shed", rid, "ten_rt", miss, engine, SWAMPED, waited_s=0.0, ttft_extra_s=0.0
        )

    with caplog.at_level("INFO", logger="gateway.pipeline.admission_log"):
        assert note("r1", "a")  # the first after a quiet second: at once
        clock.now_s += 0.3
        assert not note("r2", "a") and not note("r3", "a")
        assert note("r4", "b")  # another engine has its own second
        clock.now_s += 0.8
        assert note("r5", "a")
    lines = [r.getMessage() for r in caplog.records if "SLO admission" in r.getMessage()]
    assert len(lines) == 3
    assert "r5" in lines[2] and "(3 on this engine since the last such line)" in lines[2]
    assert "r4" in lines[1] and "engine b then" in lines[1]
    downgrades = RefusalLog(clock=clock)
    with caplog.at_level("INFO", logger="gateway.pipeline.admission_log"):
        assert downgrades.note(
            "downgraded", "r6", "ten_rt", miss, "a", None, waited_s=0.0, ttft_extra_s=0.0
        )
    assert "SLO admission downgraded RT request r6" in caplog.records[-1].getMessage()


def test_an_admitted_request_is_not_logged_as_a_refusal(
    forecaster: SloForecaster, caplog: pytest.LogCaptureFixture
) -> None:
    refusals = RefusalLog(clock=Clock())
    slo_check = SloCheck(
        forecaster,
        on_engine(watched(IDLE)),
        GatewayMetrics(),
        clock=lambda: NOW_S,
        refusals=refusals,
    )
    with caplog.at_level("INFO", logger="gateway.pipeline.admission_log"):
        assert isinstance(slo_check(candidate(rt_tenant())), Admitted)
    assert not [r for r in caplog.records if "SLO admission" in r.getMessage()]
