"""Can an RT request's contract still be met if it is admitted now? — the SLO admission's forecast.

The gateway asks before a request reaches the engine (gateway/pipeline/admission.py), the
simulator's front door asks on every RT arrival (backend/sim); both read the engine's live
state (`common.wire.EngineLoad`: queues, running RT, KV, the calibration's pace) and predict, with
the same latency model the engine's policy plans with, corrected by that pace:

    TPOT  one decode iteration of every RT request that will be decoding beside it — the running
          ones, the waiting ones and those admitted but not yet seen by the engine, and it:
              f_decode × predict(decodes only)
          tandem gives BE only the time RT leaves under its deadlines, so BE does not count;
          a TPOT the RT decodes alone cannot keep, no schedule keeps. It is stretched by the
          engine's recent worst pace and held to the headroom, as a TTFT is, though a TPOT is
          a mean over many iterations: what the decodes leave of their target is the time RT
          prompts get beside them, which the TTFT forecast assumes. Tried on the real engine
          slowed on purpose (bench/results/slo/README.md, session 48): the median pace for
          the TPOT served 11 % more RT requests in SLO at 2×, and 5 admitted ones waited
          1.7–3 s for their first token (admitted attainment 1.000 → 0.982); the whole
          headroom's square root besides admitted 21 requests after a 3× step, 18 of which
          waited 10–20 s in the engine's queue behind decodes that took every iteration. Tried
          again once the prompts no longer starved there (session 49): at 2× four admitted
          requests then missed their TPOT (forecast 160 ms, got 370–460 ms); not kept.

    TTFT  what is left of the iteration in flight, then the RT prompt tokens W ahead of it
          (below) and its own prompt, computed in chunks beside those decodes:
              left + ⌈W / c⌉ × f_mixed × predict(decodes + chunk c)
          where c is the largest chunk whose iteration stays within the per-iteration budget
          (`iteration_budget_s`, the policy's τ; the request's own TPOT target when smaller,
          and (1 − ε) of the running decodes' tightest TPOT target, `rt_tpot_target_min_s`:
          the policy's hard cap), capped by the engine's max prefill. Where the engine runs
          prompts in an iteration of their own (`split_min_gain`), a cycle is that iteration
          and the decodes' own, both within that cap: the prompts get what the decodes leave
          of it (tandem's `split_pays`), however large the budget. Sized to the budget alone,
          the forecast had the prompts computing several times what the engine gave them
          once the decodes took most of their TPOT (the real engine 3× slower than planned,
          bench/results/slo/README.md, session 49).
          left is the in-flight iteration's predicted time
          (`EngineLoad.inflight_predicted_s`) less what has run since the report
          (`inflight_left_s`; the last measured iteration from an engine that does not report
          it). RT prompts are served before any BE prompt, so BE's queue does not count
          either; its running decodes and chunks do, through the iteration in flight. A
          prompt whose prefix the engine's cache holds (`SloAsk.cached_tokens`: a
          conversation's history) computes only the rest, in chunks that attend to that
          prefix: each is predicted at its place after it.

    W     the RT prompt work weighted fair share serves before it (`work_ahead`). The
          engine offers a tier's waiting prompts tenant by tenant, least served first (virtual
          token counters: tokens ÷ weight, backend/policy/fair_share.py), so a request of
          tenant T waits for T's own waiting prompts (the engine's and the gateway's backlog),
          its own, and of every other tenant U only as much as U's share of that:
              own = waiting_T + backlog_T + prompt
              W   = own + Σ_U min(waiting_U + backlog_U, own × w_U / w_T)
          — and the whole share own × w_U / w_T for a U with requests decoding: an active
          tenant keeps sending while this request waits, and its new prompts (its counter
          level with T's) are served before T's up to that share, so this bounds W whatever U
          sends. A tenant sending more than its share therefore sees its own queue and is shed
          first, while the others' requests still fit; with equal weights and equal backlogs
          of idle tenants W is the whole queue, as without tenants. RT work the report does
          not attribute to a tenant (an engine that does not split it, a backlog given as
          totals) counts in full.
          The engine's counters also carry what each tenant was served (its decodes
          included), so each share moves by the counters' gap: a U whose counter c_U is
          below c_T is served w_U × (c_T − c_U) more first (`TenantLoad.fair_counter`, lifted
          as the engine lifts a tenant back from idle). And while T waits its own running
          decodes keep charging it: each iteration a U decoding less than its share of T's
          is owed g = w_U × (D_T / w_T − D_U / w_U) prompt tokens more, so W is computed at
          c − g of every chunk c (`WorkAhead.drift_tokens`). Without these, a tenant whose
          decodes had taken its share while another burst was admitted on the split alone
          and then waited, late, for the other to catch up (W6 at 1.5–2 λ*: the steady
          tenant's admitted attainment 0.990, its token share 0.43–0.46 while both queued;
          with them 0.998–0.999 and 0.50).

          A waiting request already past its TTFT deadline is ahead of no one: tandem serves
          it after every request that can still meet its own (`load_of`), or earlier only in
          the time they can spare within the headroom of their targets, which an admitted
          forecast stays within anyway (`tandem.queues.PromptPace`). One far past it (more
          than its target: `rt_late_bound_frac`) does go first, one an iteration, and counts
          as ahead of every new request (`load_of`).

    slot  a prompt also needs one of the engine's request slots (`max_running_requests`). BE
          gives its slots up to RT, so only RT's count: while the slots RT does not hold cover
          the RT prompts queued ahead of it (the queued requests in W's share of the queued
          prompt work) and it, there is no wait; else the excess k RT requests must finish
          first. The engine reports within how many decode steps k of its running RT decodes
          will have finished, at a high quantile (`RtOutputs.slots_free_steps`: each one's
          length drawn from the RT outputs it saw lately, L > g, at most its max_new_tokens),
          and that, at the decodes' step time, is the wait; the prompt starts after it:
              TTFT ≥ left + steps_k × f_decode × predict(decodes) + its own prompt
          Without it, a bursting tenant's requests were admitted on the prompt work alone
          while every slot was RT's, and waited 2-4 s for one (W6 on the real engine, 64
          slots: 25 of its 249 admitted requests late).

A forecast is compared with the time the request has left (its target less the time it already
waited) times `headroom` (< 1: the forecast is a mean, the SLO a bound): over it, the request
misses, and `Shortfall` says which target, the predicted time and by how much. The headroom is
for what the forecast guesses. The time already waited is spent: it is taken whole. A slot wait
is a count of decode steps (when the running requests will have left the slot), at the
engine's pace now and a part of its recent worst that shrinks with their number (`pace_stretch`):
a sum of many iterations, it strays less from its forecast than a prompt's few, and it gets the
square root of the headroom. The rest must
stay within the headroom of what those leave:
    waited + slot ÷ √headroom + rest ÷ headroom ≤ target
In the simulator's slot-bound stream (8 slots, 20 arrivals a second,
tests/unit/test_feasibility.py) the admitted requests' slot-bound TTFT came within 0.78–1.06×
of the forecast. With the slot wait under the whole headroom, the real engine's W1 refused a
tenth of its requests (64 slots, all RT's: forecast 1,070 ms p50, 829 ms of it the slot wait,
against the 975 ms of 0.65 × 1,500 ms) while the admitted ones got their first token within
1,196 ms. Taken whole, the slot wait admitted requests whose forecast came within 2 % of the
target, and a request a few ms late is served after every one still on time: in that stream,
7–9 s late.

Pure: no I/O, no clock; the caller passes what it knows.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import msgspec
import numpy as np

from backend.policy.calibration import DECODE, MIXED, PREFILL, budget_pace
from backend.policy.latency import BatchShape, LatencyModel
from backend.policy.types import ReqState, Snapshot
from common.wire import EngineLoad, TenantLoad

Target = Literal["ttft", "tpot"]

MAX_DRIFT = 16.0
"""Most a tenant's own decodes can stretch the prompt work ahead of its ask
(`WorkAhead.drift_tokens`): when they take all the fair share of every iteration, its prompt
starts only as they finish, which no forecast from one state sees; ×16 is past any TTFT
target's budget."""


