"""RT phase (AccelGen, synthesis §4 step 3): stall-free RT decodes, then RT prompts by slack.

1. every running RT decode (KV short: evict BE, least progress first)
2. τ from the decodes' deadlines (slack.py)
3. prompts in slack order — running partial ones, then the queue (feasible by latest start,
   then hopeless, each moved forward into the slack the feasible ones can spare):
   * urgent ones first, each raising τ as far as it needs to make its deadline
     (`needed_budget`, within the hard cap) and evicting BE, then non-urgent RT, for KV;
   * then a window of non-urgent ones (within γ of the first one's slack, at most K) placed
     by best fit on (compute tokens, KV) until τ is used up;
   * at most one long prompt mid-prefill (ERA) unless urgent; Past-Future admission for new
     ones (BE memory counts as free);
   * a new prompt that finds every request slot taken evicts the BE request with the least
     progress for one (`_free_slot`): RT never waits for a slot BE holds.
Chunks are cut exactly where τ ends (`TandemBatch.chunk_for`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

from backend.policy.common import decode_cost, prefill_cost
from backend.policy.tandem import slack
from backend.policy.tandem.context import PlanContext
from backend.policy.tandem.queues import PromptPace
from backend.policy.tandem.timing import BatchTotals
from backend.policy.tandem.victims import evict_for, progress, victim_order
from backend.policy.types import ReqState

STOP, SKIP, DONE = 0, 1, 2
"""Outcome of trying one prompt: stop the phase, skip it (try the next), scheduled."""


def split_pays(ctx: PlanContext) -> bool:
    """`split_mixed`: RT prompt work waits beside running RT decodes, and the model predicts that
    running them apart — this iteration the prompts (the chunk the budget allows alone), the
    decodes sitting it out, the next one the decodes — is clearly faster (`split_min_gain`) than
    the same chunk beside the decodes, within the RT decodes' TPOT deadlines.

    BE prompts get no iteration of their own: a first version gave them one, and the new
    user's chats beside a batch came later with it (TTFT ×1.75, TPOT ×1.34 of alone; on a host
    where the code before the split gave ×1.65, ×1.41, so the cause is not settled)."""
    view = ctx.view
    rt_left = sum(
        r.prefill_len - r.prefilled
        for r in itertools.chain(view.rt_partial, ctx.rt_queue.known.reqs.values())
        if not r.is_probe
    )
    if not view.rt_decode or rt_left <= 0:
        # only RT decodes are worth holding back for: beside BE's alone, an RT prompt already
        # runs with every BE row parked (the stretch)
        return False
    timer, alone = ctx.timer, BatchTotals()
    decodes = _decode_totals(itertools.chain(view.rt_decode, view.be_decode))
    decode_s = timer.predict(decodes)
    deadline = slack.decode_deadline(view.rt_decode, ctx.now_s, decode_s)
    # the prompts' iteration gets what the decodes' deadline leaves after their own iteration
    # (`defer_rt_decodes` caps it so), up to the budget: sized to the budget alone, a split on
    # an engine whose decodes take most of their TPOT never fit, and beside the decodes (CPU
    # attention recomputes them with a chunk) no chunk fit either — RT prompts waited 20 s
    # while 22-33 RT decodes ran alone (W1 on the real engine 3× slower than planned)
    cap = min(rt_left, ctx.max_prefill)
    room_s = min(ctx.budget_s, (1 - ctx.eps) * (deadline - ctx.now_s) - decode_s)
    chunk = timer.max_chunk(alone, room_s, prefix=0, cap=cap) if room_s > 0.0 else 0
    if chunk < 1:
        # the decodes leave the prompts nothing; an overdue prompt runs all the same, in an
        # iteration of up to one TPOT of the decodes (`overdue_room_s`)
        overdue_room_s = _overdue_room_s(ctx)
        if overdue_room_s <= 0.0:
            return False
        chunk = max(1, timer.max_chunk(alone, (1 - ctx.eps) * overdue_room_s, prefix=0, cap=cap))
        ctx.overdue_room_s = overdue_room_s
    apart_s = timer.with_chunk(alone, chunk, 0) + decode_s
    if apart_s <= (1.0 - ctx.config.split_min_gain) * timer.with_chunk(decodes, chunk, 0):
        return True
    ctx.overdue_room_s = 0.0
    return False


def _overdue(ctx: PlanContext, r: ReqState) -> bool:
    """`r` waits for its first token more than `rt_late_bound_frac` of its TTFT target past its
    deadline (the queue's late bound: it goes first)."""
    bound = ctx.config.rt_late_bound_frac
    return bound is not None and not r.is_probe and r.ttft_lateness(ctx.now_s) > bound


def _decodes_tpot_s(ctx: PlanContext) -> float:
    """The tightest TPOT target of the running RT decodes (inf: none has one)."""
    return min(
        (r.tpot_target_s for r in ctx.view.rt_decode if r.tpot_target_s is not None),
        default=math.inf,
    )


def _overdue_room_s(ctx: PlanContext) -> float:
    """The hard cap an overdue RT prompt's iteration of its own gets, whatever the decodes'
    deadlines say: the tightest TPOT target of the running RT decodes when an overdue prompt
    (`_overdue`) waits; else 0. The overdue prompt's own rule, `_overdue_chunk`, explains."""
    waiting = itertools.chain(ctx.view.rt_partial, ctx.rt_queue.known.reqs.values())
    if not any(_overdue(ctx, r) for r in waiting):
        return 0.0
    tpot_s = _decodes_tpot_s(ctx)
    return tpot_s if math.isfinite(tpot_s) else 0.0


def _overdue_chunk(ctx: PlanContext, r: ReqState) -> int:
    """The chunk an overdue RT prompt (`_overdue`) gets beside the running decodes where their
    deadlines leave it none: the hard cap moves one TPOT (their tightest target) later, so the
    decodes' next token may come that much late, once per plan and such prompt; at least its
    least chunk. A mean TPOT barely moves, and the prompt's wait is bounded: without it, RT
    prompts the admission let in just before the engine slowed waited 14-27 s while the
    decodes took every iteration (W1 on the real engine and its simulator twin, 3× slower
    from second 30: the decodes at 110-190 ms of their 250 ms TPOT, and ε at 0.3 after the
    step's overruns leaving them (1 − ε) × 250 = 175 ms)."""
    tpot_s = _decodes_tpot_s(ctx)
    if not math.isfinite(tpot_s):
        return 0
    b = ctx.batch
    ctx.hard_s += tpot_s
    ctx.tau_s = max(ctx.tau_s, min(ctx.budget_s, (1 - ctx.eps) * ctx.hard_s))
    return max(b.chunk_for(r, ctx.tau_s), b.least_chunk(r))


def defer_rt_decodes(ctx: PlanContext) -> None:
    """The prompts' half of a split iteration: no decode runs, and the hard cap leaves the
    decodes' own iteration, which follows, within their deadlines."""
    view = ctx.view
    decode_s = ctx.timer.predict(_decode_totals(itertools.chain(view.rt_decode, view.be_decode)))
    deadline = slack.decode_deadline(view.rt_decode, ctx.now_s, decode_s)
    ctx.deferred_rt_decode_s = ctx.timer.predict(_decode_totals(view.rt_decode))
    ctx.hard_s = max(deadline - ctx.now_s - decode_s, ctx.overdue_room_s)
    ctx.tau_s = ctx.budget_s
    ctx.cap_tau()


def _decode_totals(reqs: Iterable[ReqState]) -> BatchTotals:
    """The totals of a batch that decodes *reqs* (their contexts: prompt and generated)."""
    totals = BatchTotals()
    for r in reqs:
        context = r.prompt_len + r.generated
        totals.num_decode += 1
        totals.decode_context += context
        totals.decode_context_sq += context * context
    return totals


def run_rt_decodes(ctx: PlanContext) -> None:
    """Every RT decode (stall-free); sets the hard cap from their deadlines and τ ≤ L (and ≤
    the TPOT of a stream that cannot keep pace: `slack.unkeepable_tpot_s`)."""
    b = ctx.batch
    _decode_rt(ctx)
    decode_only_s = b.time_s() if b.decodes else 0.0
    deadline = (
        slack.decode_deadline(ctx.view.rt_decode, ctx.now_s, decode_only_s)
        if b.decodes
        else math.inf
    )
    ctx.hard_s = deadline - ctx.now_s
    if math.isfinite(deadline):
        b.note_rt_token(deadline, ctx.hard_s)
    ctx.tau_s = ctx.budget_s
    ctx.cap_tau()
    if b.decodes and ctx.config.use_slack:
        unkeepable = slack.unkeepable_tpot_s(ctx.view.rt_decode, decode_only_s)
        ctx.tau_s = min(ctx.tau_s, (1 - ctx.eps) * unkeepable)


def run_rt_prefills(ctx: PlanContext) -> None:
    """RT prompts in slack order within τ (urgent ones raise it); see the module docstring.
    Windows are taken one after the other while τ has room."""
    b = ctx.batch
    chunk_at_budget = max(1, ctx.timer.max_chunk(b, ctx.budget_s, prefix=0, cap=ctx.max_prefill))
    candidates = _candidates(ctx, chunk_at_budget)
    # a prompt's slack at the engine's recent upper pace: one that starts just in time at its
    # mean pace misses whenever its iterations run long (`TandemConfig.deadline_spread`); an
    # urgent one's window stays at the mean pace (sized to the upper pace as well, its
    # iterations grew and other prompts missed: bench/results/slo/README.md, session 58)
    iteration_s = ctx.budget_s * ctx.deadline_spread
    pending: ReqState | None = None
    while True:
        window: list[tuple[ReqState, float, float]] = []
        stop = exhausted = False
        for r in itertools.chain([pending] if pending is not None else [], candidates):
            pending = None
            deadline = slack.rt_deadline(r)
            if not b.prefills and _overdue(ctx, r):
                # first in the queue's order (its late bound), and no used-up τ keeps it out
                if _prefill(ctx, r, deadline, urgent=False) == STOP:
                    stop = True
                    break
                continue
            n = slack.iterations_left(r.prefill_len - r.prefilled, chunk_at_budget)
            s = slack.slack_s(deadline, ctx.now_s, n, iteration_s)
            if ctx.config.use_slack and slack.is_urgent(s, iteration_s):
                window_s = (1 - ctx.eps) * (deadline - ctx.now_s)
                need = slack.needed_budget(ctx.timer, b, r, window_s, ctx.max_prefill)
                if need is not None or r.first_token_s is not None:  # else hopeless
                    if _prefill(ctx, r, deadline, urgent=True, need_s=need) == STOP:
                        stop = True
                        break
                    continue
            if window and (
                s > window[0][1] + ctx.config.window_s
                or len(window) >= ctx.config.best_fit_candidates
            ):
                pending = r  # heads the next window
                break
            if _full(ctx) and not window:
                stop = True  # no room, and nothing behind it is urgent (slack order)
                break
            window.append((r, s, deadline))
        else:
            exhausted = True
        if stop or not window or _fill_window(ctx, window) or exhausted:
            break
    ctx.rt_queue.restore()


def _decode_rt(ctx: PlanContext) -> None:
    """All RT decodes (stall-free). When their KV slots do not fit: evict BE (least progress
    first), then non-urgent RT (largest slack first), and only as a last resort — the pool is
    overcommitted and nothing else frees a slot — the RT decode with the latest deadline."""
    b, view = ctx.batch, ctx.view
    decodes = list(view.rt_decode)
    if b.add_decodes(decodes):
        return
    order = victim_order(
        view.be_running,
        view.rt_partial + decodes,
        lambda r: _slack(ctx, r),
        ctx.budget_s,
        include_rt=True,
    )
    last_resort = sorted(decodes, key=slack.rt_deadline, reverse=True)
    for victim in itertools.chain(order, last_resort):
        if sum(decode_cost(r, b.page) for r in decodes) <= b.kv_avail or len(decodes) <= 1:
            break
        if victim.rid in b.evictions:
            continue
        b.evict(victim)
        ctx.on_evict(victim)
        if victim.tier == "rt" and victim.prefilled >= victim.prefill_len:
            decodes = [r for r in decodes if r.rid != victim.rid]
    if not b.add_decodes(decodes):
        for r in sorted(decodes, key=slack.rt_deadline):
            b.add_decode(r)


def _slack(ctx: PlanContext, r: ReqState) -> float:
    n = slack.iterations_left(r.prefill_len - r.prefilled, ctx.max_prefill)
    return slack.slack_s(slack.rt_deadline(r), ctx.now_s, n, ctx.budget_s)


def _candidates(ctx: PlanContext, chunk_at_budget: int) -> Iterator[ReqState]:
    """Running partial RT prompts (earliest deadline first), then the waiting queue (hopeless
    ones moved into the slack the rest can spare, at `chunk_at_budget` tokens an iteration; one
    far past its deadline first: `rt_late_bound_frac`)."""
    partial = sorted(ctx.view.rt_partial, key=slack.rt_deadline)
    yield from partial
    config, pace = ctx.config, None
    if config.use_slack and config.use_slack_stealing:
        pace = PromptPace(
            chunk_at_budget,
            ctx.budget_s,
            ahead_tokens=sum(r.prefill_len - r.prefilled for r in partial),
            headroom=config.slo_headroom,
            slots=_rt_slots(ctx),
        )
    yield from ctx.rt_queue.candidates(ctx.now_s, pace, late_bound_frac=config.rt_late_bound_frac)


def _rt_slots(ctx: PlanContext) -> int:
    """Request slots the waiting RT prompts can take: the free ones and those BE holds and can
    give up (`_free_slot`)."""
    b = ctx.batch
    taken = b.scheduled | set(b.evictions)
    return b.running_slots + sum(1 for r in ctx.view.be_running if r.rid not in taken)


def _prefill(
    ctx: PlanContext, r: ReqState, deadline: float, *, urgent: bool, need_s: float | None = None
) -> int:
    """Schedules the next chunk of RT prompt `r` (an urgent one raises τ to `need_s`, the
    iteration time it needs, within the hard cap); STOP, SKIP or DONE."""
    b = ctx.batch
    if (ctx.era_blocked(r, "rt") and not urgent) or (b.evictions and r.rid in b.evictions):
        return SKIP
    if need_s is not None:
        ctx.tau_s = max(ctx.tau_s, min(need_s, (1 - ctx.eps) * ctx.hard_s))
    _raise_for_floor(ctx, r)
    if not r.is_running and ctx.config.use_pastfuture and not ctx.admission.admit_rt(r):
        return STOP  # RT alone would overflow KV: later prompts would too
    if not r.is_running and b.running_slots < 1 and not _free_slot(ctx, r):
        return STOP  # every slot is RT's own: later prompts would find none either
    chunk = b.chunk_for(r, ctx.tau_s)
    if chunk <= 0 and not b.prefills and not b.decodes:
        # Even its least chunk alone takes longer than τ (deep into a long context on a
        # backend whose every chunk pays for its prefix, or an engine slower than its model):
        # τ protects RT decodes, and there are none here, so it runs anyway. Left out, it
        # waited for every BE request to drain (a conversation's turn after a 2,400-token
        # history: 18 s beside a batch on the CPU engine, its chunk 0.2 s).
        chunk = b.least_chunk(r)
    elif chunk <= 0 and not b.prefills and _overdue(ctx, r):
        chunk = _overdue_chunk(ctx, r)
    chunk = _make_room(ctx, r, chunk, urgent)
    if chunk <= 0:
        return STOP
    b.add_prefill(r, chunk)
    if chunk >= r.prefill_len - r.prefilled:
        b.first_tokens += 1
    ctx.started(r, chunk, "rt")
    if not r.is_running:
        ctx.rt_queue.take(r)
    _bound_by(ctx, r, deadline, chunk)
    return DONE


def _full(ctx: PlanContext) -> bool:
    """τ is used up and the RT floor (`rt_prefill_floor_tokens`) too."""
    b = ctx.batch
    return (
        b.time_s() >= ctx.tau_s
        and b.prefill_tokens + b.num_decode >= ctx.config.rt_prefill_floor_tokens
    )


def _raise_for_floor(ctx: PlanContext, r: ReqState) -> None:
    """RT work gets at least `rt_prefill_floor_tokens` per iteration — RT decodes one token
    each, prompt chunks the rest, as the rt-only engine's token budget counts them — τ raised
    for it within the hard cap: a prompt is not spread over more iterations than it would be
    without BE (each one a TTFT delay)."""
    b, floor = ctx.batch, ctx.config.rt_prefill_floor_tokens
    room = floor - b.prefill_tokens - b.num_decode  # the RT phase runs first: all of it is RT
    if room <= 0:
        return
    want = min(r.prefill_len - r.prefilled, room)
    need = ctx.timer.with_chunk(b, want, r.prefilled)
    ctx.tau_s = max(ctx.tau_s, min(need, (1 - ctx.eps) * ctx.hard_s))


def _free_slot(ctx: PlanContext, r: ReqState) -> bool:
    """Every request slot (the engine's max_running) is taken and `r` needs one: evicts the
    running BE request with the least progress (re-queued at the front of BE: it keeps its
    place and deadline) — RT never waits for a slot BE holds. False when no BE request can
    give one up (all RT, or all scheduled in this plan already)."""
    b = ctx.batch
    skip = b.scheduled | set(b.evictions)
    for victim in sorted(ctx.view.be_running, key=progress):
        if victim.rid not in skip and victim.rid != r.rid:
            b.evict(victim)
            ctx.on_evict(victim)
            return True
    return False


def _make_room(ctx: PlanContext, r: ReqState, chunk: int, urgent: bool) -> int:
    """When KV, not time, cuts `r`'s chunk short: evict BE (and, for an urgent prompt,
    non-urgent RT) for the chunk time allows; the chunk after that."""
    b = ctx.batch
    left = r.prefill_len - r.prefilled
    by_time = ctx.timer.max_chunk(b, ctx.tau_s, prefix=r.prefilled, cap=min(left, b.prefill_left))
    if by_time <= chunk or (not r.is_running and b.running_slots < 1):
        return chunk
    view = ctx.view
    order = victim_order(
        view.be_running, view.rt_partial, lambda x: _slack(ctx, x), ctx.budget_s, include_rt=urgent
    )
    order = [v for v in order if v.rid != r.rid]
    if evict_for(b, prefill_cost(r, by_time, b.page), order, ctx.on_evict):
        return b.chunk_for(r, ctx.tau_s)
    return chunk


def _bound_by(ctx: PlanContext, r: ReqState, deadline: float, chunk: int) -> None:
    """A scheduled prompt's deadline bounds this iteration (unless it is hopeless): its
    first token is due by then, or its remaining chunks must fit before it."""
    if not math.isfinite(deadline):
        return
    left = r.prefill_len - r.prefilled - chunk  # after this chunk (prefilled not yet updated)
    iterations = 1 + (-(-left // max(1, chunk)) if left > 0 else 0)
    allowance = slack.allowance_s(deadline, ctx.now_s, iterations)
    if allowance < ctx.batch.time_s():
        return  # hopeless: it misses whatever this iteration does
    if left <= 0:
        ctx.batch.note_rt_token(deadline, deadline - ctx.now_s)
    ctx.hard_s = min(ctx.hard_s, allowance)
    ctx.cap_tau()


def _fill_window(ctx: PlanContext, window: list[tuple[ReqState, float, float]]) -> bool:
    """Non-urgent prompts of the window, best fit first, until τ is used up; True when the
    phase should stop (τ used up, or KV/admission refused)."""
    while window:
        if _full(ctx):
            return True
        i = _best_fit(ctx, window)
        r, _, deadline = window.pop(i)
        if _prefill(ctx, r, deadline, urgent=False) == STOP:
            return True
    return False


def _best_fit(ctx: PlanContext, window: list[tuple[ReqState, float, float]]) -> int:
    """AccelGen's best fit: the candidate whose (compute tokens, KV) demand is nearest to what
    is left (A_c tokens that fit in τ, A_m KV slots), both axes normalised so neither
    dominates by its unit. A prompt that finishes within A_c ranks before one that would be
    cut (its first token comes this iteration; BE fills any remainder anyway, so cutting a
    larger one buys no utilisation); ties go to the smaller slack (window order)."""
    b = ctx.batch
    a_c = max(1, ctx.timer.max_chunk(b, ctx.tau_s, prefix=0, cap=b.prefill_left))
    a_m = max(1, b.kv_avail)
    best, best_score = 0, (True, math.inf)
    for i, (r, _, _) in enumerate(window):
        left = r.prefill_len - r.prefilled
        d_c = min(left, a_c)
        d_m = prefill_cost(r, d_c, b.page)
        if d_m > a_m:
            continue
        score = (left > a_c, (1 - d_c / a_c) ** 2 + (1 - d_m / a_m) ** 2)
        if score[0] < best_score[0] or (
            score[0] == best_score[0] and score[1] < best_score[1] - 1e-12
        ):
            best, best_score = i, score
    return best
