"""Small factories for the simulator and baseline tests: requests, snapshots, a latency model."""

from __future__ import annotations

import itertools
from typing import Any

from backend.policy.latency import LatencyModel
from backend.policy.types import ReqState, Snapshot
from backend.sim.source import SimRequest
from common.wire import Tier

LATENCY = LatencyModel([0.010, 0.020, 0.001, 0.0, 0.0, 0.0, 0.0, 0.0])
"""10 ms per iteration + 20 ms per 1K prefill tokens + 1 ms per 1K decode context."""

_ids = itertools.count()


def make_request(
    *,
    tier: Tier = "rt",
    prompt_len: int = 100,
    output_len: int = 10,
    arrival_s: float = 0.0,
    max_new_tokens: int | None = None,
    rid: str | None = None,
    **fields: Any,
) -> SimRequest:
    """A workload request (true output length `output_len`, cap defaults to it)."""
    return SimRequest(
        rid=rid or f"{tier}{next(_ids)}",
        tier=tier,
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        output_len=output_len,
        max_new_tokens=output_len if max_new_tokens is None else max_new_tokens,
        **fields,
    )


def make_req(
    rid: str,
    *,
    tier: Tier = "rt",
    prompt_len: int = 100,
    arrival_s: float = 0.0,
    generated: int = 0,
    running: bool = False,
    prefilled: int | None = None,
    max_new_tokens: int = 100,
    true_output_len: int | None = None,
) -> ReqState:
    """A policy-side request. Running ones are fully prefilled unless `prefilled` says
    otherwise and hold KV for what they computed plus one slot per decode so far."""
    state = ReqState(
        rid=rid,
        tier=tier,
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        prefill_len=prompt_len,
        generated=generated,
        is_running=running,
        true_output_len=true_output_len,
    )
    if running:
        state.prefilled = prompt_len if prefilled is None else prefilled
        state.kv_tokens = state.prefilled + max(0, generated - 1)
    return state


def make_snapshot(
    *,
    waiting: list[ReqState] | None = None,
    running: list[ReqState] | None = None,
    kv_capacity: int = 10_000,
    kv_free: int | None = None,
    **fields: Any,
) -> Snapshot:
    """A snapshot; free KV defaults to capacity minus what the running requests hold."""
    running = running or []
    held = sum(r.kv_tokens for r in running)
    return Snapshot(
        now_s=fields.pop("now_s", 1.0),
        waiting=waiting or [],
        running=running,
        kv_capacity_tokens=kv_capacity,
        kv_free_tokens=kv_capacity - held if kv_free is None else kv_free,
        **fields,
    )
