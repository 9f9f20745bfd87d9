"""The admit stage: may this request go to an engine now, and on what terms?

Admission is a sequence of checks (`ADMISSION_CHECKS` builds it from the app). Each check looks
at the request as admitted so far (`Admitted`) and returns either

* an `Admitted` — the same one, one with a hold added (a resource it reserved for the request,
  given back by the record stage), or one with a changed request (a check may change its terms),
* or a `Refused` (gateway/pipeline/outcome.py): HTTP status, OpenAI code, message, whether a retry
  may succeed and when.

The first refusal ends admission, and the holds the earlier checks took are given back at once.
The checks, in order:

* **quota** — the tenant's limits (gateway/quotas): `QuotaCheck`.
* **SLO feasibility** — `SloCheck`: for an RT request, the engine it will run on (the place
  stage's router picks it now, and the place stage keeps it), and from that engine's live
  state (`LOADS`: its latest `EngineLoad` and the RT work sent since) with the latency model
  the engine's policy plans with (backend/policy/feasibility.py), plus what that engine's own
  outcomes taught (`TtftFeedbackByEngine`), whether the contract (TTFT, TPOT) can be met — per
  tenant: the request waits behind its own tenant's queue and the others' weighted fair share
  of it, so a tenant over its share is shed first. If it cannot, the tenant's contract
  (`Slo.on_unattainable`) decides:

      reject     Refused(429, code="slo_unattainable", retryable=True, retry_after_s): the
                 message names the target and by how much the forecast misses it
      downgrade  an Admitted whose request was rebuilt for tier "be" (`in_tier`: the BE
                 metadata and priority; the response's id, the usage record and the engine all
                 follow the admitted request; the response says so in `X-Tandem-Downgraded`)
      accept     the Admitted it was given, run as RT (best effort)

  A request refused or downgraded only because it would wait for a request slot (every one
  held by RT requests) is `Pending` instead when the admit stage asks for it (`recheck`): it
  waits for the engine's next report and is judged again, for `gateway.slo_recheck_frac` of
  its TTFT target; the checks before this one keep what they hold meanwhile.

  Each outcome is on the `Admitted` (`slo`), in the usage record (`admission`) and counted on
  /metrics. The decision itself is `decide_slo`, a pure function of the contract, the ask, the
  engine's state and the backlog; without state (no watcher, nothing reported yet) it admits.
* **tier queue** — `TierQueueCheck` (gateway/pipeline/tier_queue.py): an interactive request
  whose tier already has `gateway.max_inflight_<tier>` requests in flight on the engine is
  refused (429 `tier_queue_full`, Retry-After); otherwise it holds a place in that queue.
* **per-tenant fairness** (to come) — a tenant over its fair share of the engine while others wait:
  `Refused(429, retryable=True)` with a short `retry_after_s`, or a hold on its share.

A check that needs the engine's state reads it through the app (it is given the app when
`ADMISSION_CHECKS` builds it), so `admit_through` itself stays a pure function of its checks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import msgspec
from aiohttp import web

from backend.policy.feasibility import (
    NO_BACKLOG,
    Backlog,
    Forecast,
    Shortfall,
    SloAsk,
    SloForecaster,
    TtftFeedback,
    TtftFeedbackByEngine,
)
from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import AUTO, bundled_profile_for, resolve_profile
from backend.policy.tandem.config import TandemConfig
from common.config import Config
from common.wire import EngineLoad
from gateway.metrics import GatewayMetrics
from gateway.pipeline.admission_log import RefusalLog
from gateway.pipeline.outcome import Refused
from gateway.pipeline.placement import Placement, engine_candidates, place_request
from gateway.pipeline.prepare import EngineRequest, in_tier
from gateway.pipeline.slot_line import SlotLine
from gateway.pipeline.tier_queue import TierQueueCheck
from gateway.quotas.limiter import (
    LimitIsZero,
    QuotaExceeded,
    QuotaLimiter,
    RequestTooLarge,
    Ticket,
)
from gateway.state import (
    METRICS,
    POOL,
    QUOTAS,
    REFUSAL_LOG,
    SLO_FORECASTER,
    SLOT_LINE,
    TIER_QUEUES,
    TTFT_FEEDBACK,
)
from gateway.store.types import AdmissionOutcome, Slo, Tenant

Origin = Literal["api", "batch"]
"""Where a request came from: a client's HTTP call, or a line of a Batch-API batch (which the
batch runner paces itself, so it counts toward the monthly token budget only)."""


class Hold(Protocol):
    """A resource an admission check reserved for a request, held until it ends."""

    def release(self, used_tokens: int) -> None:
        """Gives the resource back; *used_tokens* (prompt + completion, 0 if the request never
        ran) is what the request really cost. Called exactly once."""


class Admitted(msgspec.Struct, frozen=True):
    """A request that passed the admission checks run so far, with what they hold for it."""

    tenant: Tenant
    origin: Origin
    request: EngineRequest
    """The request to run (a check may have changed its terms, e.g. its tier)."""
    holds: tuple[Hold, ...] = ()
    """Given back by the record stage when the request ends (or by `admit_through` when a later
    check refuses it)."""
    slo: SloDecision | None = None
    """What the SLO admission decided (None: it did not judge this request — not RT)."""
    placement: Placement | None = None
    """The engine the SLO admission judged an RT request on, chosen by the place stage's router
    (`SloCheck`): the place stage keeps it, so the request runs where its contract was
    forecast. None: not judged on one (not RT, downgraded, or no engine to judge on)."""

    def holding(self, hold: Hold) -> Admitted:
        """This admission with one more hold."""
        return msgspec.structs.replace(self, holds=(*self.holds, hold))


class Pending(msgspec.Struct, frozen=True):
    """No verdict yet: the SLO check would refuse (or downgrade) the request for a wait the
    engine's next report may well shorten — one for a request slot, every one held by RT
    requests (`SloCheck.recheck`). The admit stage waits for that report and asks again
    (gateway/pipeline/stages.py, `admit_rechecking`)."""

    next_report: Callable[[float], Awaitable[None]]
    """Waits for the judged engine's next report, at most the given seconds."""
    shortfall: Shortfall | None
    """What the forecast missed this time; None: it met the contract, but would wait for a
    slot behind requests kept for one before it (`SlotLine`)."""
    engine: str = ""
    """The engine it was judged on (its name): it waits in that engine's `SlotLine`."""
    admitted: Admitted | None = None
    """The request as the checks before the pending one admitted it, with what they hold —
    kept, not given back: asked again, admission resumes from the pending check with it
    (`admit_through` sets it)."""
    resume_at: int = 0
    """The pending check's place in the checks `admit_through` ran (it sets it)."""


