"""`priority`, `aggressive`, `conservative` (SGLang-style): tier order, preemption for RT,
prefill-first batches, new_token_ratio, and what the output reservation does to evictions."""

from __future__ import annotations

import pytest

from backend.policy.baselines.sglang_like import SglangLikePolicy
from backend.policy.registry import make_policy
from backend.policy.types import IterationResult, Plan, Policy
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.records import SimResult
from backend.sim.source import ListSource
from tests.unit.sim_factories import LATENCY, make_req, make_request, make_snapshot


def _observe(policy: Policy, plan: Plan) -> None:
    policy.observe(IterationResult(start_s=0.0, duration_s=0.01, plan=plan))


def test_priority_preempts_be_for_an_rt_prompt_that_does_not_fit() -> None:
    be = make_req("be", tier="be", prompt_len=900, running=True, generated=5)
    rt = make_req("rt", tier="rt", prompt_len=200, arrival_s=1.0)
    snap = make_snapshot(waiting=[rt], running=[be], kv_capacity=1000)
    plan = make_policy("priority", LATENCY).plan(snap)
    assert plan.evictions == ["be"] and [c.rid for c in plan.prefills] == ["rt"]
    # without priority preemption (aggressive) the RT request waits and BE keeps decoding
    plan = make_policy("aggressive", LATENCY).plan(snap)
    assert plan.evictions == [] and plan.prefills == [] and plan.decodes == ["be"]


def test_priority_preempts_the_newest_be_request_for_a_request_slot() -> None:
    # every request slot taken, KV to spare: SGLang 0.5.23 preempts for a full batch too
    old_be = make_req("old-be", tier="be", running=True, generated=3, arrival_s=0.0)
    new_be = make_req("new-be", tier="be", running=True, generated=3, arrival_s=0.5)
    rt_running = make_req("rt-running", running=True, generated=3, arrival_s=0.2)
    rt = make_req("rt", tier="rt", prompt_len=100, arrival_s=1.0)
    be = make_req("be", tier="be", prompt_len=100, arrival_s=0.9)
    snap = make_snapshot(waiting=[rt, be], running=[old_be, rt_running, new_be], max_running=3)
    plan = make_policy("priority", LATENCY).plan(snap)
    assert plan.evictions == ["new-be"] and [c.rid for c in plan.prefills] == ["rt"]
    # a BE request does not preempt for a slot, nor does RT where only RT holds them
    plan = make_policy("priority", LATENCY).plan(
        make_snapshot(waiting=[be], running=[old_be, rt_running, new_be], max_running=3)
    )
    assert plan.evictions == [] and plan.prefills == []
    only_rt = [make_req(f"rt{i}", running=True, generated=3) for i in range(3)]
    plan = make_policy("priority", LATENCY).plan(
        make_snapshot(waiting=[rt], running=only_rt, max_running=3)
    )
    assert plan.evictions == [] and plan.prefills == []
    # without priority preemption (aggressive) the RT request waits for a slot
    plan = make_policy("aggressive", LATENCY).plan(snap)
    assert plan.evictions == [] and plan.prefills == []


def test_rt_is_queued_before_be_and_prefill_batches_stall_decodes() -> None:
    be = make_req("be", tier="be", prompt_len=500, arrival_s=0.0)
    rt = make_req("rt", tier="rt", prompt_len=500, arrival_s=1.0)
    running = make_req("r", running=True, generated=3)
    policy = SglangLikePolicy(LATENCY, chunk_tokens=600)
    plan = policy.plan(make_snapshot(waiting=[be, rt], running=[running]))
    assert [(c.rid, c.tokens) for c in plan.prefills] == [("rt", 500), ("be", 100)]
    assert plan.decodes == []  # SGLang runs a prefill batch or a decode batch, not both


def test_with_mixed_chunks_decodes_ride_along_with_the_prefill_batch() -> None:
    # SGLang's --enable-mixed-chunk (tandem's launcher passes it to every engine): the running
    # decodes join the prefill batch, whose chunk budget loses one token per running request
    be = make_req("be", tier="be", prompt_len=500, arrival_s=0.0)
    rt = make_req("rt", tier="rt", prompt_len=500, arrival_s=1.0)
    running = [make_req(f"r{i}", running=True, generated=3) for i in range(2)]
    policy = SglangLikePolicy(LATENCY, chunk_tokens=600, mixed_chunk=True)
    plan = policy.plan(make_snapshot(waiting=[be, rt], running=running))
    assert [(c.rid, c.tokens) for c in plan.prefills] == [("rt", 500), ("be", 98)]
    assert plan.decodes == ["r0", "r1"]
    # decodes whose KV does not fit after the prefill sit the iteration out: no retraction
    # (no output reservation here, so the prompt is admitted with one KV slot to spare)
    tight = SglangLikePolicy(LATENCY, reserve="none", chunk_tokens=600, mixed_chunk=True)
    plan = tight.plan(make_snapshot(waiting=[rt], running=running, kv_free=501))
    assert [c.rid for c in plan.prefills] == ["rt"] and plan.decodes == [] and not plan.evictions
    # no prefill to run: a plain decode batch, as without mixed chunks
    plan = policy.plan(make_snapshot(running=running))
    assert plan.prefills == [] and plan.decodes == ["r0", "r1"]


def test_new_token_ratio_decays_per_decode_batch_and_jumps_on_retraction() -> None:
    policy = SglangLikePolicy(LATENCY)
    r = make_req("r", running=True, generated=3)
    _observe(policy, policy.plan(make_snapshot(running=[r])))
    assert policy.ratio == pytest.approx(0.7 - 0.001, abs=1e-5)
    assert policy.ratio_min == pytest.approx(0.7 * 0.14)
    rt = make_req("rt", running=True, generated=50, max_new_tokens=100)
    be = make_req("be", tier="be", running=True, generated=10)
    plan = policy.plan(make_snapshot(running=[rt, be], kv_free=1))
    assert plan.evictions == ["be"] and plan.decodes == ["rt"]  # lower tier retracted
    _observe(policy, plan)
    assert policy.ratio == pytest.approx((50 + 20) / 101)


def _squeeze(name: str) -> SimResult:
    """One tier, 8 requests whose outputs outgrow a pool that holds all their prompts."""
    reqs = [
        make_request(prompt_len=100, output_len=200, max_new_tokens=300, arrival_s=i * 1e-3)
        for i in range(8)
    ]
    policy = make_policy(name, LATENCY)
    config = SimConfig(kv_capacity_tokens=2000, reveal_lengths=name == "oracle")
    return simulate(ListSource(reqs), policy, LATENCY, config)


def test_conservative_never_evicts_where_aggressive_does() -> None:
    aggressive, conservative = _squeeze("aggressive"), _squeeze("conservative")
    assert aggressive.num_evictions > 0
    assert conservative.num_evictions == 0
    assert max(conservative.iterations.num_running) < max(aggressive.iterations.num_running)
    for res in (aggressive, conservative):
        assert all(r.finish_s is not None for r in res.requests)


def test_the_oracle_evicts_nothing_and_packs_more_than_conservative() -> None:
    oracle, conservative = _squeeze("oracle"), _squeeze("conservative")
    assert oracle.num_evictions == 0
    assert max(oracle.iterations.num_running) > max(conservative.iterations.num_running)
    assert oracle.end_s < conservative.end_s
