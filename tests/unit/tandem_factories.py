"""Small factories for the tandem policy tests: RT/BE requests with targets, snapshots, a
policy with a simple linear latency model."""

from __future__ import annotations

from typing import Any

from backend.policy.latency import LatencyModel
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.types import ReqState, Snapshot
from common.wire import Tier
from tests.unit.sim_factories import make_snapshot

LATENCY = LatencyModel([0.010, 0.020, 0.001, 0.0, 0.0, 0.0, 0.0, 0.0])
"""10 ms per iteration + 20 ms per 1K prefill tokens + 1 ms per 1K decode context."""

NOW = 10.0
"""Planning time of every snapshot unless told otherwise."""


def make_request(
    rid: str,
    *,
    tier: Tier = "rt",
    prompt_len: int = 100,
    arrival_s: float = 9.9,
    generated: int = 0,
    running: bool = False,
    prefilled: int | None = None,
    max_new_tokens: int = 100,
    ttft_target_s: float | None = 0.5,
    tpot_target_s: float | None = 0.1,
    last_token_s: float | None = None,
    deadline_due_s: float | None = None,
    order_key: float = 0.0,
    length_key: str = "",
    tenant_id: str = "",
    tenant_weight: float = 1.0,
) -> ReqState:
    """A policy-side request. RT gets a TTFT deadline `ttft_target_s` after arrival and a TPOT
    target; one that generated tokens has emitted its last at `last_token_s` (default: NOW).
    Running ones are fully prefilled unless `prefilled` says otherwise."""
    is_rt = tier == "rt"
    state = ReqState(
        rid=rid,
        tier=tier,
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        prefill_len=prompt_len,
        generated=generated,
        is_running=running,
        order_key=order_key,
        length_key=length_key or tier,
        tenant_id=tenant_id,
        tenant_weight=tenant_weight,
        ttft_due_s=arrival_s + ttft_target_s if is_rt and ttft_target_s is not None else None,
        tpot_target_s=tpot_target_s if is_rt else None,
        deadline_due_s=deadline_due_s,
    )
    if generated:
        state.first_token_s = arrival_s + 0.01
        state.last_token_s = NOW if last_token_s is None else last_token_s
    if running:
        state.prefilled = prompt_len if prefilled is None else prefilled
        state.kv_tokens = state.prefilled + max(0, generated - 1)
    return state


def snapshot(
    *,
    waiting: list[ReqState] | None = None,
    running: list[ReqState] | None = None,
    kv_capacity: int = 100_000,
    **fields: Any,
) -> Snapshot:
    """A snapshot at NOW (per-tier waiting lists filled in)."""
    waiting = waiting or []
    fields.setdefault("now_s", NOW)
    snap = make_snapshot(waiting=waiting, running=running, kv_capacity=kv_capacity, **fields)
    snap.waiting_rt = [r for r in waiting if r.tier == "rt"]
    snap.waiting_be = [r for r in waiting if r.tier == "be"]
    return snap


def make_policy(**options: Any) -> TandemPolicy:
    """A tandem policy on LATENCY with `options` as TandemConfig fields."""
    return TandemPolicy(LATENCY, config=TandemConfig(**options))


def chunks(plan: Any) -> dict[str, int]:
    """rid → chunk tokens of a plan."""
    return {c.rid: c.tokens for c in plan.prefills}