AdmissionCheck = Callable[[Admitted], Admitted | Refused | Pending]
"""One admission check: the request as admitted so far → admitted (perhaps on changed terms,
perhaps holding more), refused, or pending (the SLO check only, when asked to recheck)."""


def admit_through(
    checks: Sequence[AdmissionCheck], candidate: Admitted
) -> Admitted | Refused | Pending:
    """Runs *checks* in order; the first refusal wins and releases what earlier checks hold. A
    pending verdict stops them too, and keeps what the earlier checks hold on its `admitted`
    (the caller resumes from it, or gives the holds back): asking a quota again for the same
    request would take it twice."""
    admitted = candidate
    for index, check in enumerate(checks):
        outcome = check(admitted)
        if isinstance(outcome, Pending):
            return msgspec.structs.replace(outcome, admitted=admitted, resume_at=index)
        if isinstance(outcome, Refused):
            release_holds(admitted.holds, used_tokens=0)
            return outcome
        admitted = outcome
    return admitted


def release_holds(holds: Sequence[Hold], used_tokens: int) -> None:
    """Gives back every hold of a request that used *used_tokens*."""
    for hold in holds:
        hold.release(used_tokens)


def admission_checks(app: web.Application, *, recheck: bool = False) -> tuple[AdmissionCheck, ...]:
    """The checks every request passes, in order (the cheapest and most final first).
    *recheck*: the SLO check answers `Pending` where the engine's next report may change its
    verdict (`SloCheck.recheck`)."""
    metrics = app[METRICS]
    checks: tuple[AdmissionCheck, ...] = (
        QuotaCheck(app[QUOTAS], metrics),
        SloCheck(
            app.get(SLO_FORECASTER),
            functools.partial(place_request, app),
            metrics,
            feedback=app.get(TTFT_FEEDBACK),
            recheck=recheck,
            refusals=app.get(REFUSAL_LOG),
            line=app.get(SLOT_LINE),
        ),
    )
    queues = app.get(TIER_QUEUES)
    if queues is None:  # an app without the bounds (unit tests' minimal apps)
        return checks
    # last: it counts the tier the request runs in, after the SLO check may have downgraded it
    return (*checks, TierQueueCheck(queues, queue_key(app), metrics))


