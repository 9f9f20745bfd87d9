"""The simulator's front door: the gateway's SLO admission, for the bench.

On the real system the gateway forecasts, before a request reaches the engine, whether an RT
request's contract can be met from the engine's live state (gateway/pipeline/admission.py). The
simulator has no gateway, so this does the same at the moment a request arrives, with the same
forecaster (`backend.policy.feasibility`), from the same `EngineLoad` the engine would report
(`load_of` on the core's snapshot) and the pace the policy has learned. Arrivals enter the core
at iteration boundaries, so the state it reads is current (the gateway's is at most one
iteration old) and no iteration is in flight; the time the request already waited for that
boundary counts against its TTFT. The forecast is per tenant: a request waits behind its own
tenant's queue and the others' weighted share of it, as the engine's fair share serves them.

What happens to a request whose contract cannot be met is its contract's `SloUnattainable`
(`SimRequest.on_unattainable`, else the run's one): "reject" sheds it (it never reaches the
engine), "downgrade" runs it as BE, "accept" runs it as RT anyway. With `recheck_frac` (the
gateway's `slo_recheck_frac`), a request that would be shed or downgraded only for a request
slot's wait (every slot held by RT) is `PENDING` instead: it is judged again at each iteration
boundary, as the gateway judges it again on each of the engine's reports, until that share of
its TTFT target has passed since its arrival. With
`slot_line` (the gateway's `SlotLine`) a later request whose forecast meets its contract but
would wait for a slot is kept too while earlier ones are kept: it would take their slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from typing import Final, Literal

import msgspec

from backend.policy.calibration import PaceSpread
from backend.policy.common import PolicyBase
from backend.policy.feasibility import (
    SLOT_FREE_QUANTILE,
    Forecast,
    RtOutputs,
    Shortfall,
    SloAsk,
    SloForecaster,
    TtftFeedback,
    load_of,
    mean_iteration_s,
)
from backend.policy.load_report import (
    policy_calibration_samples,
    policy_rt_decode_margin,
    policy_rt_fair_counters,
    policy_rt_late_bound_frac,
    policy_slo_slot_line,
    policy_slo_slot_wait_feedback,
    policy_slot_free_quantile,
)
from backend.policy.types import Policy, Snapshot
from backend.sim.config import SloUnattainable
from backend.sim.records import Admission, RequestRecord
from backend.sim.source import SimRequest

PENDING: Final = "pending"
"""`FrontDoor.admit`'s answer for a request it keeps to judge again (`FrontDoor.pending`)."""