# The values one forecast builds (its ask, backlog, forecast and shortfall; placement's and the
# gateway's admission values likewise) are frozen msgspec Structs, not dataclasses: built and
# replaced in C, at a tenth of a frozen dataclass's cost. The gateway's admission builds about
# ten of them per request within its 50 µs budget (bench/results/admission_cost).
class SloAsk(msgspec.Struct, frozen=True):
    """An RT request's contract, size and tenant, as the admission sees it."""

    prompt_tokens: int
    ttft_target_s: float
    """Time to first token, seconds from arrival."""
    tpot_target_s: float | None = None
    """Time per output token after the first, seconds; None: no TPOT target."""
    waited_s: float = 0.0
    """Time already spent since arrival (parsing, tokenising, the gateway's own queue)."""
    tenant_id: str = ""
    """The tenant it is served for (its fair-share lane; "" is the anonymous tenant)."""
    weight: float = 1.0
    """The tenant's fair-share weight within the RT tier (> 0; from its contract)."""
    cached_tokens: int = 0
    """Tokens before its prompt that its engine's prefix cache holds (a conversation's
    history; `prompt_tokens` counts only what is left to compute): its chunks attend to them,
    which costs more the longer they are (on a backend that recomputes the prefix's attention
    rows, as much as computing them)."""
    at_s: float | None = None
    """When it is judged, on the clock of the engine reports' `at_unix_s` (the gateway's wall
    clock, the engine on the same host; the simulator's clock): what has run of the iteration
    in flight since the report is not waited for again. None: as at the report's instant."""


class Backlog(msgspec.Struct, frozen=True):
    """RT work admitted but not yet in the engine's reported state (in flight to it)."""

    num_requests: int = 0
    prompt_tokens: int = 0
    by_tenant: tuple[TenantLoad, ...] = ()
    """The same split by tenant (what of the totals no entry claims counts as ahead of every
    request: a backlog known as totals only)."""


NO_BACKLOG = Backlog()
"""Nothing in flight to the engine (the default wherever a backlog is optional)."""


class Shortfall(msgspec.Struct, frozen=True):
    """The target a forecast misses, and by how much."""

    target: Target
    target_s: float
    """The contract's target (TTFT from arrival, or TPOT), seconds."""
    predicted_s: float
    """What the forecast says the request would get, seconds."""
    retry_after_s: float
    """When asking again may succeed, seconds (≥ 1): the time the queue ahead needs to drain
    by the excess (TTFT), or a second for the running RT decodes to thin out (TPOT)."""
    budget_s: float | None = None
    """What the forecast had to stay within, seconds: the time waited, and the forecaster's
    headroom of the rest of the target (the forecast is a mean, the target a bound; a slot wait
    within its square root); None: the target itself."""
    slot_wait_s: float = 0.0
    """Of the predicted TTFT, the time waiting for a request slot (every slot held by RT
    requests: the module doc's slot wait), seconds; 0: no such wait."""

    @property
    def waits_for_slot(self) -> bool:
        """A TTFT miss with a wait for a request slot in it: a wait the engine's next state may
        shorten (its slots free one at a time, where the forecast averages), so the SLO
        admission may judge the request again before answering (`slo_recheck_frac`)."""
        return self.target == "ttft" and self.slot_wait_s > 0.0

    @property
    def over_s(self) -> float:
        """How far the forecast is over what it had to stay within, seconds (> 0)."""
        return self.predicted_s - (self.target_s if self.budget_s is None else self.budget_s)

    def describe(self) -> str:
        """One sentence naming the target and the excess, for an error message."""
        name = "time to first token" if self.target == "ttft" else "time per output token"
        within = ""
        if self.budget_s is not None and self.budget_s != self.target_s:
            within = (
                f" against the {self.budget_s * 1000:.0f} ms a forecast must stay within "
                "to keep the target (the forecast is a mean, the target a bound)"
            )
        slot = ""
        if self.slot_wait_s > 0.0:
            slot = (
                f", {self.slot_wait_s * 1000:.0f} ms of it waiting for one of the engine's "
                "request slots (all held by RT requests)"
            )
        return (
            f"the {name} target of {self.target_s * 1000:.0f} ms cannot be met at the engine's "
            f"current load: predicted {self.predicted_s * 1000:.0f} ms{within}{slot} "
            f"({self.over_s * 1000:.0f} ms over)"
        )


class Forecast(msgspec.Struct, frozen=True):
    """Predicted TTFT (from arrival, the time already waited included) and TPOT of an ask."""

    ttft_s: float
    tpot_s: float | None
    shortfall: Shortfall | None
    """None: both targets are predicted to hold (within the headroom)."""
    ttft_budget_s: float
    """What `ttft_s` may reach for the TTFT target to hold, seconds (the time waited, and the
    headroom of the rest of the target: the module doc)."""
    slot_wait_s: float = 0.0
    """The part of `ttft_s` spent waiting for a request slot (every one held by RT requests),
    seconds; 0: a slot is free for it, or the prompt work ahead takes longer."""
    slot_wait_scale: float = 1.0
    """The scale outcomes had taught the slot wait (`TtftFeedback.slot_wait_scale`), already in
    `slot_wait_s`."""
    slot_step_s: float = 0.0
    """The pace the slot wait was forecast at: seconds per decode step, before the scale (the
    step at the engine's pace, stretched by `pace_stretch`); 0 with no slot wait. What the
    engine's iterations then took, against this, teaches the scale (`TtftFeedback.observe`)."""

    @property
    def feasible(self) -> bool:
        return self.shortfall is None