# ---------------------------------------------------------------------------------- quotas


class QuotaHold(msgspec.Struct, frozen=True):
    """A request's hold on its tenant's quota (a `Ticket` of the limiter)."""

    limiter: QuotaLimiter
    ticket: Ticket

    def release(self, used_tokens: int) -> None:
        self.limiter.release(self.ticket, used_tokens)


@dataclass(frozen=True)
class QuotaCheck:
    """The tenant's requests/min, tokens/min, concurrency and monthly budget (in memory, no I/O).

    A request counts its prompt plus its output cap when admitted; batch lines count toward
    the monthly budget only (gateway/quotas/__init__.py explains why). Over a limit: 429 with
    Retry-After; one needing more than the whole tokens_per_min: 400
    `request_too_large_for_limit`; any request of a tenant with a limit of 0: 403
    `<limit>_is_zero` (no retry could pass, and clients retry 429s)."""

    limiter: QuotaLimiter
    metrics: GatewayMetrics

    def __call__(self, admitted: Admitted) -> Admitted | Refused:
        request = admitted.request
        try:
            ticket = self.limiter.admit(
                admitted.tenant,
                len(request.input_ids),
                request.max_tokens,
                interactive=admitted.origin == "api",
            )
        except RequestTooLarge as exc:
            self.metrics.quota_rejected(admitted.tenant.id, "tokens_per_min")
            return Refused(
                kind="invalid_request",
                http_status=400,
                message=exc.message,
                code="request_too_large_for_limit",
                param="max_tokens",
            )
        except LimitIsZero as exc:
            self.metrics.quota_rejected(admitted.tenant.id, exc.limit)
            return Refused(
                kind="rate_limited",
                http_status=403,
                message=exc.message,
                code=f"{exc.limit}_is_zero",
            )
        except QuotaExceeded as exc:
            self.metrics.quota_rejected(admitted.tenant.id, exc.limit)
            return Refused(
                kind="rate_limited",
                http_status=429,
                message=exc.message,
                code=f"{exc.limit}_exceeded",
                retryable=True,
                retry_after_s=int(exc.retry_after_s),
            )
        return admitted.holding(QuotaHold(self.limiter, ticket))


# ---------------------------------------------------------------------------------- SLO feasibility


class SloDecision(msgspec.Struct, frozen=True):
    """The SLO admission's verdict on one RT request."""

    outcome: AdmissionOutcome
    """admitted, unchecked, accepted, downgraded or shed (gateway.store.types)."""
    shortfall: Shortfall | None = None
    """The target the forecast misses and by how much (None: admitted or unchecked)."""
    forecast_ttft_s: float | None = None
    """The time to first token still to come at admission as the engine model forecast it
    (without `TtftFeedback`'s extra), seconds; None: nothing was forecast."""
    waited_s: float = 0.0
    """Time the request had already spent at admission, seconds."""
    engine: str | None = None
    """The engine it was judged on (its name); its first token teaches that engine's
    `TtftFeedback`. None: judged on none."""
    forecast_tpot_s: float | None = None
    """The TPOT the forecast predicted, seconds; None: nothing was forecast (or no TPOT
    target)."""
    ttft_extra_s: float = 0.0
    """What outcomes had taught the TTFT forecast to add (`TtftFeedback.extra_s`), seconds."""
    slot_wait_s: float = 0.0
    """The part of `forecast_ttft_s` spent waiting for a request slot, seconds."""
    slot_wait_scale: float = 1.0
    """The scale outcomes had taught that wait (`TtftFeedback.slot_wait_scale`), already in
    `slot_wait_s`."""
    slot_step_s: float = 0.0
    """The pace that wait was forecast at, seconds per decode step before the scale
    (`Forecast.slot_step_s`); 0 with no slot wait."""
    load: EngineLoad | None = None
    """The engine state the forecast was made on (None: unchecked): an admitted request that
    then misses its contract is logged with it (`stages.record`)."""

    @property
    def target(self) -> str:
        """The missed target ("ttft", "tpot"), or "" when none was missed (a metric label)."""
        return self.shortfall.target if self.shortfall is not None else ""


