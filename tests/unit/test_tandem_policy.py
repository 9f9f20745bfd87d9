"""The tandem policy end to end: registry names, and short simulator runs (every plan feasible,
RT targets kept, BE served, no evictions) for tandem and each ablation."""

from __future__ import annotations

import random

import pytest

from backend.policy.registry import POLICY_NAMES, TANDEM_ABLATIONS, make_policy
from backend.policy.tandem.policy import TandemPolicy
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.source import ListSource, SimRequest
from tests.unit.sim_factories import make_request
from tests.unit.tandem_factories import LATENCY


def test_the_registry_builds_tandem_and_its_ablations() -> None:
    assert "tandem" in POLICY_NAMES and set(TANDEM_ABLATIONS) <= set(POLICY_NAMES)
    policy = make_policy("tandem", LATENCY, latency_budget_s=0.05)
    assert isinstance(policy, TandemPolicy) and policy.config.latency_budget_s == 0.05
    for name, switch in TANDEM_ABLATIONS.items():
        ablated = make_policy(name, LATENCY)
        assert isinstance(ablated, TandemPolicy) and ablated.name == name
        assert getattr(ablated.config, switch) is False
    with pytest.raises(ValueError):
        make_policy("tandem", LATENCY, latency_budget_s=-1.0)
    with pytest.raises(ValueError):
        make_policy("tandem", LATENCY, no_such_option=1)


def _mixed_workload(seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    reqs = [
        make_request(
            tier="rt",
            prompt_len=rng.randint(20, 800),
            output_len=rng.randint(1, 60),
            arrival_s=i * 0.05,
            ttft_target_s=0.5,
            tpot_target_s=0.1,
        )
        for i in range(200)
    ]
    reqs += [
        make_request(
            tier="be",
            prompt_len=rng.randint(500, 6000),
            output_len=rng.randint(5, 40),
            arrival_s=0.0,
            order_key=float(j),
        )
        for j in range(60)
    ]
    return reqs


@pytest.mark.parametrize("name", ["tandem", *TANDEM_ABLATIONS])
def test_a_short_mixed_run_keeps_rt_targets_and_serves_be(name: str) -> None:
    result = simulate(
        ListSource(_mixed_workload()),
        make_policy(name, LATENCY),
        LATENCY,
        SimConfig(kv_capacity_tokens=60_000),
    )
    assert all(r.finish_s is not None for r in result.requests)
    rt = [r for r in result.requests if r.tier == "rt"]
    ttft_met = sum(r.first_token_s is not None and r.first_token_s - r.arrival_s <= 0.5 for r in rt)
    assert ttft_met >= 0.99 * len(rt)
    for r in rt:
        gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
        assert not gaps or sum(gaps) / len(gaps) <= 0.1
    assert result.num_evictions == 0


def test_a_long_prompt_mix_where_8k_be_prompts_fill_the_pool_loses_nothing_and_rt_goes_first() -> (
    None
):
    # the bundled CPU engine's shape (16384-token pool, 16 slots); BE prompts of 8K+ tokens,
    # each half the pool or more, queued at once with deadlines; RT arrives all along
    rng = random.Random(1)
    be = [
        make_request(
            tier="be",
            prompt_len=rng.randint(8192, 12_000),
            output_len=rng.randint(5, 40),
            arrival_s=0.0,
            deadline_s=600.0,
            order_key=float(j),
        )
        for j in range(12)
    ]
    rt = [
        make_request(
            tier="rt",
            prompt_len=rng.randint(50, 600),
            output_len=rng.randint(1, 30),
            arrival_s=0.2 + i * 0.1,
            ttft_target_s=0.5,
            tpot_target_s=0.1,
        )
        for i in range(60)
    ]
    result = simulate(
        ListSource(be + rt),
        make_policy("tandem", LATENCY),
        LATENCY,
        SimConfig(kv_capacity_tokens=16_384, max_running=16),
    )
    assert all(r.finish_s is not None for r in result.requests)  # nothing lost, BE included
    done_rt = [r for r in result.requests if r.tier == "rt"]
    assert len(done_rt) == len(rt)
    ttft_met = sum(
        r.first_token_s is not None and r.first_token_s - r.arrival_s <= 0.5 for r in done_rt
    )
    assert ttft_met >= 0.95 * len(done_rt)