class SloForecaster:
    """Forecasts an RT request's TTFT and TPOT from an `EngineLoad` (see the module doc)."""

    def __init__(
        self,
        latency: LatencyModel,
        *,
        iteration_budget_s: float = 0.05,
        budget_pace_max: float = 1.0,
        headroom: float = 0.85,
        min_chunk_tokens: int = 64,
        split_min_gain: float | None = None,
        pace_averaging: bool = True,
    ) -> None:
        if not 0.0 < headroom <= 1.0:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        if iteration_budget_s <= 0.0:
            raise ValueError(f"iteration_budget_s must be > 0, got {iteration_budget_s}")
        self.latency = latency
        self.iteration_budget_s = iteration_budget_s
        """Per-iteration time the RT prompts are chunked to (the policy's τ), seconds."""
        self.budget_pace_max = budget_pace_max
        """The budget follows the engine's learned pace up to this factor, as the policy's
        does (`calibration.budget_pace`; 1: wall seconds)."""
        self.headroom = headroom
        """Fraction of the time left that a forecast may use."""
        self.min_chunk_tokens = min_chunk_tokens
        """Smallest chunk assumed per iteration (the policy raises τ for urgent prompts rather
        than starve them), tokens."""
        self.split_min_gain = split_min_gain
        """The engine's policy runs prompts and decodes in iterations of their own where the
        model says that is this fraction faster (tandem's `split_mixed`); None: never."""
        self.pace_averaging = pace_averaging
        """A request slot's wait of many decode steps is stretched by `pace_stretch` (the pace
        now, and the recent p90's noise over the square root of their number); False: by the
        p90 whole."""
        self._chunks: dict[tuple[int, int, float, float, int], int] = {}
        self._last_chunk: dict[tuple[float, float, int], int] = {}
        self._splits: dict[tuple[float, ...], tuple[int, float] | None] = {}
        # The chunk is a search over the latency model (a binary search is ~15 predictions,
        # most of a forecast's cost) that depends on the engine's state and the budget only, not
        # on the ask: every request forecast on one state (all those arriving within one
        # iteration) shares it — memoised, exactly, and cleared when it grows. A new state's
        # chunk starts from the last one found for the same budget (contexts grow a token per
        # decode per iteration, so it barely moves): two predictions when it did not move.

    def forecast(
        self,
        load: EngineLoad,
        ask: SloAsk,
        backlog: Backlog = NO_BACKLOG,
        ttft_extra_s: float = 0.0,
        slot_wait_scale: float = 1.0,
    ) -> Forecast:
        """The ask's predicted TTFT and TPOT on an engine in state *load*; *ttft_extra_s* is
        added to the TTFT (`TtftFeedback.extra_s`: what the engine model does not see), and a
        request slot's wait is scaled by *slot_wait_scale* (`TtftFeedback.slot_wait_scale`: how
        much shorter the slot waits forecast on this engine came out).

        On an idle engine (nothing running, waiting or in flight to it) a forecast that misses
        does not refuse on what no iteration can re-check there: an unverified model
        (`unverified_and_idle`) admits the request, and so does one that misses only by the
        pace learned earlier — the request is judged at the profile's own pace (factors above 1
        and the spread dropped). Refusing would otherwise be for good: an idle engine runs
        nothing that could correct the model (a profile measured on a busy machine, the slow
        first iterations of a fresh engine), and the request would run alone, the best the
        engine can do for it, while its iterations re-check the pace. What it has already
        waited, and what outcomes taught, are measured: they count either way; a contract the
        profile's own pace misses is refused."""
        # The calibrated factors are means; the engine's recent worst pace (but one iteration
        # in ten) bounds them from above while the pace changes or swings (`PaceSpread`). The
        # engine's policy sizes its chunks with the factors; the spread stretches their time.
        spread = max(1.0, load.pace_ratio_p90) if math.isfinite(load.pace_ratio_p90) else 1.0
        pace_now = load.pace_ratio_recent_mean if self.pace_averaging else None
        if pace_now is not None and not math.isfinite(pace_now):
            pace_now = None
        ttft_s, tpot_s, slot_wait_s, slot_step_s = self._predict(
            load, ask, backlog, load.latency_factors, spread, pace_now, slot_wait_scale
        )
        ttft_s += ask.waited_s + ttft_extra_s
        budget_s = self._ttft_budget_s(ask, slot_wait_s)
        shortfall = self._shortfall(ask, ttft_s, tpot_s, budget_s)
        if shortfall is not None and shortfall.target == "ttft" and slot_wait_s > 0.0:
            shortfall = msgspec.structs.replace(shortfall, slot_wait_s=slot_wait_s)
        if shortfall is not None and idle(load, backlog):
            at_pace: tuple[float, float | None]
            if load.calibration_samples < MIN_VERIFIED_ITERATIONS:
                at_pace = (ask.waited_s + ttft_extra_s, None)  # the model is the profile's word
            else:
                factors = tuple(min(1.0, f) for f in load.latency_factors)
                ttft_at, tpot_at, _, _ = self._predict(load, ask, backlog, factors, 1.0)
                at_pace = (ttft_at + ask.waited_s + ttft_extra_s, tpot_at)
            if self._shortfall(ask, *at_pace, self._ttft_budget_s(ask, 0.0)) is None:
                shortfall = None
        return Forecast(
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            shortfall=shortfall,
            ttft_budget_s=budget_s,
            slot_wait_s=slot_wait_s,
            slot_wait_scale=slot_wait_scale,
            slot_step_s=slot_step_s,
        )

    def _predict(
        self,
        load: EngineLoad,
        ask: SloAsk,
        backlog: Backlog,
        factors: tuple[float, ...],
        spread: float,
        pace_now: float | None = None,
        slot_wait_scale: float = 1.0,
    ) -> tuple[float, float | None, float, float]:
        """(TTFT from now, before what was waited and taught; TPOT or None; the part of the TTFT
        spent waiting for a request slot; the seconds per decode step of that wait before
        *slot_wait_scale*, 0 without one) at the engine's pace *factors* (decode, prefill,
        mixed), stretched by *spread* (the recent p90), a request slot's wait of many decode
        steps by `pace_stretch` of *spread* and *pace_now* (None: by *spread*) and by
        *slot_wait_scale*."""
        f_decode, f_prefill, f_mixed = factors[DECODE], factors[PREFILL], factors[MIXED]
        running = _decodes(load.num_rt_running, load.rt_context_tokens)
        # Everyone ahead decodes beside it once prefilled: contexts of about their prompts.
        # (All of them, whatever their tenant: fair share orders prompts, not who decodes.)
        later = load.num_rt_waiting + backlog.num_requests + 1
        later_tokens = load.rt_waiting_prompt_tokens + backlog.prompt_tokens + ask.prompt_tokens
        decoding = _decodes(load.num_rt_running + later, load.rt_context_tokens + later_tokens)
        tpot_s = spread * f_decode * self.latency.predict(decoding) if ask.tpot_target_s else None

        budget_s = self.iteration_budget_s * budget_pace(factors, self.budget_pace_max)
        if ask.tpot_target_s is not None:
            budget_s = min(budget_s, ask.tpot_target_s)
        # the running decodes' next tokens bound every iteration beside them (the policy's hard
        # cap: (1 − ε) of the time to the next one due, a TPOT after the last)
        decode_bound_s = math.inf
        if running.num_decode and load.rt_tpot_target_min_s is not None:
            decode_bound_s = (1.0 - load.rt_decode_margin) * load.rt_tpot_target_min_s
        budget_s = min(budget_s, decode_bound_s)
        f_chunk = f_mixed if running.num_decode else f_prefill
        chunk = self._chunk(running, budget_s, f_chunk, load)

        # with `split_mixed` the engine may run the prompts alone, the decodes after them
        split_decode_s: float | None = None
        if self.split_min_gain is not None and running.num_decode:
            split = self._split(running, budget_s, factors, load, decode_bound_s)
            if split is not None:
                chunk, split_decode_s = split

        def cycle_s(tokens: int, prefix: int = 0) -> float:
            """The iterations that compute *tokens* of prompt work after *prefix* tokens of
            KV, with the decodes' step."""
            if split_decode_s is None:
                return f_chunk * self.latency.predict(running.with_prefill(tokens, prefix))
            prompt = BatchShape().with_prefill(tokens, prefix)
            return f_prefill * self.latency.predict(prompt) + split_decode_s

        def prefill_s(tokens: int) -> float:
            full, rest = divmod(tokens, chunk)
            return full * cycle_s(chunk) + (cycle_s(rest) if rest else 0.0)

        work, drift = work_ahead(load, ask, backlog)
        ahead_tokens = work
        if drift > 0.0:  # n iterations serve n × chunk prompt tokens, n × drift of them owed
            ahead_tokens = math.ceil(ahead_tokens * chunk / max(chunk - drift, chunk / MAX_DRIFT))
        # The prompt work ahead: a few chunks, each at the recent p90. Averaged like a slot
        # wait (`pace_stretch`), the simulator's W1 with log-normal noise σ 0.3 admitted more
        # that then missed (admitted attainment 0.9959 against 0.9981 with a 1→3 slowdown) and
        # carried no more RT in SLO: not kept.
        ttft_s = spread * prefill_s(ahead_tokens)
        if ask.cached_tokens > 0:  # its own chunks attend to the cached prefix as well
            done = 0
            while done < ask.prompt_tokens:
                c = min(chunk, ask.prompt_tokens - done)
                ttft_s += spread * (cycle_s(c, ask.cached_tokens + done) - cycle_s(c))
                done += c
        slot_wait_s = slot_step_s = 0.0
        slot_steps = self._slot_wait_steps(load, ask, backlog, work)
        if slot_steps:  # its prompt starts once a slot is its, whatever was computed by then
            iterations = slot_steps + math.ceil(ask.prompt_tokens / chunk)
            stretch = pace_stretch(spread, pace_now, iterations)
            slot_step_s = stretch * f_decode * self.latency.predict(running)
            slot_wait_s = slot_wait_scale * slot_steps * slot_step_s
            after_slot_s = slot_wait_s + stretch * prefill_s(ask.prompt_tokens)
            if after_slot_s > ttft_s:
                ttft_s = after_slot_s
            else:
                # the prompts ahead take longer: the slot is not what it waits for
                slot_wait_s = slot_step_s = 0.0
        return inflight_left_s(load, ask.at_s, spread) + ttft_s, tpot_s, slot_wait_s, slot_step_s

    @staticmethod
    def _slot_wait_steps(load: EngineLoad, ask: SloAsk, backlog: Backlog, work_tokens: int) -> int:
        """The decode steps the ask waits for a request slot (the module doc's slot wait): 0
        while the slots RT does not hold cover the RT prompts queued ahead of it and it; else
        the excess k RT requests must finish first, which takes the k-th fewest steps left of
        the running RT decodes (`EngineLoad.rt_decode_steps_left`). The requests ahead are the
        queued ones in the share of the queued prompt work that fair share serves first
        (`work_ahead`)."""
        cap = load.max_running_requests
        if cap <= 0:
            return 0
        free = cap - load.num_rt_running - load.num_rt_prefilling
        queued = max(0, load.num_rt_waiting - load.num_rt_prefilling) + backlog.num_requests
        if queued + 1 <= free:
            return 0
        others_tokens = load.rt_waiting_prompt_tokens + backlog.prompt_tokens
        share = min(1.0, max(0, work_tokens - ask.prompt_tokens) / max(1, others_tokens))
        excess = math.ceil(queued * share) + 1 - free
        steps = load.rt_decode_steps_left
        if excess <= 0 or not steps:
            return 0  # no RT decode holds a slot: prefilling prompts hold them, ahead of it
        rounds, within = divmod(excess - 1, len(steps))
        # Past the reported ones the slots turn over: the one freed after steps[within] frees
        # again a whole request later. Those not reported have more steps left than the last
        # reported; with every running decode reported, the slots are taken by requests that
        # start then and run a new request's length (`rt_new_decode_steps`) — requests that
        # started together can all be near their end (8 slots: 36 steps left at most, where the
        # next ones ran 150).
        turnover = steps[-1]
        if len(steps) >= load.num_rt_running:
            turnover = max(turnover, load.rt_new_decode_steps)
        return rounds * turnover + steps[within]

    def _split(
        self,
        running: BatchShape,
        budget_s: float,
        factors: tuple[float, ...],
        load: EngineLoad,
        decode_bound_s: float = math.inf,
    ) -> tuple[int, float] | None:
        """(the prompts' chunk alone, the decodes' iteration after it, seconds) when the model
        says prompts and decodes run clearly faster apart (`split_min_gain`), else None.

        The two iterations together stay within *decode_bound_s* (the running decodes' next
        tokens: tandem's `split_pays` sizes the prompts' iteration to what the decodes' own
        leaves of it). Sized to the budget alone, the forecast had the prompts computing several
        times what the engine gave them once the decodes took most of their TPOT (W1 on the
        real engine 3× slower than planned: admitted first tokens 2-4 s late). No chunk left:
        no split (the prompts run beside the decodes, or wait). Memoised like the chunk: it
        depends on the state and the budget, not on the ask."""
        assert self.split_min_gain is not None
        f_decode, f_prefill, f_mixed = factors[DECODE], factors[PREFILL], factors[MIXED]
        cap = max(1, load.max_prefill_tokens)
        key = (running.num_decode, running.decode_context, budget_s, decode_bound_s, *factors, cap)
        if key in self._splits:
            return self._splits[key]
        decode_s = f_decode * self.latency.predict(running)
        room_s = min(budget_s, decode_bound_s - decode_s)
        alone = (
            largest_chunk(self.latency, BatchShape(), room_s / f_prefill, cap, None)
            if room_s > 0.0
            else 0
        )
        split: tuple[int, float] | None = None
        if alone >= 1:
            apart_s = f_prefill * self.latency.predict(BatchShape().with_prefill(alone))
            mixed_s = f_mixed * self.latency.predict(running.with_prefill(alone))
            if apart_s + decode_s <= (1.0 - self.split_min_gain) * mixed_s:
                split = (alone, decode_s)
        if len(self._splits) >= _MAX_MEMO:
            self._splits.clear()
        self._splits[key] = split
        return split

    def _chunk(self, running: BatchShape, budget_s: float, factor: float, load: EngineLoad) -> int:
        """Prompt tokens one iteration computes beside the running RT decodes within the budget."""
        cap = max(1, load.max_prefill_tokens)
        key = (running.num_decode, running.decode_context, budget_s, factor, cap)
        chunk = self._chunks.get(key)
        if chunk is None:
            hint = self._last_chunk.get(key[2:])
            fitting = largest_chunk(self.latency, running, budget_s / factor, cap, hint)
            self._last_chunk[key[2:]] = fitting
            chunk = max(fitting, min(self.min_chunk_tokens, cap))
            if len(self._chunks) >= _MAX_MEMO:
                self._chunks.clear()
                self._last_chunk.clear()
            self._chunks[key] = chunk
        return chunk

    def _ttft_budget_s(self, ask: SloAsk, slot_wait_s: float) -> float:
        """What a TTFT forecast may reach (the module doc): the time waited whole, the slot
        wait *slot_wait_s* within the square root of the headroom, and the headroom of what
        they leave of the target for the rest."""
        left_s = ask.ttft_target_s - ask.waited_s - slot_wait_s / math.sqrt(self.headroom)
        if left_s <= 0.0:  # the slot wait alone is over what it may take
            after_wait_s = max(0.0, ask.ttft_target_s - ask.waited_s)
            return min(ask.ttft_target_s, ask.waited_s + math.sqrt(self.headroom) * after_wait_s)
        return ask.waited_s + slot_wait_s + self.headroom * left_s

    def _shortfall(
        self, ask: SloAsk, ttft_s: float, tpot_s: float | None, budget_s: float
    ) -> Shortfall | None:
        if ttft_s > budget_s:
            # Retry once the queue ahead has drained by the excess.
            over_s = ttft_s - budget_s
            return Shortfall("ttft", ask.ttft_target_s, ttft_s, _retry_after(over_s), budget_s)
        tpot_target_s = ask.tpot_target_s
        if (
            tpot_s is not None
            and tpot_target_s is not None
            and tpot_s > self.headroom * tpot_target_s
        ):
            return Shortfall("tpot", tpot_target_s, tpot_s, 1.0, self.headroom * tpot_target_s)
        return None


