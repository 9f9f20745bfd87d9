"""`rr`, `static-chunk`, `fixed-offline`: how each splits an iteration between the tiers."""

from __future__ import annotations

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


def test_fixed_offline_gives_be_the_same_share_whatever_the_rt_load() -> None:
    be_wait = make_req("be", tier="be", prompt_len=2000)
    policy = FixedOfflinePolicy(LATENCY, be_tokens=256)
    for rt_prompt in (10, 1500):
        rt_wait = make_req("rt", prompt_len=rt_prompt, arrival_s=1.0)
        plan = policy.plan(make_snapshot(waiting=[be_wait, rt_wait]))
        be_tokens = sum(c.tokens for c in plan.prefills if c.rid == "be")
        assert be_tokens == 256
    be_decoding = [make_req(f"b{i}", tier="be", running=True, generated=1) for i in range(300)]
    plan = policy.plan(make_snapshot(running=be_decoding, kv_capacity=40_000))
    assert len(plan.decodes) == 256  # the rest sit this iteration out and keep their KV
