"""BE phase (HyGen's offline phase, synthesis §4 step 4): BE gets the time RT left under τ and
the KV left after the RT headroom.

    limit = T(RT part) + BE share × (τ − T(RT part))        the share is AIMD-controlled
                                                            (1 when no RT is around)
          ≤ T(RT part) × (1 + rt_stretch)  when the batch carries RT work and rt_stretch is
                                           set (BE's part divided by what riders really
                                           cost against the model: feedback.RiderCost;
                                           RT tokens barely notice BE; × the first-token
                                           share when it emits RT first tokens; 0 while RT
                                           prompt work is left over: `rt_backlog`)
          ≥ T(RT part) + be_min_share × τ  when BE has work   (BE never starves; with
                                           rt_stretch: + be_min_share × T(RT part), and
                                           BE's be_min_time_share of it while BE is behind
                                           that share of the recent engine time and no RT
                                           prompt work is left over)
          ≤ hard cap                                        (never makes an RT token late)
    and τ itself was lowered to the tightest allowance of a running BE deadline
    (`cap_for_be_deadlines`, before the RT prompts: its JCT is kept, AccelGen)

    1. running BE decodes — deadline ones first, then the most advanced; those that do not fit
       the time sit the iteration out and keep their KV
    2. running partial BE prompts, then admissions in the BE queue's order (queues.BeQueue),
       each chunk cut exactly at the limit; new ones pass the Past-Future check under the BE
       limit (capacity·(1 − reserve) − RT headroom); at most one long BE prompt mid-prefill
"""

from __future__ import annotations

import itertools
import math

from backend.policy.common import decode_cost
from backend.policy.tandem import slack
from backend.policy.tandem.context import PlanContext
from backend.policy.tandem.victims import progress
from backend.policy.types import ReqState

KNEE_MARGIN = 0.1
"""A deadline-shortened iteration may still run this much past the decodes' own time."""


def run_be_phase(ctx: PlanContext) -> None:
    """Adds BE work to ctx.batch within the BE time limit."""
    view = ctx.view
    if not (view.be_decode or view.be_partial or len(ctx.be_queue)):
        return
    limit = be_time_limit(ctx)
    if ctx.decodes_allowed:
        _decode_be(ctx, limit)
    if not ctx.prefills_allowed:
        return
    b = ctx.batch
    for r in sorted(view.be_partial, key=lambda x: x.arrival_s):
        if b.time_s() >= limit:
            break
        if r.rid not in b.evictions and (chunk := b.chunk_for(r, limit)) > 0:
            b.add_prefill(r, chunk)
    _admit_be(ctx, limit)


def be_time_limit(ctx: PlanContext) -> float:
    """The time BE may fill this iteration up to (see the module docstring)."""
    cfg = ctx.config
    t_rt = ctx.batch.time_s()
    # the RT work BE's allowance is measured against: the batch so far, and in the prompts'
    # half of a split iteration the decodes it holds back (they run next, as late as BE makes
    # this one)
    rt_work_s = t_rt + ctx.deferred_rt_decode_s
    share = ctx.be_frac if ctx.has_rt else 1.0  # the share protects RT; alone, BE takes all
    if ctx.batch.first_tokens:
        share *= cfg.first_token_be_frac  # BE time here delays RT first tokens (TTFT)
    limit = t_rt + share * max(0.0, ctx.tau_s - t_rt)
    floor = t_rt + cfg.be_min_share * min(ctx.tau_s, ctx.budget_s)
    if cfg.rt_stretch is not None and rt_work_s > 0.0:
        stretch = cfg.rt_stretch  # the batch so far is all RT
        # An RT request's first token reaches its client with the *next* iteration's output
        # (SGLang streams it then; on the CPU engine 8-14 ms after its prefill ends), so the
        # iteration after a first token is still on its TTFT.
        if ctx.batch.first_tokens or any(r.generated <= 1 for r in ctx.view.rt_decode):
            stretch *= cfg.first_token_be_frac
        if ctx.rt_backlog:
            # RT prompts wait for time: BE is paused down to its starvation floor before any
            # RT request waits for it (without this, at the RT load the engine can just carry,
            # BE's stretch and time share took the capacity the SLO admission then shed RT for)
            stretch = 0.0
        # BE's shares below are of the RT work's time; in the model's terms BE's part is what
        # it may really take divided by what riders really cost against their prediction
        rt_ref_s = rt_work_s / ctx.rider_cost
        limit = min(limit, t_rt + stretch * rt_ref_s)
        # the floor in the stretch's terms: a share of the RT work's own time, not of τ (on an
        # engine whose τ is 10× its RT iterations, 5 % of τ would double them)
        floor = t_rt + cfg.be_min_share * rt_ref_s
        if ctx.be_time_share < cfg.be_min_time_share and not ctx.rt_backlog:
            # BE fell behind its share
            kept = cfg.be_min_time_share / (1.0 - cfg.be_min_time_share)
            floor = max(floor, t_rt + kept * rt_ref_s)
    return min(max(limit, floor), ctx.hard_s)