SLOT_BOUND_FRAC = 0.5
"""A TTFT forecast at least this much of which was a request slot's wait teaches the slot
wait's scale (`TtftFeedback`): what came of it is mostly that wait's doing."""


class TtftFeedback:
    """How much later admitted RT requests got their first token than the engine model
    forecast: a correction of the TTFT forecast learned from outcomes, for the time the model
    cannot see — a request's path through the gateway, the engine's HTTP server and tokenizer;
    on a host whose CPU another process takes, most of its TTFT.

    Additive, in seconds, not a factor: that time is mostly a fixed cost per request, and a
    factor learned on an idle engine (10 ms forecast, 25 ms observed: ×2.5) would multiply a
    busy engine's long queue by it. Per sample x = observed − forecast (≥ 0: this only corrects
    optimism; the forecast's headroom is the margin when it is right).

    The estimate is a high quantile (`quantile`) of the last `window` samples. Lateness that
    the requests share — a gateway or tokenizer whose CPU another process takes — is believed
    from its first samples (a lone sample is its own quantile: every admitted request that
    misses was promised its contract), and once it is a quarter of the window; a first token
    late now and then among many on time moves nothing. Refusing requests cannot make a
    random stall rarer, only a lateness they share. An estimator that moved halfway to every
    sample above it refused every request for seconds after each rare late one: two CPU
    replicas beside a CPU burner, 5–10 s without one admission, three times in a minute
    (bench/results/placement/README.md, two real replicas, one beside a neighbour).

    Each sample fades toward 0 with time constant `decay_s` from its own time: when the
    correction makes the admission shed everything, no sample comes back, and an engine that
    became fast again must be tried again — and when one is admitted, the late ones from
    before do not come back whole with it.

    extra_s(now) = Q(x_i × exp(−(now − t_i) / decay_s) over the last `window` samples). Pure;
    the caller gives the clock.

    It also learns the other way for one part of the forecast, the wait for a request slot
    (`slot_wait`): that wait is a count of decode steps — until as many running requests finish
    as are ahead, at a high quantile of their lengths (`RtOutputs.slots_free_steps`) — each at a
    pace stretched toward the engine's recent worst (`pace_stretch`). On the real CPU engine at
    its capacity session 66's forecast of it came out 30–40 % longer than what came, and the
    admission refused requests kept for a slot that the requests admitted beside them showed
    would have met (bench/results/slo/README.md, session 66). Only the pace is learned, not
    the count: each admitted request whose forecast was mostly a slot wait gives the scale its
    forecast step needed to match the engine's mean iteration from its admission to its first
    token (the engine's reports: iterations counted, seconds between them), at most 1. The
    count is a quantile, so most waits take fewer steps than forecast; a scale learned from the
    whole wait (what came, less the rest of the forecast, over the wait) trimmed that margin
    too, and in a slot-bound stream with lengths the engine cannot know 0.4 % of the admitted
    came late with it, none without (bench/results/slo/README.md, session 70). The scale is a
    high quantile (`slot_wait_quantile`) of the recent ones, each fading toward 1 (no
    correction) with `decay_s`, not below `slot_wait_floor`, and 1 until
    `slot_wait_min_samples` came. Only pessimism is corrected, and a quantile near the top
    reverts it as soon as a few admitted requests see a slower pace: the TTFT extra (above)
    keeps correcting optimism."""

    def __init__(
        self,
        *,
        quantile: float = 0.75,
        window: int = 16,
        decay_s: float = 20.0,
        max_extra_s: float = 60.0,
        slot_wait: bool = True,
        slot_wait_quantile: float = 0.9,
        slot_wait_floor: float = 0.5,
        slot_wait_min_samples: int = 4,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1:
            raise ValueError(f"window must be ≥ 1, got {window}")
        if decay_s <= 0.0 or max_extra_s <= 0.0:
            raise ValueError("need decay_s > 0 and max_extra_s > 0")
        if not 0.0 < slot_wait_quantile <= 1.0:
            raise ValueError(f"slot_wait_quantile must be in (0, 1], got {slot_wait_quantile}")
        if not 0.0 < slot_wait_floor <= 1.0:
            raise ValueError(f"slot_wait_floor must be in (0, 1], got {slot_wait_floor}")
        if not 1 <= slot_wait_min_samples <= window:
            raise ValueError(
                f"slot_wait_min_samples must be in [1, window], got {slot_wait_min_samples}"
            )
        self.quantile = quantile
        """The share of recent samples the correction covers (nearest rank)."""
        self.window = window
        """Recent samples the quantile is taken over."""
        self.decay_s = decay_s
        """Time constant of the fade between samples, seconds."""
        self.max_extra_s = max_extra_s
        """Cap on the correction, seconds."""
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)
        """(time, x) of the last `window` samples."""
        self._extra_s = 0.0
        self._at_s = 0.0
        self.samples = 0
        """Samples taken."""
        self.slot_wait = slot_wait
        """Learn the slot wait's scale (the class doc); off: it stays 1."""
        self.slot_wait_quantile = slot_wait_quantile
        """The share of recent slot-wait samples the scale covers (nearest rank)."""
        self.slot_wait_floor = slot_wait_floor
        """The scale never goes below this."""
        self.slot_wait_min_samples = slot_wait_min_samples
        """Slot-wait samples in the window before the scale is believed."""
        self._slot_recent: deque[tuple[float, float]] = deque(maxlen=window)
        """(time, the scale the sample needed) of the last `window` slot-wait samples."""
        self._slot_cut = 0.0
        """1 − the scale at `_slot_at_s` (it fades toward 0 from there)."""
        self._slot_at_s = 0.0

    def extra_s(self, now_s: float) -> float:
        """Seconds to add to a TTFT forecast at *now_s* (≥ 0)."""
        if self._extra_s == 0.0:
            return 0.0
        return self._extra_s * math.exp(-max(0.0, now_s - self._at_s) / self.decay_s)

    def slot_wait_scale(self, now_s: float) -> float:
        """The scale of a request slot's wait forecast at *now_s* (in [`slot_wait_floor`, 1])."""
        if self._slot_cut == 0.0:
            return 1.0
        return 1.0 - self._slot_cut * math.exp(-max(0.0, now_s - self._slot_at_s) / self.decay_s)

    def observe(
        self,
        forecast_s: float,
        observed_s: float,
        now_s: float,
        slot_wait_s: float = 0.0,
        slot_step_s: float = 0.0,
        iteration_s: float | None = None,
    ) -> None:
        """An admitted request forecast to get its first token *forecast_s* after its admission
        got it *observed_s* after; *slot_wait_s* of the forecast was a wait for a request slot,
        forecast at *slot_step_s* per decode step before the scale (`Forecast.slot_wait_s`,
        `Forecast.slot_step_s`), and the engine's iterations from its admission to its first
        token took *iteration_s* each on average (None: not known — the slot wait's scale then
        learns nothing from it). Samples that are not finite are ignored."""
        if not (math.isfinite(forecast_s) and math.isfinite(observed_s)):
            return
        if (
            self.slot_wait
            and iteration_s is not None
            and math.isfinite(iteration_s)
            and slot_step_s > 0.0
            and SLOT_BOUND_FRAC * forecast_s <= slot_wait_s <= forecast_s
        ):
            needed = iteration_s / slot_step_s
            self._slot_recent.append((now_s, min(1.0, max(0.0, needed))))
            self._slot_cut = 0.0
            if len(self._slot_recent) >= self.slot_wait_min_samples:
                cuts = sorted(
                    (1.0 - x) * math.exp(-max(0.0, now_s - t) / self.decay_s)
                    for t, x in self._slot_recent
                )
                # the scale's quantile is the cut's complement: a high scale is a small cut
                rank = max(1, math.ceil((1.0 - self.slot_wait_quantile) * len(cuts)))
                self._slot_cut = min(1.0 - self.slot_wait_floor, cuts[rank - 1])
            self._slot_at_s = now_s
        self._recent.append((now_s, max(0.0, observed_s - forecast_s)))
        # every sample fades from its own time: an old late one does not come back whole with
        # the next sample (from here on they all fade alike, so the quantile does too)
        ordered = sorted(x * math.exp(-max(0.0, now_s - t) / self.decay_s) for t, x in self._recent)
        rank = max(1, math.ceil(self.quantile * len(ordered)))
        self._extra_s = min(self.max_extra_s, ordered[rank - 1])
        self._at_s = now_s
        self.samples += 1