_ON_MISS: dict[str, AdmissionOutcome] = {
    "reject": "shed",
    "downgrade": "downgraded",
    "accept": "accepted",
}


def decide_slo(
    forecaster: SloForecaster | None,
    contract: Slo,
    ask: SloAsk,
    load: EngineLoad | None,
    backlog: Backlog,
    ttft_extra_s: float = 0.0,
    *,
    forecast: Forecast | None = None,
    engine: str | None = None,
    slot_wait_scale: float = 1.0,
) -> SloDecision:
    """The verdict on an RT request asking *ask* of engine *engine* in state *load* with
    *backlog* sent since: admitted when its forecast (plus *ttft_extra_s*, what outcomes
    taught: `TtftFeedback`) meets the contract, else what the contract's `on_unattainable`
    says; unchecked when there is no state (or no model) to forecast from. *forecast*: the one
    the router made for this engine on the same state (with the same extra), used as is;
    *slot_wait_scale*: what outcomes taught a slot's wait (`TtftFeedback.slot_wait_scale`).
    Pure."""
    if forecaster is None or load is None:
        return SloDecision("unchecked", engine=engine)
    if forecast is None:
        forecast = forecaster.forecast(load, ask, backlog, ttft_extra_s, slot_wait_scale)
    to_come_s = forecast.ttft_s - ask.waited_s - ttft_extra_s  # the model's own forecast
    outcome = "admitted" if forecast.shortfall is None else _ON_MISS[contract.on_unattainable]
    return SloDecision(
        outcome,
        forecast.shortfall,
        to_come_s,
        ask.waited_s,
        engine,
        forecast_tpot_s=forecast.tpot_s,
        ttft_extra_s=ttft_extra_s,
        slot_wait_s=forecast.slot_wait_s,
        slot_wait_scale=forecast.slot_wait_scale,
        slot_step_s=forecast.slot_step_s,
        load=load,
    )


def slo_ask(request: EngineRequest, now_unix_s: float) -> SloAsk | None:
    """What an RT request asks of the engine (None: not RT, or no TTFT target to judge), for
    its tenant and fair-share weight as the engine will see them (its `RequestMeta`, built from
    the tenant's contract: `tenant.slo.weight`)."""
    meta = request.meta
    if meta.tier != "rt" or meta.ttft_target_ms is None:
        return None
    return SloAsk(
        prompt_tokens=len(request.input_ids),
        ttft_target_s=meta.ttft_target_ms / 1000.0,
        tpot_target_s=meta.tpot_target_ms / 1000.0 if meta.tpot_target_ms is not None else None,
        waited_s=max(0.0, now_unix_s - meta.arrival_unix_s),
        tenant_id=meta.tenant_id,
        weight=meta.tenant_weight,
        at_s=now_unix_s,
    )


def slo_unattainable(shortfall: Shortfall) -> Refused:
    """The 429 of a request shed because its contract cannot be met now."""
    retry_after_s = int(shortfall.retry_after_s)
    return Refused(
        kind="slo_unattainable",
        http_status=429,
        message=f"{shortfall.describe()}; retry in {retry_after_s} s",
        code="slo_unattainable",
        retryable=True,
        retry_after_s=retry_after_s,
    )


Placer = Callable[[EngineRequest, SloAsk, float], Placement | None]
"""Where an RT request asking an `SloAsk` would run at a wall-clock time (the place stage's
router on the engines that serve now); None: no engine to place it on."""


