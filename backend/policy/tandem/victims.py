"""Victims when KV runs out (BROS, synthesis C5): BE before RT; among BE the one with the least
progress (the least recompute lost); among RT the least urgent (largest slack); never an urgent
RT request, and never one already scheduled in this plan.

Evicted requests keep their generated tokens and wait again (the engine recomputes their KV on
re-admission); the caller re-queues them at the front of their tier (queues.*.requeue), so the
work resumes rather than restarts from the back of the line.
"""

from __future__ import annotations

from collections.abc import Callable

from backend.policy.common import choose_victims
from backend.policy.tandem.batch import TandemBatch
from backend.policy.types import ReqState


def progress(r: ReqState) -> tuple[int, int]:
    """How much work evicting `r` throws away: tokens generated, then prompt computed."""
    return r.generated, r.prefilled


def victim_order(
    be_running: list[ReqState],
    rt_running: list[ReqState],
    rt_slack: Callable[[ReqState], float],
    iteration_s: float,
    *,
    include_rt: bool,
) -> list[ReqState]:
    """Candidates in eviction order: BE by least progress, then (if `include_rt`) the RT ones
    that are not urgent, largest slack first."""
    order = sorted(be_running, key=progress)
    if include_rt:
        slacks = [(rt_slack(r), r) for r in rt_running]
        order += [r for s, r in sorted(slacks, key=lambda x: -x[0]) if s > iteration_s]
    return order


def evict_for(
    batch: TandemBatch,
    need_tokens: int,
    order: list[ReqState],
    on_evict: Callable[[ReqState], None],
) -> bool:
    """Evicts the shortest prefix of `order` (skipping scheduled or evicted requests) that
    makes `need_tokens` KV slots available; evicts nothing and returns False if that cannot be
    done. `on_evict` is told about each victim (to re-queue it)."""
    skip = batch.scheduled | set(batch.evictions)
    chosen = choose_victims(batch.kv_avail, need_tokens, order, batch.page, skip)
    if chosen is None:
        return False
    for victim in chosen:
        batch.evict(victim)
        on_evict(victim)
    return True