MIN_PACE_ITERATIONS = 4
"""Engine iterations an admitted request's wait must span for their mean to teach the slot
wait's scale (`TtftFeedback.observe`): fewer are one iteration's noise, and a request that
waited that little for its slot was not slot-bound."""


def mean_iteration_s(
    iteration_before: int, at_before_s: float, iteration_after: int, at_after_s: float
) -> float | None:
    """The engine's mean seconds per iteration between two of its reports, each an iteration
    count and when it was taken (`EngineLoad.iteration`, `EngineLoad.at_unix_s`); None over
    fewer than `MIN_PACE_ITERATIONS` iterations."""
    iterations = iteration_after - iteration_before
    if iterations < MIN_PACE_ITERATIONS:
        return None
    return max(0.0, at_after_s - at_before_s) / iterations


class TtftFeedbackByEngine:
    """A `TtftFeedback` per engine, by name: what one engine's admitted requests taught — time
    its model does not see: its HTTP server and tokenizer, its host's CPU — is that engine's.
    One correction for a pool made one slow replica's late first tokens (a neighbour took its
    CPU) refuse every request for as long as the correction took to decay, also those the
    other replicas would have served in time (bench/results/placement/README.md, two real
    replicas, one beside a neighbour). *make*: a new engine's `TtftFeedback`."""

    def __init__(self, make: Callable[[], TtftFeedback] = TtftFeedback) -> None:
        self._make = make
        self._by_engine: dict[str, TtftFeedback] = {}

    def of(self, engine: str) -> TtftFeedback:
        """Engine *engine*'s feedback (a new one, nothing learned, the first time)."""
        feedback = self._by_engine.get(engine)
        if feedback is None:
            feedback = self._by_engine[engine] = self._make()
        return feedback

    def extra_s(self, engine: str, now_s: float) -> float:
        """Seconds to add to a TTFT forecast on *engine* at *now_s* (0 before it taught any)."""
        feedback = self._by_engine.get(engine)
        return feedback.extra_s(now_s) if feedback is not None else 0.0

    def slot_wait_scale(self, engine: str, now_s: float) -> float:
        """The scale of a request slot's wait forecast on *engine* at *now_s* (1 before it
        taught any)."""
        feedback = self._by_engine.get(engine)
        return feedback.slot_wait_scale(now_s) if feedback is not None else 1.0


MIN_VERIFIED_ITERATIONS = 16
"""Iterations the calibration must have learned from before its pace may refuse a request on
an idle engine (`SloForecaster.forecast`): until then the model is the profile's word alone."""


def idle(load: EngineLoad, backlog: Backlog = NO_BACKLOG) -> bool:
    """The engine has nothing running or waiting, and nothing is in flight to it."""
    return (
        load.num_rt_waiting == load.num_rt_running == 0
        and load.num_be_waiting == load.num_be_running == 0
        and backlog.num_requests == 0
    )


class WorkAhead(NamedTuple):
    """What weighted fair share serves before an ask's first token (the module doc's W)."""

    tokens: int
    """RT prompt tokens computed before it, its own included."""
    drift_tokens: float
    """RT prompt tokens per iteration the other tenants gain on it while it waits: its own
    running decodes are charged to its counter every iteration, and a tenant decoding less
    than its share of them is owed the difference in prompt tokens."""


