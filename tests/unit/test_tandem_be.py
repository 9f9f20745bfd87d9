"""tandem's BE phase on hand-built snapshots (LATENCY: 10 ms + 20 ms per 1K prefill tokens +
1 ms per 1K decode context), and BE starvation freedom in the simulator."""

from __future__ import annotations

import pytest

from backend.policy.types import Plan, ReqState
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.source import ListSource
from tests.unit.sim_factories import make_request as make_sim_request
from tests.unit.tandem_factories import LATENCY, NOW, chunks, make_policy, make_request, snapshot


def test_be_fills_only_the_time_rt_leaves() -> None:
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)  # 10 + 10 ms
    be = make_request("be", tier="be", prompt_len=5000)
    policy = make_policy(latency_budget_s=0.04, be_frac_init=1.0)
    plan = policy.plan(snapshot(waiting=[rt, be]))
    assert plan.prefills[0].rid == "rt"
    assert chunks(plan) == {"rt": 500, "be": 1000}  # 20 ms left under τ = 40 ms
    assert plan.predicted_s == pytest.approx(0.04)


def test_the_be_share_limits_be_while_rt_is_around() -> None:
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)
    be = make_request("be", tier="be", prompt_len=5000)
    plan = make_policy(latency_budget_s=0.04, be_frac_init=0.25).plan(snapshot(waiting=[rt, be]))
    assert chunks(plan)["be"] == 250  # a quarter of the 20 ms left


def test_be_alone_gets_the_idle_budget() -> None:
    be = make_request("be", tier="be", prompt_len=5000)
    plan = make_policy(idle_budget_s=0.06, be_frac_init=0.25).plan(snapshot(waiting=[be]))
    assert abs(chunks(plan)["be"] - 2500) <= 1  # 10 + 20·c/1000 ≤ 60 ms


def _rt_decodes() -> list[ReqState]:
    """Ten running RT decodes at 2K context: 10 + 20 ms of an iteration."""
    return [make_request(f"rt{i}", prompt_len=1999, running=True, generated=1) for i in range(10)]


def _be_decode(rid: str, *, context: int, generated: int = 1) -> ReqState:
    """A running BE decode without a deadline attending to *context* tokens."""
    return make_request(
        rid,
        tier="be",
        prompt_len=context - generated,
        running=True,
        generated=generated,
        deadline_due_s=None,
    )


def _plan_at_45_ms(running: list[ReqState]) -> Plan:
    """BE may use all of a 45 ms iteration's time RT leaves, with no floor."""
    return make_policy(latency_budget_s=0.045, be_frac_init=1.0, be_min_share=0.0).plan(
        snapshot(running=running)
    )


def test_be_decodes_that_do_not_fit_sit_out_and_keep_their_kv() -> None:
    # RT decodes take 10 + 20 ms; each BE decode at 10K context adds 10 ms; τ = 45 ms
    rt = _rt_decodes()
    be = [_be_decode(f"be{i}", context=10_000) for i in range(3)]
    plan = _plan_at_45_ms(rt + be)
    assert set(plan.decodes) >= {r.rid for r in rt}
    assert len([d for d in plan.decodes if d.startswith("be")]) == 1
    assert plan.evictions == []


def test_a_short_be_decode_rides_behind_longer_ones_that_do_not_fit() -> None:
    # RT decodes take 10 + 20 ms of τ = 45 ms; the two most advanced BE rows attend to 20K
    # tokens each (20 ms more: neither fits), the last one to 2K (2 ms: it fits)
    be = [_be_decode(f"long{i}", context=20_000, generated=5) for i in range(2)]
    be.append(_be_decode("short", context=2_000))
    plan = _plan_at_45_ms(_rt_decodes() + be)
    assert [d for d in plan.decodes if not d.startswith("rt")] == ["short"]
    assert plan.evictions == []


def test_be_with_a_deadline_goes_first() -> None:
    plain = make_request("plain", tier="be", prompt_len=800, order_key=0, arrival_s=1.0)
    due = make_request(
        "due", tier="be", prompt_len=800, order_key=5, arrival_s=2.0, deadline_due_s=NOW + 30.0
    )
    plan = make_policy(idle_budget_s=0.027, min_chunk_tokens=64).plan(
        snapshot(waiting=[plain, due])
    )
    assert chunks(plan) == {"due": 800}


def test_be_admission_follows_the_callers_order_and_ages() -> None:
    first = make_request("b", tier="be", prompt_len=800, order_key=0, arrival_s=NOW - 1)
    second = make_request("a", tier="be", prompt_len=800, order_key=1, arrival_s=NOW - 2)
    plan = make_policy(idle_budget_s=0.027, be_order_prob=1.0, min_chunk_tokens=64).plan(
        snapshot(waiting=[second, first])
    )
    assert chunks(plan) == {"b": 800}
    old = make_request("old", tier="be", prompt_len=800, order_key=9, arrival_s=NOW - 100)
    plan = make_policy(
        idle_budget_s=0.027, be_order_prob=1.0, be_max_wait_s=60.0, min_chunk_tokens=64
    ).plan(snapshot(waiting=[old, first]))
    assert chunks(plan) == {"old": 800}


def _overload(be_min_share: float) -> tuple[list[float | None], list[float | None]]:
    """30 s of RT prompts at twice what the engine can prefill, plus 20 BE requests at t = 0:
    (BE finish times, RT first-token times)."""
    rt = [
        make_sim_request(
            tier="rt",
            prompt_len=2000,
            output_len=2,
            arrival_s=i * 0.02,
            ttft_target_s=30.0,
            tpot_target_s=1.0,
        )
        for i in range(1500)
    ]
    be = [
        make_sim_request(tier="be", prompt_len=400, output_len=5, arrival_s=0.0) for _ in range(20)
    ]
    # Without the SLO admission: the RT backlog must reach the engine (the admission would shed
    # what the engine cannot prefill in time, and RT would never be backlogged).
    policy = make_policy(latency_budget_s=0.05, be_min_share=be_min_share, slo_admission=False)
    result = simulate(
        ListSource(rt + be), policy, LATENCY, SimConfig(kv_capacity_tokens=200_000, horizon_s=120.0)
    )
    return (
        [r.finish_s for r in result.requests if r.tier == "be"],
        [r.first_token_s for r in result.requests if r.tier == "rt"],
    )


def test_be_never_starves_under_sustained_rt_load() -> None:
    """The RT queue stays backlogged for over a minute, yet every BE request finishes within
    seconds: BE keeps a minimum share of every iteration. Without it BE would wait for the RT
    backlog to drain."""
    be_finish, rt_first = _overload(be_min_share=0.05)
    assert all(t is not None for t in be_finish + rt_first)
    last_be = max(t for t in be_finish if t is not None)
    assert last_be < 10.0  # bounded: a few seconds of a 30-s RT backlog
    assert max(t for t in rt_first if t is not None) > 3 * last_be  # RT was backlogged
    starved, _ = _overload(be_min_share=0.0)
    assert min(t for t in starved if t is not None) > 60.0
