"""`tandem` — RT keeps its SLOs, BE gets the rest: the per-iteration loop of synthesis §4.

plan(snapshot):
    view     = running split by tier/phase             (context.split_running)
    queues   ← new waiting requests (O(new))            (queues.RtQueue / BeQueue: one lane
                                                         per tenant, offered by fair share)
    hold     : no RT around, the last one just ended,   (anticipation, rt_anticipation_s)
               closed-loop clients → an empty plan that
               waits for the next RT arrival (≤ window)
    RT phase : all RT decodes; τ from deadlines, ≤ L;   (rt_phase)
               τ ≤ allowance of BE deadlines            (be_phase.cap_for_be_deadlines)
               urgent prompts (τ raised as they need), window by best fit, ERA, admission
    BE phase : the time left under τ × BE share,        (be_phase)
               the KV left after the RT headroom
    feedback ← the earliest RT deadline this batch carries
    fair share ← every token the plan schedules (TandemBatch.on_tokens), charged to its
                 tenant's counter in its tier once the plan is built (within the plan the queues
                 count what they offer)
observe(result):
    calibration ← (model prediction, measured time, regime): the per-regime factors that scale
                  every prediction of the next plans (calibration, timing.Timer.scale)
    AIMD on ε and the BE share (feedback); finished lengths → per-key history (admission)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from backend.policy.calibration import LatencyCalibration, PaceSpread, budget_pace, regime_of
from backend.policy.common import PolicyBase, waiting_in
from backend.policy.fair_share import FairShare
from backend.policy.feasibility import SloForecaster
from backend.policy.latency import LatencyModel
from backend.policy.tandem import slack
from backend.policy.tandem.admission import AdmissionRound, LengthModel, RtHeadroom
from backend.policy.tandem.anticipation import Anticipation
from backend.policy.tandem.batch import TandemBatch
from backend.policy.tandem.be_phase import cap_for_be_deadlines, run_be_phase
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.context import PlanContext, RunningView, split_running
from backend.policy.tandem.feedback import Feedback, RiderCost
from backend.policy.tandem.progress import ensure_progress
from backend.policy.tandem.queues import BeQueue, RtQueue
from backend.policy.tandem.rt_phase import (
    defer_rt_decodes,
    run_rt_decodes,
    run_rt_prefills,
    split_pays,
)
from backend.policy.tandem.timing import BatchTotals, Timer
from backend.policy.types import IterationResult, Plan, ReqState, Snapshot
from common.wire import Tier

RT_PROMPT_EWMA = 0.2
"""Weight of each new RT prompt in the moving mean of RT prompt lengths."""
BE_SHARE_WINDOW_S = 1.0
"""Time constant of BE's recent share of the engine's time (`be_min_time_share`), seconds of
predicted iteration time."""


class TandemPolicy(PolicyBase):
    """The co-location policy (registry name `tandem`; `tandem-no-<part>` ablations)."""

    name = "tandem"

    def __init__(
        self, latency: LatencyModel, *, config: TandemConfig | None = None, **options: Any
    ) -> None:
        super().__init__(latency)
        cfg = config if config is not None else TandemConfig(**options)
        self.config = cfg
        self.timer = Timer(latency)
        self.lengths = LengthModel(
            window=cfg.history_window, min_samples=cfg.history_min_samples, seed=cfg.seed
        )
        self.rt_fair = FairShare()
        """Virtual token counters of the RT tenants."""
        self.be_fair = FairShare()
        """Virtual token counters of the BE tenants."""
        self.rt_queue = RtQueue(self._rt_latest_start, self.rt_fair, by_tenant=cfg.use_fair_share)
        self.be_queue = BeQueue(
            self._be_latest_start,
            self._be_hopeless,
            seed=cfg.seed,
            order_prob=cfg.be_order_prob,
            max_wait_s=cfg.be_max_wait_s,
            fair=self.be_fair,
            by_tenant=cfg.use_fair_share,
        )
        self.headroom = RtHeadroom(
            window_s=cfg.rt_headroom_window_s,
            floor_frac=cfg.rt_headroom_frac,
            max_frac=cfg.rt_headroom_max_frac,
        )
        self.feedback = Feedback(cfg)
        self.calibration = LatencyCalibration()
        """The engine's pace relative to the profile, per batch regime, and the model's error
        (`calibration.summary()` is what the engine driver reports)."""
        self.pace_spread = PaceSpread()
        """Measured ÷ predicted of the recent iterations: RT prompts' slack is taken at its
        upper quantile (`TandemConfig.deadline_spread`)."""
        self._max_prefill = 8192
        self._served: dict[tuple[Tier, str], float] = {}  # (tier, tenant) → weighted tokens
        self._last_plan: Plan | None = None
        self._last_scale = self.timer.scale  # the factors the last plan was predicted with
        self._rt_seen_s = -math.inf  # when an RT request was last waiting or running
        self._decodes_owed = False  # the last plan ran prompts alone (`split_mixed`)
        self._rt_prompt_tokens = 0.0  # moving mean of RT prompt lengths, tokens
        self._be_time_s = 0.0  # BE's predicted time in recent iterations where it had work
        self._be_window_s = 0.0  # all predicted time of those iterations (decayed alike)
        self.riders = RiderCost()
        """What BE riding in RT iterations really costs against the model (with `rt_stretch`)."""
        self._riding: tuple[float, float] | None = None  # the last plan's (RT part, all) predicted
        self.anticipation = (
            Anticipation(cfg.rt_anticipation_s) if cfg.rt_anticipation_s > 0.0 else None
        )
        """Waits for closed-loop RT clients' next requests (`rt_anticipation_s`; None: off)."""

    def slo_forecaster(self) -> SloForecaster | None:
        """The SLO admission for this policy's engine: chunked to its latency budget L, within
        its `slo_headroom` (None when `slo_admission` is off)."""
        cfg = self.config
        if not cfg.slo_admission:
            return None
        return SloForecaster(
            self.latency,
            iteration_budget_s=cfg.latency_budget_s,
            budget_pace_max=cfg.latency_budget_pace_max if cfg.use_calibration else 1.0,
            headroom=cfg.slo_headroom,
            min_chunk_tokens=cfg.min_chunk_tokens,
            split_min_gain=cfg.split_min_gain if cfg.split_mixed else None,
            pace_averaging=cfg.slo_pace_averaging,
        )

    def latency_factors(self) -> tuple[float, float, float]:
        """The calibration's learned pace (used by the admission even when the plans do not
        use it: `use_calibration` off)."""
        f = self.calibration.factors
        return (f[0], f[1], f[2])

    def plan(self, snapshot: Snapshot) -> Plan:
        cfg = self.config
        self._max_prefill = snapshot.max_prefill_tokens
        view = split_running(snapshot.running, cfg.long_prompt_tokens)
        arrivals = [r for r in self.rt_queue.sync(waiting_in(snapshot, "rt")) if not r.is_probe]
        for r in arrivals:  # a health probe's 1-token prompt is no typical RT prompt
            if self._rt_prompt_tokens == 0.0:
                self._rt_prompt_tokens = float(r.prompt_len)
            self._rt_prompt_tokens += RT_PROMPT_EWMA * (r.prompt_len - self._rt_prompt_tokens)
        self.be_queue.sync(waiting_in(snapshot, "be"))
        self.headroom.update(snapshot.now_s, view.rt_kv_tokens)
        if self.anticipation is not None and (hold := self._hold(snapshot, view, arrivals)):
            return hold
        ctx = self._context(snapshot, view)
        if self._decodes_owed:  # the prompts ran alone last time: now the decodes, alone
            ctx.prefills_allowed = not (view.rt_decode or view.be_decode)
        elif cfg.split_mixed and split_pays(ctx):
            ctx.decodes_allowed = False
        if ctx.decodes_allowed:
            run_rt_decodes(ctx)  # stall-free; hard cap and τ ≤ L from their deadlines
        else:
            defer_rt_decodes(ctx)  # the hard cap leaves the decodes' iteration its time
        cap_for_be_deadlines(ctx)  # τ ≤ the tightest JCT allowance of a running BE
        if ctx.prefills_allowed:
            run_rt_prefills(ctx)  # slack order; urgent ones raise τ; best-fit window; ERA
        # prompts held back for the decodes' half of a split iteration wait by choice, not for time
        ctx.rt_backlog = ctx.prefills_allowed and self._rt_left(ctx, snapshot)
        rt_s = ctx.batch.time_s() if (ctx.batch.decodes or ctx.batch.prefills) else 0.0
        be_has_work = bool(view.be_decode or view.be_partial or len(self.be_queue))
        run_be_phase(ctx)  # BE decodes, partial prompts, admissions in what is left
        rt_known = True  # rt_s is this plan's RT part
        if not (ctx.decodes_allowed or ctx.batch.prefills):
            # the prompts' half found no prompt it could run (KV, slots): the decodes run now
            ctx.decodes_allowed, ctx.prefills_allowed = True, False
            ctx.deferred_rt_decode_s = 0.0
            run_rt_decodes(ctx)
            run_be_phase(ctx)
            rt_known = False
        if not (ctx.batch.decodes or ctx.batch.prefills):
            ensure_progress(ctx)  # never an empty plan while there is work it could run
            rt_known = False
        total_s = ctx.batch.time_s()
        if be_has_work:  # BE's part at what riders really cost (`RiderCost`)
            be_s = (total_s - rt_s) * (ctx.rider_cost if rt_s > 0.0 else 1.0)
            self._note_be_time(rt_s, rt_s + be_s)
        self._riding = (
            (rt_s, total_s)
            if cfg.rt_stretch is not None and rt_known and 0.0 < rt_s < total_s
            else None
        )
        self._decodes_owed = not ctx.decodes_allowed and bool(ctx.batch.prefills)
        self.feedback.expect(ctx.batch.rt_deadline_s, ctx.batch.rt_allowance_s)
        self._charge_served()
        plan = ctx.batch.plan()
        self._last_plan, self._last_scale = plan, self.timer.scale
        return plan

    def _hold(self, snap: Snapshot, view: RunningView, arrivals: list[ReqState]) -> Plan | None:
        """The anticipation's wait (`rt_anticipation_s`): an empty plan that holds BE back for
        an RT request expected any moment, or None."""
        anticipation = self.anticipation
        assert anticipation is not None
        rt_around = any(not r.is_probe for r in view.rt_running) or any(
            not r.is_probe for r in self.rt_queue.known.reqs.values()
        )
        anticipation.note(snap.now_s, arrivals, rt_around)
        if rt_around or not (view.be_running or len(self.be_queue)):
            return None
        until_s = anticipation.hold_until_s(snap.now_s)
        if until_s is None:
            return None
        plan = Plan(hold_until_s=until_s)
        self._last_plan = plan
        return plan

    def observe(self, result: IterationResult) -> None:
        """Calibration and AIMD feedback; finished output lengths feed the admission's
        history."""
        self._calibrate(result)
        if self._riding is not None and result.plan is self._last_plan:
            self.riders.observe(*self._riding, result.duration_s)
        self.feedback.observe(result)
        for done in result.finished:
            self.lengths.observe(done.rid, done.length_key, done.output_len)

    def _calibrate(self, result: IterationResult) -> None:
        """Feeds the model's own prediction of the plan that ran (its `predicted_s` less the
        factor it was planned with) and the measured time to the calibration; the new factors
        scale the next plans' predictions."""
        plan = result.plan
        if plan.predicted_s is None:
            return
        regime = regime_of(len(plan.prefills), len(plan.decodes))
        factor = self.plan_factor(plan)
        self.calibration.observe(plan.predicted_s / factor, result.duration_s, regime)
        self.pace_spread.observe(plan.predicted_s, result.duration_s, regime, factor)
        if self.config.use_calibration:
            self.timer.scale = self.calibration.factors

    def plan_factor(self, plan: Plan) -> float:
        """The calibration factor *plan*'s `predicted_s` was scaled with (its batch regime's,
        as the factors were when it was planned): the prediction ÷ it is the profile's own."""
        scale = self._last_scale if plan is self._last_plan else self.timer.scale
        return scale[regime_of(len(plan.prefills), len(plan.decodes))]

    def _context(self, snap: Snapshot, view: RunningView) -> PlanContext:
        cfg = self.config
        capacity = snap.kv_capacity_tokens
        rt_limit = capacity * (1.0 - cfg.reserve_frac)
        be_limit = rt_limit - self.headroom.tokens(capacity, view.rt_kv_tokens)
        admission = AdmissionRound(
            self.lengths,
            view.rt_running,
            view.be_running,
            page=snap.page_size,
            rt_limit=rt_limit,
            be_limit=be_limit,
        )
        has_rt = bool(view.rt_decode or view.rt_partial or len(self.rt_queue))
        if has_rt and any(
            not r.is_probe
            for r in itertools.chain(view.rt_decode, view.rt_partial, waiting_in(snap, "rt"))
        ):
            # Only tenants' RT requests open the RT-active window: SGLang's health probe (a
            # 1-token RT request every few seconds from the supervisor) held BE-alone
            # iterations to a few ms for the 10 s after each one.
            self._rt_seen_s = snap.now_s
        return PlanContext(
            now_s=snap.now_s,
            config=cfg,
            timer=self.timer,
            batch=TandemBatch(
                snap,
                self.timer,
                min_chunk_tokens=cfg.min_chunk_tokens,
                least_chunk_stretch=cfg.least_chunk_stretch,
                on_tokens=self._charge if cfg.use_fair_share else None,
            ),
            view=view,
            admission=admission,
            lengths=self.lengths,
            rt_queue=self.rt_queue,
            be_queue=self.be_queue,
            eps=self.feedback.eps,
            be_frac=self.feedback.be_frac,
            max_prefill=snap.max_prefill_tokens,
            has_rt=has_rt,
            be_time_share=self._be_time_share(),
            rider_cost=self.riders.factor if cfg.rt_stretch is not None else 1.0,
            budget_s=self._rt_budget_s() if has_rt else self._be_alone_budget_s(snap.now_s),
            deadline_spread=self._deadline_spread() if cfg.deadline_spread else 1.0,
        )

    def _deadline_spread(self) -> float:
        """`PlanContext.deadline_spread`: the recent iterations' p90 of measured ÷ predicted,
        ≥ 1, and exactly 1 within the calibration's tolerance (two evaluations of the same
        model may differ in the last bit: an engine that runs as predicted plans as before)."""
        spread = self.pace_spread.upper(self.timer.scale)
        return spread if spread > 1.0 + self.calibration.exact_tol else 1.0

    def _rt_left(self, ctx: PlanContext, snapshot: Snapshot) -> bool:
        """Some RT prompt work is left after the RT phase: a tenant's request (health probes
        aside) waiting, started or mid-prefill whose prompt this plan does not finish."""
        chunks = {c.rid: c.tokens for c in ctx.batch.prefills}
        return any(
            not r.is_probe and r.prefill_len - r.prefilled > chunks.get(r.rid, 0)
            for r in itertools.chain(ctx.view.rt_partial, waiting_in(snapshot, "rt"))
        )

    def _note_be_time(self, rt_s: float, total_s: float) -> None:
        """A planned iteration in which BE had work: `total_s` predicted, `rt_s` of it RT's.
        Keeps BE's share of such time over about the last BE_SHARE_WINDOW_S of it."""
        if total_s <= 0.0:
            return
        keep = math.exp(-total_s / BE_SHARE_WINDOW_S)
        self._be_time_s = keep * self._be_time_s + max(0.0, total_s - rt_s)
        self._be_window_s = keep * self._be_window_s + total_s

    def _be_time_share(self) -> float:
        """BE's recent share of the predicted engine time while it had work (1 before any)."""
        return self._be_time_s / self._be_window_s if self._be_window_s > 0.0 else 1.0

    def _rt_budget_s(self) -> float:
        """L, stretched by the engine's learned pace (`latency_budget_pace_max`)."""
        cfg = self.config
        return cfg.latency_budget_s * budget_pace(self.timer.scale, cfg.latency_budget_pace_max)

    def _be_alone_budget_s(self, now_s: float) -> float:
        """The budget of an iteration with no RT request around: `idle_budget_s`, or, within
        `rt_active_window_s` of the last RT request (with `rt_stretch` set), what a typical RT
        prompt's own first iteration takes (× `rt_active_be_frac`) — the next RT arrival waits
        for the iteration in flight (half of it on average), so BE-alone iterations no longer
        than its own keep its TTFT within about 1.5× of what it gets on an idle engine."""
        cfg = self.config
        if cfg.rt_stretch is None or now_s - self._rt_seen_s > cfg.rt_active_window_s:
            return cfg.idle_budget_s
        prompt = max(1, round(self._rt_prompt_tokens))
        rt_first_s = self.timer.with_chunk(BatchTotals(), prompt, 0)
        return min(cfg.idle_budget_s, cfg.rt_active_be_frac * rt_first_s)

    def _charge(self, reqs: Sequence[ReqState], tokens: int) -> None:
        """`tokens` of each of `reqs` are scheduled: noted for their tenants (charged by
        `_charge_served`)."""
        served = self._served
        for r in reqs:
            key = (r.tier, r.tenant_id)
            served[key] = served.get(key, 0.0) + tokens / r.tenant_weight

    def _charge_served(self) -> None:
        """The plan's tokens go to their tenants' counters (already divided by the weight)."""
        for (tier, tenant), weighted in self._served.items():
            (self.rt_fair if tier == "rt" else self.be_fair).charge(tenant, weighted)
        self._served.clear()

    def _rt_latest_start(self, r: ReqState) -> float:
        """Queue key of a waiting RT request: its deadline less the time its prompt takes
        alone on the engine (fixed while it waits)."""
        left = r.prefill_len - r.prefilled
        return slack.rt_deadline(r) - slack.standalone_prefill_s(
            self.timer, left, r.prefilled, self._max_prefill
        )

    def _be_latest_start(self, r: ReqState) -> float:
        """Queue key of a waiting BE request with a deadline: the deadline less its standalone
        JCT (prefill, then the predicted output at single-request decode speed)."""
        assert r.deadline_due_s is not None
        total = int(self.lengths.sample([r], 1)[0, 0])
        left = r.prefill_len - r.prefilled
        prefill = slack.standalone_prefill_s(self.timer, left, r.prefilled, self._max_prefill)
        step = self.timer.with_decodes(BatchTotals(), 1, r.prompt_len + total // 2)
        return r.deadline_due_s - prefill - max(0, total - r.generated) * step

    def _be_hopeless(self, r: ReqState, now_s: float) -> bool:
        """A waiting BE request cannot meet its deadline at the engine's current pace (its
        prompt alone, then its predicted output at the recent mean iteration time)."""
        if r.deadline_due_s is None:
            return False
        total = int(self.lengths.totals([r])[0])
        left = r.prefill_len - r.prefilled
        prefill = slack.standalone_prefill_s(self.timer, left, r.prefilled, self._max_prefill)
        pace = max(
            self.feedback.iteration_s,
            self.timer.with_decodes(BatchTotals(), 1, r.prompt_len + total // 2),
        )
        return r.deadline_due_s - now_s < prefill + max(0, total - r.generated) * pace