def work_ahead(load: EngineLoad, ask: SloAsk, backlog: Backlog = NO_BACKLOG) -> WorkAhead:
    """The RT prompt work ahead of *ask* (the module doc's W): its tenant T's waiting work and
    its prompt, plus each other tenant U's waiting work up to U's weighted share of that — all
    of the share for a U with requests decoding (it keeps sending) — moved by the gap between
    their fair-share counters; and the drift while it waits.

    The engine serves the least-served tenant first, so a U whose counter is below T's is served
    w_U × (c_T − c_U) more before T's prompt (less when above). The counters are the engine's
    (`TenantLoad.fair_counter`), lifted as the engine lifts a tenant that has nothing waiting
    when it next has (`FairShare.set_backlogged`): T, sending this, to the least counter of the
    tenants waiting (with none waiting, of the others: the engine's last idle one); every other
    idle U, when it sends, to the least of those waiting, T among them. Each iteration T's
    running decodes add D_T / w_T to c_T and U's add D_U / w_U to c_U, so an active U is owed
    w_U × (D_T / w_T − D_U / w_U) more prompt tokens per iteration (when positive). Without
    counters (all 0: a policy that keeps none) there is no gap and no drift: the split is by
    the waiting work alone."""
    total = load.rt_waiting_prompt_tokens + backlog.prompt_tokens + ask.prompt_tokens
    entries = load.rt_by_tenant
    if not entries and not backlog.by_tenant:
        return WorkAhead(total, 0.0)  # no split reported: every waiting prompt is ahead
    me = ask.tenant_id
    waiting: dict[str, int] = {}
    weights: dict[str, float] = {}
    active: set[str] = set()
    counted = False
    for e in entries:
        waiting[e.tenant_id] = e.waiting_prompt_tokens
        weights[e.tenant_id] = e.weight
        if e.num_running:
            active.add(e.tenant_id)
        if e.fair_counter:
            counted = True
    for e in backlog.by_tenant:
        waiting[e.tenant_id] = waiting.get(e.tenant_id, 0) + e.waiting_prompt_tokens
        weights.setdefault(e.tenant_id, e.weight)
    own = waiting.pop(me, 0) + ask.prompt_tokens
    attributed = own + sum(waiting.values())
    ahead = float(own + max(0, total - attributed))  # work no tenant claims: ahead in full
    per_weight = own / ask.weight  # the own tenant's tokens per unit of weight
    counters, drift = _lifted_counters_and_drift(entries, ask) if counted else ({}, 0.0)
    own_counter = counters.get(me, 0.0)
    for tenant_id, tokens in waiting.items():
        weight = weights[tenant_id]
        gap = weight * (own_counter - counters.get(tenant_id, own_counter))
        share = max(0.0, per_weight * weight + gap)
        ahead += share if tenant_id in active else min(tokens, share)
    return WorkAhead(math.ceil(ahead), drift)


def _lifted_counters_and_drift(
    entries: tuple[TenantLoad, ...], ask: SloAsk
) -> tuple[dict[str, float], float]:
    """`work_ahead`'s counters, lifted, by tenant (the ask's included), and its drift."""
    me = ask.tenant_id
    counters: dict[str, float] = {}
    idle_others: list[str] = []
    others_waiting: list[float] = []
    others: list[float] = []
    own_counter: float | None = None
    own_waiting = False
    own_rate = 0.0
    for e in entries:
        if e.tenant_id == me:
            own_counter, own_waiting = e.fair_counter, bool(e.num_waiting)
            own_rate = e.num_running / ask.weight
            continue
        counters[e.tenant_id] = e.fair_counter
        others.append(e.fair_counter)
        if e.num_waiting:
            others_waiting.append(e.fair_counter)
        else:
            idle_others.append(e.tenant_id)
    own = own_counter or 0.0
    if not own_waiting and (others_waiting or others):
        own = max(own, min(others_waiting or others))
    counters[me] = own
    floor = min(own, min(others_waiting)) if others_waiting else own
    for tenant_id in idle_others:
        counters[tenant_id] = max(counters[tenant_id], floor)
    drift = 0.0
    if own_rate:
        for e in entries:
            if e.tenant_id != me and e.num_running:
                drift += e.weight * max(0.0, own_rate - e.num_running / e.weight)
    return counters, drift


def largest_chunk(
    latency: LatencyModel, running: BatchShape, limit_s: float, cap: int, hint: int | None
) -> int:
    """`latency.max_chunk(running, limit_s, prefix=0, cap=cap)` — the largest chunk l ≤ cap
    whose iteration beside *running* is predicted within *limit_s*, 0 when none is — searched
    outward from *hint* (a recent answer) by doubling steps, then by halves: exactly the same
    answer (the prediction grows monotonically with l), in a few predictions when the answer is
    near the hint."""
    if hint is None or cap <= 0:
        return latency.max_chunk(running, limit_s, prefix=0, cap=cap)

    def fits(chunk: int) -> bool:
        return latency.predict(running.with_prefill(chunk)) <= limit_s

    probe = min(max(hint, 1), cap)
    step = 1
    if fits(probe):  # grow: lo fits; find an hi that does not
        lo = probe
        while True:
            if lo == cap:
                return cap
            probe = min(cap, lo + step)
            if not fits(probe):
                hi = probe
                break
            lo, step = probe, step * 2
    else:  # shrink: hi does not fit; find a lo that does
        hi = probe
        while True:
            if hi == 1:
                return 0
            probe = max(1, hi - step)
            if fits(probe):
                lo = probe
                break
            hi, step = probe, step * 2
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


STEPS_LEFT_REPORTED = 128
"""The most running RT decodes whose steps left an engine reports (the fewest): a forecast
that needs more slots than that waits for them to turn over again."""
NO_CAP = 1 << 30
"""`Snapshot.max_running` of an engine without a request cap (the default)."""
_MAX_MEMO = 256
"""Chunk sizes a forecaster remembers (states × budgets) before it starts over."""


def _decodes(count: int, context_tokens: int) -> BatchShape:
    """*count* decodes of equal context summing to *context_tokens* (Σ context² from the mean:
    the gateway knows totals, not each request)."""
    if count <= 0:
        return BatchShape()
    mean = context_tokens / count
    return BatchShape(
        decode_context=context_tokens, num_decode=count, decode_context_sq=count * mean * mean
    )


def pace_stretch(upper: float, now: float | None, iterations: int) -> float:
    """How much slower than the calibrated model a run of *iterations* iterations is forecast
    to take, from the engine's recent pace: *upper* its worst but one iteration in ten
    (`EngineLoad.pace_ratio_p90`), *now* the mean of its latest few (`pace_ratio_recent_mean`;
    None: not reported — *upper*, whatever their number). At least 1: a pace faster than the
    calibration's is left for the calibration to learn.

        stretch = now + max(0, upper − now) ÷ √iterations

    *now* carries a change of pace — every recent iteration slower — whole; the gap to *upper*
    is one iteration's noise, and the sum of n iterations strays from n times their mean by
    about √n times one's spread, not n times: one iteration is stretched by *upper*, a hundred
    by *now* and a tenth of the gap. Stretched by *upper* whole, slot waits of about ten decode
    steps on the real engine at its capacity were forecast 0.2–0.4 s above the first token of
    the worst admitted request queued beside them; W1 there at 14 req/s, both in one run: 6.8 %
    of the RT requests shed (138 of the 141 while every RT request admitted within a second of
    them met its target) against 2.8 % with this, admitted attainment 0.9995 and 1.000
    (bench/results/slo/README.md, session 66). Noise that does not average out — iterations slow
    together, a neighbour's burst — shows in *now* within a few iterations, and in late first
    tokens that `TtftFeedback` adds back."""
    floor = max(1.0, upper)
    if now is None:
        return floor
    gap = max(0.0, upper - now)
    return max(1.0, now + gap / math.sqrt(max(1, iterations)))


def inflight_left_s(load: EngineLoad, at_s: float | None, spread: float = 1.0) -> float:
    """What is left at *at_s* of the iteration the engine started when it took *load*: its
    predicted time, stretched by the pace *spread*, less the time since the report (none with
    *at_s* None); the last measured iteration for an engine that does not say what it runs."""
    predicted_s = load.inflight_predicted_s
    if predicted_s is None:
        return load.iteration_s
    left_s = spread * predicted_s
    if at_s is not None:
        left_s -= max(0.0, at_s - load.at_unix_s)
    return max(0.0, left_s)


def _retry_after(over_s: float) -> float:
    """Whole seconds, at least one (HTTP's Retry-After has a one-second resolution)."""
    return float(max(1, math.ceil(over_s)))