@dataclass(frozen=True)
class SloCheck:
    """Forecasts an RT request's TTFT and TPOT on the engine it will run on, from that engine's
    live state, and applies the tenant's contract when they miss (see the module doc).

    The engine is chosen here, by the place stage's router (*place*), and kept on the
    `Admitted` for the place stage: judged on one engine and run on another, a request was
    forecast on the wrong queue — in a pool the admission used to judge on the replica with
    the least RT work waiting whatever the router chose, and the outcomes of requests that ran
    elsewhere then taught the forecast what it had not forecast. No I/O: it reads the watchers'
    latest state, kept fresh by their own loops."""

    forecaster: SloForecaster | None
    """None: no latency model, nothing is forecast (every RT request is unchecked)."""
    place: Placer
    metrics: GatewayMetrics
    clock: Callable[[], float] = time.time
    """Wall clock, seconds (the request's arrival is a wall-clock time)."""
    feedback: TtftFeedbackByEngine | None = None
    """What admitted requests' real TTFT taught about each engine's forecast (None: nothing
    learned)."""
    recheck: bool = False
    """Answer `Pending` instead of refusing or downgrading a request whose TTFT forecast
    waits for a request slot (every one held by RT requests): that wait is forecast from how
    many steps the running requests have left on average, while they finish one at a time, at
    instants the engine's next reports show. Nothing is counted for a pending verdict; the
    admit stage asks again on the next report, and without `recheck` once the request's
    recheck time (`GatewayConfig.slo_recheck_frac`) is up. A forecast over its target for the
    work queued ahead stays refused at once: waiting would spend the same time it forecasts."""
    refusals: RefusalLog | None = None
    """Where final refusals and downgrades are logged (throttled per engine); None: not
    logged (a pending verdict is never logged: it is no verdict yet)."""
    line: SlotLine | None = None
    """The requests kept for a slot, per engine (with `recheck`): a request whose forecast
    meets the contract but waits for a slot is `Pending` too while requests that arrived
    before it wait in that engine's line — it would take the slot they wait for. None: each
    request is judged on its own (`TandemConfig.slo_slot_line` off)."""

    def __call__(self, admitted: Admitted) -> Admitted | Refused | Pending:
        now_unix_s = self.clock()
        ask = slo_ask(admitted.request, now_unix_s)
        if ask is None:
            return admitted
        placement = self.place(admitted.request, ask, now_unix_s)
        engine = placement.engine if placement is not None else None
        watcher = engine.load if engine is not None else None
        load = watcher.latest if watcher is not None else None
        forecast = placement.forecast if placement is not None else None
        backlog = (  # the router's forecast counted it already
            watcher.backlog(now_unix_s)
            if forecast is None and watcher is not None and load is not None
            else NO_BACKLOG
        )
        extra_s, scale = 0.0, 1.0
        if engine is not None and self.feedback is not None:
            extra_s = self.feedback.extra_s(engine.name, now_unix_s)
            scale = self.feedback.slot_wait_scale(engine.name, now_unix_s)
            self.metrics.slo_ttft_feedback.labels(engine.name).set(extra_s)
            self.metrics.slo_slot_wait_scale.labels(engine.name).set(scale)
        decision = decide_slo(
            self.forecaster,
            admitted.tenant.slo,
            ask,
            load,
            backlog,
            extra_s,
            forecast=forecast,
            engine=engine.name if engine is not None else None,
            slot_wait_scale=scale,
        )
        if self.recheck and watcher is not None and engine is not None:
            kept_for_slot = (
                decision.outcome in ("shed", "downgraded")
                and decision.shortfall is not None
                and decision.shortfall.waits_for_slot
            )
            behind_line = (
                self.line is not None
                and decision.outcome == "admitted"
                and decision.slot_wait_s > 0.0
                and self.line.ahead(
                    admitted.request.rid, engine.name, admitted.request.meta.arrival_unix_s
                )
                > 0
            )
            if kept_for_slot or behind_line:
                return Pending(watcher.next_report, decision.shortfall, engine=engine.name)
        self.metrics.slo_admission(admitted.tenant.id, decision.outcome, decision.target)
        if (
            self.refusals is not None
            and decision.outcome in ("shed", "downgraded")
            and decision.shortfall is not None
        ):
            self.refusals.note(
                decision.outcome,
                admitted.request.rid,
                admitted.tenant.id,
                decision.shortfall,
                decision.engine,
                decision.load,
                waited_s=decision.waited_s,
                ttft_extra_s=decision.ttft_extra_s,
                slot_wait_scale=decision.slot_wait_scale,
            )
        if decision.outcome == "shed":
            assert decision.shortfall is not None
            return slo_unattainable(decision.shortfall)
        if decision.outcome == "downgraded":
            # placed again as what it now is (BE goes where capacity is left over)
            request = in_tier(admitted.request, admitted.tenant, "be")
            return msgspec.structs.replace(admitted, request=request, slo=decision)
        if watcher is not None:
            watcher.sent(ask.prompt_tokens, now_unix_s, ask.tenant_id, ask.weight)
        return msgspec.structs.replace(admitted, slo=decision, placement=placement)


