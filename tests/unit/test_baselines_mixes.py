"""`rr`, `static-chunk`, `fixed-offline`: how each splits an iteration between the tiers."""

from __future__ import annotations

import pytest

from backend.policy.baselines.rr import RoundRobinPolicy
from backend.policy.baselines.two_phase import FixedOfflinePolicy, StaticChunkPolicy
from backend.policy.types import IterationResult, Plan
from tests.unit.sim_factories import LATENCY, make_req, make_snapshot


def _tokens(plan: Plan) -> int:
    return len(plan.decodes) + sum(c.tokens for c in plan.prefills)


def test_rr_alternates_the_tiers_and_skips_an_idle_one() -> None:
    rt = make_req("rt", running=True, generated=2)
    be = make_req("be", tier="be", running=True, generated=2)
    policy = RoundRobinPolicy(LATENCY)
    served = []
    for _ in range(4):
        plan = policy.plan(make_snapshot(running=[rt, be]))
        served.append(plan.decodes)
        policy.observe(IterationResult(start_s=0.0, duration_s=0.01, plan=plan))
    assert served == [["rt"], ["be"], ["rt"], ["be"]]
    only_rt = [policy.plan(make_snapshot(running=[rt])).decodes for _ in range(2)]
    assert only_rt == [["rt"], ["rt"]]


def test_static_chunk_keeps_its_budget_and_be_fills_what_rt_leaves() -> None:
    decoding = [make_req(f"d{i}", running=True, generated=1) for i in range(3)]
    rt_wait = make_req("rt", prompt_len=1000, arrival_s=2.0)
    be_wait = make_req("be", tier="be", prompt_len=1000, arrival_s=1.0)
    policy = StaticChunkPolicy(LATENCY, chunk_tokens=512)
    plan = policy.plan(make_snapshot(waiting=[be_wait, rt_wait], running=decoding))
    assert _tokens(plan) == 512
    assert [(c.rid, c.tokens) for c in plan.prefills] == [("rt", 509)]  # online first
    plan = policy.plan(make_snapshot(waiting=[be_wait], running=decoding))
    assert [(c.rid, c.tokens) for c in plan.prefills] == [("be", 509)]  # BE takes the rest


def _admitted_over(policy: FixedOfflinePolicy, seconds: float, rt_prompt: int | None) -> int:
    """BE admissions in `seconds` of 10-ms plans, with a fresh backlog of BE requests (and an
    RT prompt waiting in every plan when `rt_prompt` is set)."""
    admitted = 0
    for step in range(int(seconds / 0.01)):
        waiting = [make_req(f"be{step}-{i}", tier="be", prompt_len=50) for i in range(3)]
        if rt_prompt is not None:
            waiting.append(make_req(f"rt{step}", prompt_len=rt_prompt, arrival_s=0.5))
        busy = make_req("rt-decoding", running=True, generated=1)  # the engine is never idle
        plan = policy.plan(
            make_snapshot(
                waiting=waiting, running=[busy], now_s=1.0 + step * 0.01, kv_capacity=1_000_000
            )
        )
        admitted += sum(1 for c in plan.prefills if c.rid.startswith("be"))
    return admitted


def test_fixed_offline_admits_be_at_its_rate_whatever_the_rt_load() -> None:
    for rt_prompt in (None, 10, 1500):
        policy = FixedOfflinePolicy(LATENCY, be_rate_req_s=5.0)
        assert _admitted_over(policy, 10.0, rt_prompt) == pytest.approx(50, abs=3), rt_prompt
    assert _admitted_over(FixedOfflinePolicy(LATENCY, be_rate_req_s=0.0), 2.0, 10) == 0


def test_fixed_offline_shares_one_budget_rt_first() -> None:
    decoding = [make_req(f"d{i}", running=True, generated=1) for i in range(3)]
    be_partial = make_req("bp", tier="be", prompt_len=4000, running=True, prefilled=1000)
    rt_wait = make_req("rt", prompt_len=1000, arrival_s=2.0)
    policy = FixedOfflinePolicy(LATENCY, token_budget=2048, be_rate_req_s=0.0)
    plan = policy.plan(make_snapshot(waiting=[rt_wait], running=[*decoding, be_partial]))
    assert _tokens(plan) == 2048
    assert [(c.rid, c.tokens) for c in plan.prefills] == [("rt", 1000), ("bp", 1045)]


def test_fixed_offline_idle_engine_takes_a_slot_early_and_pays_it_back() -> None:
    policy = FixedOfflinePolicy(LATENCY, be_rate_req_s=1.0)
    be = [make_req(f"be{i}", tier="be", prompt_len=50) for i in range(3)]
    first = policy.plan(make_snapshot(waiting=be, now_s=1.0))
    assert [c.rid for c in first.prefills] == ["be0"]  # nothing else would run: no stall
    running = make_req("be0", tier="be", prompt_len=50, running=True, generated=1)
    later = policy.plan(make_snapshot(waiting=be[1:], running=[running], now_s=1.5))
    assert later.prefills == []  # the slot taken early is paid for
    again = policy.plan(make_snapshot(waiting=be[1:], running=[running], now_s=3.01))
    assert [c.rid for c in again.prefills] == ["be1"]


def test_fixed_offline_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="be_rate_req_s"):
        FixedOfflinePolicy(LATENCY, be_rate_req_s=-1.0)
    with pytest.raises(ValueError, match="token_budget"):
        FixedOfflinePolicy(LATENCY, token_budget=0)
