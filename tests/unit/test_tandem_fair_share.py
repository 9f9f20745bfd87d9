"""tandem's weighted fair share among the tenants of a tier, on hand-built snapshots
(LATENCY: 10 ms + 20 ms per 1K prefill tokens + 1 ms per 1K decode context; NOW = 10 s): a
tenant's burst cannot keep another tenant's prompt waiting, decodes count in the counters, and
one tenant (or the switch off) plans exactly as before."""

from __future__ import annotations

from backend.policy.types import ReqState
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.source import ListSource
from tests.unit.sim_factories import make_request as sim_request
from tests.unit.tandem_factories import LATENCY, NOW, chunks, make_policy, make_request, snapshot


def burst_and_steady() -> tuple[list[ReqState], ReqState]:
    """Six 400-token prompts of `burst` that arrived first (earlier latest starts) and one of
    `steady` that arrived after them; a 30 ms budget holds two whole prompts."""
    burst = [
        make_request(
            f"burst-{i}", prompt_len=400, arrival_s=NOW - 0.1, ttft_target_s=5.0, tenant_id="burst"
        )
        for i in range(6)
    ]
    steady = make_request(
        "steady", prompt_len=400, arrival_s=NOW, ttft_target_s=5.0, tenant_id="steady"
    )
    return burst, steady


def test_a_bursting_tenant_cannot_keep_the_other_tenants_prompt_waiting() -> None:
    burst, steady = burst_and_steady()
    snap = snapshot(waiting=[*burst, steady])
    fair = make_policy(latency_budget_s=0.03).plan(snap)
    assert list(chunks(fair))[:2] == ["burst-0", "steady"]  # a tie, then the least served
    unfair = make_policy(latency_budget_s=0.03, use_fair_share=False).plan(
        snapshot(waiting=[*burst, steady])
    )
    assert "steady" not in chunks(unfair)  # latest-start order alone: all of burst first


def test_every_scheduled_token_is_charged_to_its_tenant_and_tier() -> None:
    decoding = make_request(
        "burst-run", running=True, generated=5, tenant_id="burst", tenant_weight=2.0
    )
    be = make_request("be-line", tier="be", prompt_len=100, tenant_id="batcher")
    policy = make_policy(latency_budget_s=0.03)
    plan = policy.plan(snapshot(waiting=[be], running=[decoding]))
    assert plan.decodes == ["burst-run"] and chunks(plan) == {"be-line": 100}
    assert policy.rt_fair.counter("burst") == 0.5  # one decode token at weight 2
    assert policy.be_fair.counter("batcher") == 100
    assert policy.rt_fair.counter("batcher") == 0  # tiers keep their own counters


def test_decodes_of_a_tenant_count_against_its_next_prompts() -> None:
    # both tenants wait; burst's 40 running requests fill the first iteration with decodes
    # (40 × 103 context: 14.12 ms of a 14.2 ms budget), so no prompt starts, and burst is
    # charged 40 tokens; in the next iteration steady's prompt goes first though burst's is older
    running = [
        make_request(f"run-{i}", running=True, generated=3, tenant_id="burst") for i in range(40)
    ]
    older = make_request(
        "burst-new", prompt_len=400, arrival_s=NOW - 0.1, ttft_target_s=5.0, tenant_id="burst"
    )
    newer = make_request(
        "steady", prompt_len=400, arrival_s=NOW, ttft_target_s=5.0, tenant_id="steady"
    )
    for fair, first in ((True, "steady"), (False, "burst-new")):
        policy = make_policy(latency_budget_s=0.0142, use_fair_share=fair, use_aimd=False)
        busy = policy.plan(snapshot(waiting=[older, newer], running=running))
        assert len(busy.decodes) == 40 and not busy.prefills
        plan = policy.plan(snapshot(waiting=[older, newer], now_s=NOW + 0.015))
        assert list(chunks(plan)) == [first]


def test_one_tenant_plans_as_with_the_switch_off() -> None:
    burst, _ = burst_and_steady()
    be = [make_request(f"be-{i}", tier="be", prompt_len=300, order_key=i) for i in range(5)]
    on = make_policy().plan(snapshot(waiting=[*burst, *be]))
    off = make_policy(use_fair_share=False).plan(snapshot(waiting=[*burst, *be]))
    assert on.prefills == off.prefills and on.decodes == off.decodes


def test_on_the_simulator_two_backlogged_tenants_get_tokens_by_weight() -> None:
    # two BE tenants with a backlog each, weights 2 : 1: while both are backlogged the engine
    # serves them prompt + output tokens 2 : 1 (one request's worth of slack: 220 tokens)
    reqs = [
        sim_request(
            tier="be",
            prompt_len=200,
            output_len=20,
            rid=f"{tenant}-{i}",
            tenant_id=tenant,
            tenant_weight=weight,
            order_key=float(i),
        )
        for tenant, weight in (("gold", 2.0), ("bronze", 1.0))
        for i in range(300)
    ]
    result = simulate(
        ListSource(reqs),
        make_policy(),
        LATENCY,
        SimConfig(kv_capacity_tokens=20_000, horizon_s=2.0),
    )
    served = dict.fromkeys(("gold", "bronze"), 0)
    for rec in result.requests:
        if rec.first_token_s is not None:
            served[rec.tenant_id] += rec.prompt_len + rec.generated
    assert all(rec.finish_s is None for rec in result.requests if rec.rid.endswith("-299"))
    assert served["bronze"] > 5_000
    assert abs(served["gold"] - 2 * served["bronze"]) <= 3 * 220