class FrontDoor:
    """Forecasts every RT arrival against the engine's state; sheds, downgrades or admits it."""

    def __init__(
        self,
        forecaster: SloForecaster,
        latency_factors: Callable[[], tuple[float, float, float]],
        on_unattainable: SloUnattainable,
        calibration_samples: Callable[[], int] = lambda: 0,
        rt_fair_counters: Callable[[], Mapping[str, float]] = dict,
        feedback: TtftFeedback | None = None,
        rt_late_bound_frac: float | None = None,
        rt_decode_margin: Callable[[], float] = lambda: 0.0,
        recheck_frac: float = 0.0,
        slot_line: bool = False,
        slot_free_quantile: float | None = SLOT_FREE_QUANTILE,
    ) -> None:
        self.forecaster = forecaster
        self.recheck_frac = recheck_frac
        """Share of its TTFT target, from its arrival, for which a request refused only for a
        request slot is judged again at each iteration boundary (0: judged once)."""
        self.slot_line = slot_line
        """The kept requests form a line: a later one that would wait for a slot waits behind
        them (the module doc; `TandemConfig.slo_slot_line`)."""
        self.pending: list[SimRequest] = []
        """The requests kept to judge again, in arrival order (`take_pending`)."""
        self.feedback = feedback
        """What admitted requests' first tokens taught the forecast (the gateway's
        `TtftFeedback`); None: forecasts are the model's alone."""
        self._forecasts: dict[str, tuple[float, float, float, float, int]] = {}
        """rid → (TTFT forecast from admission, admission time, its slot wait, that wait's pace
        per decode step, the iterations ended by its admission) of an admitted RT request,
        until it finishes and teaches `feedback`."""
        self._iteration_ends: list[float] = []
        """When each of the engine's iterations ended, in order (`iteration_ended`): the
        engine's reports of its iteration count and their times, as the gateway reads them."""
        self.latency_factors = latency_factors
        """The engine's pace as the policy has learned it, read at every forecast."""
        self.calibration_samples = calibration_samples
        """Iterations the policy's calibration has learned from, read at every forecast."""
        self.rt_fair_counters = rt_fair_counters
        """The policy's RT fair-share counters by tenant, read at every forecast."""
        self.rt_late_bound_frac = rt_late_bound_frac
        """How far past its deadline the policy serves a waiting RT prompt first (`load_of`)."""
        self.rt_decode_margin = rt_decode_margin
        """The policy's safety margin on the RT decodes' next tokens, read at every forecast."""
        self.on_unattainable: SloUnattainable = on_unattainable
        self.outcomes: dict[str, Admission] = {}
        """rid → how it was admitted, for the requests that were not simply admitted."""
        self.shed: list[RequestRecord] = []
        """The requests it refused (they never reached the engine)."""
        self.rt_outputs = RtOutputs(quantile=slot_free_quantile)
        """How long the engine's RT requests run (seen in the snapshots it forecasts from), for
        `EngineLoad.rt_decode_steps_left` as the real engine reports it."""
        self.pace = PaceSpread()
        """The engine's recent measured ÷ predicted iteration times (the simulator's loop feeds
        it), as the real engine reports them in `EngineLoad.pace_ratio_p90`."""

    def unattainable(self, req: SimRequest) -> SloUnattainable:
        """What *req*'s contract makes of a forecast miss: its own, else the run's."""
        return req.on_unattainable or self.on_unattainable

    def keeps(self, req: SimRequest, shortfall: Shortfall | None, ask: SloAsk) -> bool:
        """Whether a forecast missing by *shortfall* keeps *req* to judge again (the module
        doc): shed or downgraded only for a request slot's wait, within its recheck time
        (`recheck_frac` of its TTFT target from its arrival)."""
        return (
            shortfall is not None
            and self.unattainable(req) != "accept"
            and shortfall.waits_for_slot
            and ask.waited_s < self.recheck_frac * ask.ttft_target_s
        )

    def kept(self, req: SimRequest, forecast: Forecast, ask: SloAsk) -> bool:
        """Whether *req*, forecast so, is kept to judge again: `keeps` its shortfall, or its
        forecast meets the contract but waits for a slot while requests that came before it are
        kept (`slot_line`; `pending` holds them: the kept ones are judged again first, in
        arrival order, and a later one after them). One line for every replica of a pool: a
        replica's arrival waits for a slot only when that replica is full too."""
        behind_line = (
            self.slot_line
            and bool(self.pending)
            and forecast.feasible
            and forecast.slot_wait_s > 0.0
            and ask.waited_s < self.recheck_frac * ask.ttft_target_s
        )
        return behind_line or self.keeps(req, forecast.shortfall, ask)

    def settle_pending(self) -> list[SimRequest]:
        """The run ended with requests kept to judge again: each gets its contract's answer
        (shed, or the request as BE to hand to the engine: returned)."""
        settled = (self.outcome(req, feasible=False) for req in self.take_pending())
        return [req for req in settled if req is not None]

    def take_pending(self) -> list[SimRequest]:
        """The requests kept to judge again (the door forgets them: `admit` them again)."""
        pending, self.pending = self.pending, []
        return pending

    def admit(
        self, req: SimRequest, snapshot: Snapshot, now_s: float
    ) -> SimRequest | Literal["pending"] | None:
        """The request to hand to the engine (*req*, or *req* as BE), None when it is shed, or
        `PENDING` when the door keeps it to judge again (see the module doc). *snapshot* is the
        engine's state with every earlier arrival already in it."""
        if req.tier != "rt" or req.ttft_target_s is None:
            return req
        self.rt_outputs.observe(snapshot)
        latency_factors = self.latency_factors()
        load = load_of(
            snapshot,
            iteration=0,
            at_unix_s=now_s,
            iteration_s=0.0,
            latency_factors=latency_factors,
            pace_ratio_p90=self.pace.upper(latency_factors),
            pace_ratio_recent_mean=self.pace.recent_mean(latency_factors),
            calibration_samples=self.calibration_samples(),
            rt_fair_counters=self.rt_fair_counters(),
            rt_outputs=self.rt_outputs,
            rt_late_bound_frac=self.rt_late_bound_frac,
            rt_decode_margin=self.rt_decode_margin(),
        )
        ask = slo_ask(req, now_s)
        extra_s = self.feedback.extra_s(now_s) if self.feedback is not None else 0.0
        scale = self.feedback.slot_wait_scale(now_s) if self.feedback is not None else 1.0
        forecast = self.forecaster.forecast(load, ask, ttft_extra_s=extra_s, slot_wait_scale=scale)
        if self.kept(req, forecast, ask):
            self.pending.append(req)
            return PENDING
        if forecast.feasible and self.feedback is not None:
            # the model's own forecast from now, as the gateway keeps it (admission.py)
            to_come_s = forecast.ttft_s - ask.waited_s - extra_s
            self._forecasts[req.rid] = (
                to_come_s,
                now_s,
                forecast.slot_wait_s,
                forecast.slot_step_s,
                len(self._iteration_ends),
            )
        return self.outcome(req, forecast.feasible)

    def iteration_ended(self, at_s: float) -> None:
        """One of the engine's iterations ended at *at_s* (they end in order)."""
        self._iteration_ends.append(at_s)

    def learn(self, rid: str, first_token_s: float | None, now_s: float) -> None:
        """Request *rid* finished at *now_s*, its first token at *first_token_s*: an admitted RT
        request teaches the feedback, as the gateway's usage record of it does (the engine's
        reports then and at its first token: how fast its iterations ran meanwhile)."""
        kept = self._forecasts.pop(rid, None)
        if kept is None or self.feedback is None or first_token_s is None:
            return
        forecast_s, admitted_s, slot_wait_s, slot_step_s, ended = kept
        ended_at_s = self._iteration_ends[ended - 1] if ended else admitted_s
        # the iteration that emitted it ended at its first token (the tolerance: float sums)
        by_first = bisect.bisect_right(self._iteration_ends, first_token_s + 1e-9)
        iteration_s = mean_iteration_s(ended, ended_at_s, by_first, first_token_s)
        self.feedback.observe(
            forecast_s, first_token_s - admitted_s, now_s, slot_wait_s, slot_step_s, iteration_s
        )

    def outcome(self, req: SimRequest, feasible: bool) -> SimRequest | None:
        """What the contract makes of an RT request whose forecast is *feasible* or not: the
        request to hand to the engine (*req*, or *req* as BE), or None when it is shed."""
        if feasible:
            return req
        outcome = self.unattainable(req)
        if outcome == "accept":
            self.outcomes[req.rid] = "accepted"
            return req
        if outcome == "downgrade":
            self.outcomes[req.rid] = "downgraded"
            return msgspec.structs.replace(req, tier="be", ttft_target_s=None, tpot_target_s=None)
        self.outcomes[req.rid] = "shed"
        self.shed.append(_shed_record(req))
        return None