def load_of(
    snapshot: Snapshot,
    *,
    iteration: int,
    at_unix_s: float,
    iteration_s: float,
    predicted_iteration_s: float = 0.0,
    inflight_predicted_s: float | None = None,
    latency_factors: tuple[float, float, float] = (1.0, 1.0, 1.0),
    pace_ratio_p90: float = 1.0,
    pace_ratio_recent_mean: float | None = None,
    calibration_samples: int = 0,
    rt_fair_counters: Mapping[str, float] | None = None,
    rt_outputs: RtOutputs | None = None,
    rt_late_bound_frac: float | None = None,
    rt_decode_margin: float = 0.0,
) -> EngineLoad:
    """The `EngineLoad` an engine reports from the snapshot its policy planned from (the
    SGLang driver and the simulator build it the same way). One pass over the requests.

    A running request still prefilling (a chunked prompt) counts as waiting RT work: what is
    left of its prompt is ahead of any new prompt; waiting RT work is also split by tenant,
    with each tenant's fair-share counter from *rt_fair_counters* (the policy's, when it keeps
    them: `load_report.policy_rt_fair_counters`).

    A waiting RT request already past its TTFT deadline counts in `num_rt_waiting` (and its
    tenant's `num_waiting`) but not in the prompt tokens waiting: tandem serves such a request
    after every one that can still meet its own (`RtQueue`: no domino of misses), before them
    only in time they can spare within the headroom; so its prompt is not ahead of a new
    request's forecast. Counted as ahead, a tenant's few overdue requests made the forecast shed
    every new request of that tenant while another tenant burst (W6 at 2 λ*: the steady tenant
    got 14 of 404 requests in during a burst, the burster 516 of 1,893). One more than
    *rt_late_bound_frac* of its TTFT target past its deadline is ahead, though: tandem serves it
    first (`TandemConfig.rt_late_bound_frac`; None: no such bound). With it counted, the
    simulator's W1 at 3 λ* kept its worst admitted TTFT at 1.3 s instead of 2.2 s, and W6 with
    the engine slower in every burst lost no admitted attainment to the bound.

    *rt_outputs* tells how long the running RT decodes and a new RT request will run (the
    report's `rt_decode_steps_left` and `rt_new_decode_steps`); None: not reported.
    *rt_decode_margin*: the policy's safety margin on the RT decodes' next tokens
    (`load_report.policy_rt_decode_margin`)."""
    rt_waiting = rt_prompt = rt_running = rt_context = rt_prefilling = 0
    be_waiting = be_prompt = be_running = be_context = be_kv = 0
    # tenant → [weight, requests waiting, prompt tokens left, requests decoding]
    by_tenant: dict[str, list[Any]] = {}
    tpot_min = math.inf
    for r in snapshot.running:
        if r.tier == "rt":
            if r.prefilled < r.prefill_len:
                rt_waiting += 1
                rt_prefilling += 1
                rt_prompt += r.prefill_len - r.prefilled
                _count_waiting(by_tenant, r)
            else:
                rt_running += 1
                if r.tpot_target_s is not None and r.tpot_target_s < tpot_min:
                    tpot_min = r.tpot_target_s
                entry = by_tenant.get(r.tenant_id)  # `_tenant_entry`, inlined: the hot case
                if entry is None:
                    entry = by_tenant[r.tenant_id] = [r.tenant_weight, 0, 0, 0]
                entry[3] += 1
                rt_context += r.prompt_len + r.generated
        else:
            be_kv += r.prefilled + (r.generated if r.prefilled >= r.prefill_len else 0)
            if r.prefilled < r.prefill_len:
                be_waiting += 1
                be_prompt += r.prefill_len - r.prefilled
            else:
                be_running += 1
                be_context += r.prompt_len + r.generated
    now_s = snapshot.now_s
    waiting_rt, waiting_be = snapshot.waiting_rt, snapshot.waiting_be
    if waiting_rt is None or waiting_be is None:  # the engine keeps no split: made here
        waiting_rt = [r for r in snapshot.waiting if r.tier == "rt"]
        waiting_be = [r for r in snapshot.waiting if r.tier != "rt"]
    for r in waiting_rt:
        rt_waiting += 1
        lateness = r.ttft_lateness(now_s)
        if lateness > 0 and (rt_late_bound_frac is None or lateness <= rt_late_bound_frac):
            _tenant_entry(by_tenant, r)[1] += 1  # overdue: served last, ahead of nobody
            continue
        rt_prompt += r.prefill_len - r.prefilled
        _count_waiting(by_tenant, r)
    be_waiting += len(waiting_be)
    be_prompt += sum([r.prefill_len - r.prefilled for r in waiting_be])
    counters = rt_fair_counters or {}
    steps_left: tuple[int, ...] = ()
    new_steps = 0
    # only where the slots can run out: an estimate per running decode costs more than the rest
    # of the report (half the pool simulator's time at 1,000 running)
    if rt_outputs is not None and 2 * (rt_running + rt_waiting) >= snapshot.max_running:
        steps_left = rt_outputs.slots_free_steps(_decoding_rt(snapshot), STEPS_LEFT_REPORTED)
        new_steps = rt_outputs.new_request_steps()
    return EngineLoad(
        iteration=iteration,
        at_unix_s=at_unix_s,
        iteration_s=iteration_s,
        predicted_iteration_s=predicted_iteration_s,
        inflight_predicted_s=inflight_predicted_s,
        pace_ratio_p90=pace_ratio_p90,
        pace_ratio_recent_mean=pace_ratio_recent_mean,
        num_rt_waiting=rt_waiting,
        rt_waiting_prompt_tokens=rt_prompt,
        num_rt_running=rt_running,
        rt_context_tokens=rt_context,
        num_rt_prefilling=rt_prefilling,
        max_running_requests=snapshot.max_running if snapshot.max_running < NO_CAP else 0,
        rt_decode_steps_left=steps_left,
        rt_new_decode_steps=new_steps,
        num_be_waiting=be_waiting,
        be_waiting_prompt_tokens=be_prompt,
        num_be_running=be_running,
        be_context_tokens=be_context,
        kv_used_tokens=snapshot.kv_capacity_tokens - snapshot.kv_free_tokens,
        kv_capacity_tokens=snapshot.kv_capacity_tokens,
        be_kv_tokens=be_kv,
        max_prefill_tokens=snapshot.max_prefill_tokens,
        latency_factors=latency_factors,
        calibration_samples=calibration_samples,
        rt_tpot_target_min_s=tpot_min if math.isfinite(tpot_min) else None,
        rt_decode_margin=rt_decode_margin,
        rt_by_tenant=tuple(
            TenantLoad(
                tenant_id=tenant_id,
                weight=weight,
                num_waiting=count,
                waiting_prompt_tokens=tokens,
                num_running=running,
                fair_counter=counters.get(tenant_id, 0.0),
            )
            for tenant_id, (weight, count, tokens, running) in by_tenant.items()
        ),
    )


SLOT_FREE_QUANTILE = 0.95
"""The quantile at which `RtOutputs.slots_free_steps` tells when slots free up (tandem's
`slo_slot_free_quantile` defaults to it)."""
EXACT_SLOTS = 16
"""Up to this many running decodes the count finished by a step is convolved exactly (16 of
them: 0.15 ms of the report); past it, normal (its mean and variance, ±½: for the first slots
5–20 % later than exact with 16–32 decodes); exact, 256 took several ms each iteration."""