def queue_key(app: web.Application) -> str:
    """The key the tier queues count the pool's requests under (its first engine's name; one
    key for all: admission comes before placement)."""
    pool = app.get(POOL)
    return pool.replicas[0].name if pool is not None else engine_candidates(app)[0].name


def engine_profile(config: Config) -> str:
    """The latency profile the engine's policy plans with (a name or a path). "auto" (an engine
    `tandem serve` did not choose a profile for: it names the one it chose) is the device's
    bundled profile, as the engine launcher resolves it."""
    if config.engine.kind == "sim":
        return config.engine.sim_profile
    if config.engine.profile == AUTO:
        return bundled_profile_for(config.engine.device, config.engine.torch_native_extend)
    return config.engine.profile


def build_forecaster(config: Config) -> SloForecaster:
    """The SLO forecaster on the latency model the engine fits from the same profile, chunking
    and keeping headroom as the engine's tandem policy is configured to (the simulator's front
    door forecasts with the same options, so the twin and the real engine admit alike); the
    forecaster's defaults for an engine run by another policy. Raises ValueError naming the
    profile when it cannot be read, or the option the policy would refuse."""
    profile = load_profile(resolve_profile(engine_profile(config)))
    latency = LatencyModel.fit(profile.samples)
    options = tandem_options(config)
    if options is None:
        return SloForecaster(latency)
    return SloForecaster(
        latency,
        iteration_budget_s=options.latency_budget_s,
        budget_pace_max=options.latency_budget_pace_max if options.use_calibration else 1.0,
        headroom=options.slo_headroom,
        min_chunk_tokens=options.min_chunk_tokens,
        split_min_gain=options.split_min_gain if options.split_mixed else None,
        pace_averaging=options.slo_pace_averaging,
    )


def tandem_options(config: Config) -> TandemConfig | None:
    """The SLO admission options of the engine's tandem policy, as the engine reads them (the
    simulator's server runs its policy's defaults); None: the engine runs another policy.
    Raises ValueError naming the option the policy would refuse."""
    sim = config.engine.kind == "sim"
    if (config.engine.sim_policy if sim else config.engine.policy) != "tandem":
        return None
    try:
        return msgspec.convert({} if sim else config.engine.policy_options, TandemConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"engine.policy_options: {exc}") from None


def build_slot_line(config: Config) -> SlotLine | None:
    """The line of requests kept for a slot (`SlotLine`), or None when the engine's tandem
    policy turns it off (`slo_slot_line`). Another policy's engine gets one: the line is the
    gateway's, whatever the engine runs."""
    options = tandem_options(config)
    if options is not None and not options.slo_slot_line:
        return None
    return SlotLine()


def build_ttft_feedback(config: Config) -> TtftFeedbackByEngine:
    """What admitted requests' first tokens teach the SLO admission, per engine; the slot
    wait's scale is learned unless the engine's tandem policy turns it off
    (`slo_slot_wait_feedback`)."""
    options = tandem_options(config)
    slot_wait = options is None or options.slo_slot_wait_feedback
    return TtftFeedbackByEngine(functools.partial(TtftFeedback, slot_wait=slot_wait))