def slo_ask(req: SimRequest, now_s: float) -> SloAsk:
    """What an RT request with a TTFT target asks of the engine at *now_s*."""
    assert req.ttft_target_s is not None
    return SloAsk(
        prompt_tokens=req.prompt_len,
        ttft_target_s=req.ttft_target_s,
        tpot_target_s=req.tpot_target_s,
        waited_s=max(0.0, now_s - req.arrival_s),
        # the tenant as the core files it (backend/sim/core.py): its fair-share lane
        tenant_id=req.length_key if req.tenant_id is None else req.tenant_id,
        weight=req.tenant_weight,
        at_s=now_s,
    )


def front_door_for(
    policy: Policy,
    on_unattainable: SloUnattainable,
    *,
    ttft_feedback: bool = False,
    recheck_frac: float = 0.0,
) -> FrontDoor | None:
    """The front door a policy asks for (`PolicyBase.slo_forecaster`); None: admit everything.
    *ttft_feedback*: it learns from outcomes (`SimConfig.ttft_feedback`); *recheck_frac*:
    `SimConfig.slo_recheck_frac`; the kept requests form a line as the policy asks
    (`policy_slo_slot_line`)."""
    if not isinstance(policy, PolicyBase):
        return None
    forecaster = policy.slo_forecaster()
    if forecaster is None:
        return None
    return FrontDoor(
        forecaster,
        policy.latency_factors,
        on_unattainable,
        lambda: policy_calibration_samples(policy),
        lambda: policy_rt_fair_counters(policy),
        TtftFeedback(slot_wait=policy_slo_slot_wait_feedback(policy)) if ttft_feedback else None,
        policy_rt_late_bound_frac(policy),
        lambda: policy_rt_decode_margin(policy),
        recheck_frac,
        policy_slo_slot_line(policy),
        policy_slot_free_quantile(policy),
    )


def _shed_record(req: SimRequest) -> RequestRecord:
    return RequestRecord(
        rid=req.rid,
        tier=req.tier,
        arrival_s=req.arrival_s,
        prompt_len=req.prompt_len,
        output_len_target=min(req.output_len, req.max_new_tokens),
        generated=0,
        first_token_s=None,
        finish_s=None,
        token_times=(),
        evictions=0,
        cached_tokens=0,
        ttft_target_s=req.ttft_target_s,
        tpot_target_s=req.tpot_target_s,
        deadline_s=None,
        length_key=req.length_key,
        tenant_id=req.length_key if req.tenant_id is None else req.tenant_id,
        max_new_tokens=req.max_new_tokens,
        admission="shed",
    )