class RtOutputs:
    """How long RT requests on one engine run, learned from the snapshots its policy plans
    from, to tell when running ones will free their request slots.

    An RT request that held a slot in one snapshot and is neither running nor waiting in the
    next has finished (one back in the queue was evicted, and still needs a slot); its output
    length joins the last `history` ones. A running request that has generated g tokens then
    finishes after L − g more steps, L > g drawn from the past outputs of the engine's own RT
    traffic (Past-Future style; `_survival`), at most its `max_new_tokens`; with none of them
    longer than g (or none finished yet), after its `max_new_tokens` − g: a guess shorter than
    that once let requests in that then waited seconds for a slot.

    `slots_free_steps` says within how many steps k of the running decodes will have finished,
    at the `quantile` of that count's distribution (each decode's length drawn on its own);
    None: the k-th fewest of each decode's mean steps left (`steps_left`), as before. The mean
    made the slot wait a coin toss: with outputs of 50–250 tokens the engine cannot know, 4.5 %
    of the admitted requests of a slot-bound stream came late, up to 4× their TTFT target
    (tests/unit/test_feasibility.py). Pure: the caller passes each snapshot."""

    def __init__(self, history: int = 256, quantile: float | None = SLOT_FREE_QUANTILE) -> None:
        if history < 1:
            raise ValueError(f"history must be ≥ 1, got {history}")
        if quantile is not None and not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1) or None, got {quantile}")
        self.quantile = quantile
        self._recent: deque[int] = deque(maxlen=history)
        self._at_cap: deque[bool] = deque(maxlen=history)
        """Whether each of `_recent` ended at its max_new_tokens (not at its own end)."""
        self._holding: dict[str, tuple[int, int]] = {}
        """rid → (tokens generated, max_new_tokens), of the RT requests running in the last
        snapshot."""
        self._sorted: list[int] | None = None
        self._suffix: list[int] = []
        self._own_ends = np.zeros(0, dtype=np.int64)
        """The lengths of `_recent` that ended on their own (sorted)."""
        self._cut = np.zeros(0, dtype=np.int64)
        """The lengths of `_recent` cut at their max_new_tokens (sorted)."""

    def observe(self, snapshot: Snapshot) -> None:
        """Takes in *snapshot*: the RT requests gone from it since the last one finished."""
        holding = {
            r.rid: (r.generated, r.max_new_tokens) for r in snapshot.running if r.tier == "rt"
        }
        gone = self._holding.keys() - holding.keys()
        if gone:
            waiting = snapshot.waiting_rt if snapshot.waiting_rt is not None else snapshot.waiting
            gone -= {r.rid for r in waiting if r.tier == "rt"}
            for rid in gone:
                generated, max_new_tokens = self._holding[rid]
                # the last count seen; the final token's step is not seen: one more
                self._recent.append(generated + 1)
                self._at_cap.append(generated + 1 >= max_new_tokens)
                self._sorted = None
        self._holding = holding

    def new_request_steps(self) -> int:
        """Decode steps an RT request that starts now is expected to take: the mean of the
        lengths finished lately (0 before any finished)."""
        if not self._recent:
            return 0
        suffix = self._sorted_lengths()[1]
        return math.ceil(suffix[0] / len(suffix))

    def steps_left(self, r: ReqState) -> int:
        """Decode steps *r* (running, decoding) is expected to take before it finishes (the
        mean)."""
        bound = max(1, r.max_new_tokens - r.generated)
        lengths, suffix = self._sorted_lengths()
        longer = bisect.bisect_right(lengths, r.generated)
        count = len(lengths) - longer
        if not count:
            return bound  # longer than every one seen (or none seen yet): only its cap is known
        return max(1, min(bound, math.ceil(suffix[longer] / count - r.generated)))

    def slots_free_steps(self, decoding: list[ReqState], limit: int) -> tuple[int, ...]:
        """For k = 1, 2, … (at most *limit*): the decode steps within which k of *decoding*
        (running RT decodes) will have finished and freed their slots, at `quantile`.

        Each decode's steps left R is L − g, L the length at which its output ends on its
        own, given L > g (`_survival`), or its cap (max_new_tokens − g) if sooner: P(R ≤ t) =
        1 − P(L > g + t) ÷ P(L > g), and 1 from its cap on. The number finished by step t is a sum
        of such draws, exact by convolution up to `EXACT_SLOTS` of them and normal beyond
        (with ±½); the k-th value is the first step t on a grid (every step to 32, then
        5 % apart, and each decode's cap: rounded up) where P(≥ k finished) reaches the
        quantile."""
        if self.quantile is None:
            steps = [self.steps_left(r) for r in decoding]
            return tuple(heapq.nsmallest(limit, steps))
        count = min(limit, len(decoding))
        if count == 0:
            return ()
        generated = np.fromiter((r.generated for r in decoding), np.int64, len(decoding))
        max_new = np.fromiter((r.max_new_tokens for r in decoding), np.int64, len(decoding))
        cap = np.maximum(1, max_new - generated)
        caps = np.unique(cap)
        grid = np.unique(np.concatenate((_step_grid(int(caps[-1])), caps)))  # a cap may be an end
        survival = self._survival(generated)  # survival[x] = P(L > x), x to the longest seen
        per_alive = 1.0 / survival[np.minimum(generated, len(survival) - 1)]  # each is at risk
        # Many decodes: the grid's columns in blocks of doubling width, until the count-th slot
        # is found — the slots asked for usually free long before the last cap (a third of the
        # columns at 256 decodes) and each column costs a pass over every decode (5× faster
        # there); a few: all at once (each block costs a convolution's fixed overhead).
        found: list[int] = []
        start, width = 0, 32 if len(decoding) > EXACT_SLOTS else len(grid)
        while len(found) < count and start < len(grid):
            block = grid[start : start + width]
            later = np.take(survival, generated[:, None] + block[None, :], mode="clip")
            later *= per_alive[:, None]
            p = np.subtract(1.0, later, out=later)
            p[block[None, :] >= cap[:, None]] = 1.0  # from its cap on it has finished
            first = _first_reaching(p, len(found) + 1, count, self.quantile)
            found += block[first[first < len(block)]].tolist()
            start, width = start + width, 2 * width
        # the grid's last step is the last cap, where all have finished: every k was found
        return tuple(found + [int(grid[-1])] * (count - len(found)))

    def _survival(self, generated: np.ndarray) -> np.ndarray:
        """P(L > x) for the length L at which an RT output ends on its own, x = 0 … the longest
        seen (constant past it), Kaplan–Meier: the lengths that ended so are its events; the
        ones cut at their max_new_tokens, the running decodes (*generated* each) and one
        phantom longer than any are lengths known only to pass where they stand. Finished ones
        alone are the short ones first: after an idle start or a change of traffic every
        running request looked near its end (the stream's first late requests); past the
        longest seen a request need not end soon (it ended every request beyond it at once);
        and where every request runs to its cap (a client that sets max_tokens to what it
        wants, a bench's exact lengths), no output ends before its cap: the caps are exact."""
        self._sorted_lengths()
        own, cut = self._own_ends, self._cut
        if not len(own):
            return np.ones(1)
        ends, finished = np.unique(own, return_counts=True)
        # at risk at x: ended at x or later, cut at x or later, running with g + 1 ≥ x (its next
        # step may end it), or the phantom
        at_risk = len(own) - np.searchsorted(own, ends, side="left")
        at_risk += len(cut) - np.searchsorted(cut, ends, side="left")
        at_risk += len(generated) - np.searchsorted(np.sort(generated + 1), ends, side="left")
        at_risk += 1
        dense = np.ones(int(ends[-1]) + 1)
        dense[ends] = 1.0 - finished / at_risk
        return np.cumprod(dense)

    def _sorted_lengths(self) -> tuple[list[int], list[int]]:
        """The recent lengths sorted, and their suffix sums (sorted again only after a new
        one came)."""
        if self._sorted is None:
            self._sorted = sorted(self._recent)
            self._suffix = list(itertools.accumulate(reversed(self._sorted)))[::-1]
            lengths = np.asarray(self._recent, dtype=np.int64)
            at_cap = np.asarray(self._at_cap, dtype=bool)
            self._own_ends = np.sort(lengths[~at_cap])
            self._cut = np.sort(lengths[at_cap])
        return self._sorted, self._suffix


@functools.lru_cache(maxsize=64)
def _step_grid(most: int) -> np.ndarray:
    """The steps `slots_free_steps` tries: every one to 32, then 5 % apart, to *most*."""
    grid = list(range(1, min(most, 32) + 1))
    step = 32.0
    while grid[-1] < most:
        step *= 1.05
        grid.append(min(most, max(grid[-1] + 1, math.ceil(step))))
    return np.asarray(grid, dtype=np.int64)


def _first_reaching(p: np.ndarray, low: int, count: int, quantile: float) -> np.ndarray:
    """For k = *low* … *count*: the first column at which at least k of independent draws have
    succeeded with probability ≥ *quantile* (the number of columns where none does; it is
    first for a smaller k if for a larger one); row i of *p* is draw i's success probability at
    each column, non-decreasing along the row."""
    draws, columns = p.shape
    if draws <= EXACT_SLOTS:
        exact = np.zeros((draws + 1, columns))
        exact[0] = 1.0
        for row in p:  # Poisson-binomial: add one draw at a time
            exact[1:] = exact[1:] * (1.0 - row) + exact[:-1] * row
            exact[0] *= 1.0 - row
        at_least = np.cumsum(exact[::-1], axis=0)[::-1][low : count + 1]  # P(≥ k), k = low …
        reached = at_least >= quantile
        return np.asarray(np.where(reached.any(axis=1), reached.argmax(axis=1), columns))
    # normal, ±½: P(≥ k) ≥ q where mean − z_q·σ + ½ ≥ k (first reached: its running maximum)
    mean = p.sum(axis=0)
    std = np.sqrt((p * (1.0 - p)).sum(axis=0))
    level = np.maximum.accumulate(mean - _normal_quantile(quantile) * std + 0.5)
    return np.asarray(np.searchsorted(level, np.arange(low, count + 1), side="left"))


@functools.lru_cache(maxsize=8)
def _normal_quantile(quantile: float) -> float:
    return statistics.NormalDist().inv_cdf(quantile)


def _decoding_rt(snapshot: Snapshot) -> list[ReqState]:
    """The running RT requests past their prompt (decoding: each holds a slot until done)."""
    return [r for r in snapshot.running if r.tier == "rt" and r.prefilled >= r.prefill_len]


def _tenant_entry(by_tenant: dict[str, list[Any]], r: ReqState) -> list[Any]:
    """The RT request's tenant's entry in `load_of`'s tally (a new one when first seen)."""
    entry = by_tenant.get(r.tenant_id)
    if entry is None:
        entry = by_tenant[r.tenant_id] = [r.tenant_weight, 0, 0, 0]
    return entry


def _count_waiting(by_tenant: dict[str, list[Any]], r: ReqState) -> None:
    """Adds a waiting RT request's prompt left to its tenant's entry."""
    entry = _tenant_entry(by_tenant, r)
    entry[1] += 1
    entry[2] += r.prefill_len - r.prefilled