def rt_slots_kept(frac: float, max_running: int) -> int:
    """Request slots BE admissions leave to RT: `frac` of a finite engine cap (an engine that
    reports no cap, 2**20 or more, keeps none)."""
    if max_running >= 1 << 20:
        return 0
    return math.ceil(frac * max_running)


def cap_for_be_deadlines(ctx: PlanContext) -> None:
    """Lowers τ to the tightest per-iteration allowance of a running BE request with a
    deadline (AccelGen's JCT conversion), but never below the decodes' own time plus
    `KNEE_MARGIN`: up to there prefill mostly rides in the memory-bound decode time for free,
    so admissions go on while the iterations stay short. A request whose allowance is below
    that floor is past helping and does not shrink every iteration for nothing."""
    reqs = [r for r in ctx.view.be_running if r.deadline_due_s is not None]
    if not reqs:
        return
    contexts = [r.prompt_len + r.generated for r in ctx.view.be_decode]
    floor = ctx.timer.with_decodes(
        ctx.batch, len(contexts), sum(contexts), sum([c * c for c in contexts])
    )
    totals = ctx.lengths.totals(reqs)
    cap = math.inf
    for r, total in zip(reqs, totals.tolist(), strict=True):
        left = r.prefill_len - r.prefilled
        prefill = (
            slack.standalone_prefill_s(ctx.timer, left, r.prefilled, ctx.max_prefill)
            if left > 0
            else 0.0
        )
        allowance = slack.be_allowance_s(r, ctx.now_s, int(total), prefill)
        if allowance >= floor:
            cap = min(cap, allowance)
    ctx.tau_s = min(ctx.tau_s, max(cap, floor * (1 + KNEE_MARGIN)))


def _decode_order(r: ReqState) -> tuple[float, int]:
    """Deadline ones first (earliest deadline), then the most advanced (closest to freeing
    its KV)."""
    return (r.deadline_due_s if r.deadline_due_s is not None else math.inf, -r.generated)


def _decode_be(ctx: PlanContext, limit: float) -> None:
    """Running BE decodes within the time limit; when KV is short the least advanced BE
    requests are evicted so that the others can go on (else a pool full of half-done BE
    requests would wait on each other for ever)."""
    b = ctx.batch
    decodes = [r for r in ctx.view.be_decode if r.rid not in b.evictions]
    if not decodes or b.time_s() >= limit:
        # No time for BE here (`rt_stretch` 0 and no floor: an RT iteration is RT's alone).
        # Checked before any decode is added, as for BE prompts: a prediction may call decode
        # rows free, or cheaper than free (an RT prefill alone is timed at the PREFILL regime's
        # calibration factor, with decodes beside it at the MIXED one, which a machine can
        # have learned lower; NNLS can zero their weights), but on the engine they never are.
        return
    decodes.sort(key=_decode_order)
    contexts = [r.prompt_len + r.generated for r in decodes]
    if ctx.timer.with_decodes(
        b, len(decodes), sum(contexts), sum([c * c for c in contexts])
    ) <= limit and b.add_decodes(decodes):
        return
    need = sum(decode_cost(r, b.page) for r in decodes)
    if need > b.kv_avail:
        keep = sorted(decodes, key=progress, reverse=True)
        while keep and need > b.kv_avail:
            victim = keep.pop()
            need -= decode_cost(victim, b.page)
            b.evict(victim)
            ctx.on_evict(victim)
        decodes = [r for r in decodes if r.rid not in b.evictions]
    timer = ctx.timer
    contexts = [r.prompt_len + r.generated for r in decodes]
    # the shortest context still to come: a row's predicted cost grows with its context and
    # the batch only grows, so once even that one does not fit, none of the rest does (one
    # prediction instead of one per BE row when RT leaves no time, the common case)
    shortest_left = list(itertools.accumulate(reversed(contexts), min))[::-1]
    for i, r in enumerate(decodes):
        if timer.with_decodes(b, 1, shortest_left[i]) > limit:
            break
        if shortest_left[i] != contexts[i] and timer.with_decodes(b, 1, contexts[i]) > limit:
            continue  # skipped this iteration; keeps its KV
        b.add_decode(r)


def _admit_be(ctx: PlanContext, limit: float) -> None:
    """Admissions in BE queue order while time, KV and the future peak allow."""
    b, cfg = ctx.batch, ctx.config
    slots_kept = rt_slots_kept(cfg.rt_slot_reserve_frac, b.max_running)
    for r in ctx.be_queue.candidates(ctx.now_s):
        if b.time_s() >= limit or b.running_slots <= slots_kept:
            break
        if ctx.era_blocked(r, "be"):
            continue
        chunk = b.chunk_for(r, limit)
        if chunk <= 0:
            break
        aged = ctx.now_s - r.arrival_s > cfg.be_max_wait_s
        if cfg.use_pastfuture and not ctx.admission.admit_be(
            r, limit=ctx.admission.rt_limit if aged else None
        ):
            break  # head of line: a smaller request behind it must not overtake forever
        b.add_prefill(r, chunk)
        ctx.started(r, chunk, "be")
        ctx.be_queue.take(r)
    ctx.be_queue.restore()
