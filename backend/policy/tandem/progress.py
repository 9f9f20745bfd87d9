"""Liveness: a plan is never empty while the engine has work it could run.

The phases before this one plan within time budgets predicted by the latency model; when the
model overestimates the engine (a profile measured on a busy machine, a factor the calibration
has not learned yet), every candidate can look too slow for the budget and the plan comes out
empty. Nothing else changes an engine's state, so an empty plan with work queued is an engine
idle for good. `ensure_progress` runs after the phases, only when they planned nothing.
"""

from __future__ import annotations

from backend.policy.tandem.context import PlanContext


def ensure_progress(ctx: PlanContext) -> None:
    """An empty plan would stall the engine (nothing else changes its state): run the BE
    decodes, or else the oldest partial prompt's next chunk (RT before BE), whatever the time
    limit says; on an idle engine, admit the head of the RT queue, else of the BE queue, under
    the RT limit alone (the headroom is for RT requests that have not come; on an idle engine
    it may not block all progress). A chunk the limit leaves no room for is cut to the least
    worth computing (`TandemBatch.least_chunk`): the latency model may overestimate the
    engine, and an idle engine with work queued is never right."""
    b = ctx.batch
    decodes = [r for r in ctx.view.be_decode if r.rid not in b.evictions]
    if decodes and b.add_decodes(decodes):
        return
    limit = max(ctx.tau_s, ctx.budget_s)
    partial = sorted(ctx.view.rt_partial, key=lambda x: x.arrival_s) + sorted(
        ctx.view.be_partial, key=lambda x: x.arrival_s
    )
    for r in partial:
        if r.rid in b.evictions:
            continue
        chunk = b.chunk_for(r, limit) or b.least_chunk(r)
        if chunk > 0:
            b.add_prefill(r, chunk)
            return
    if ctx.view.rt_running or ctx.view.be_running:
        return
    for r in ctx.rt_queue.candidates(ctx.now_s):  # the head only
        chunk = b.chunk_for(r, limit) or b.least_chunk(r)
        if chunk > 0 and ctx.admission.admit_rt(r):
            b.add_prefill(r, chunk)
            ctx.started(r, chunk, "rt")
            ctx.rt_queue.take(r)
        break
    ctx.rt_queue.restore()
    if b.prefills:
        return
    for r in ctx.be_queue.candidates(ctx.now_s):  # the head only
        chunk = b.chunk_for(r, limit) or b.least_chunk(r)
        if chunk > 0 and ctx.admission.admit_be(r, limit=ctx.admission.rt_limit):
            b.add_prefill(r, chunk)
            ctx.started(r, chunk, "be")
            ctx.be_queue.take(r)
        break
    ctx.be_queue.restore()
