"""`fcfs` (vLLM-like): arrival order, head-of-line admission, newest-first preemption."""

from __future__ import annotations

from backend.policy.baselines.fcfs import FcfsPolicy
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.source import ListSource
from tests.unit.sim_factories import LATENCY, make_req, make_request, make_snapshot


def test_admits_in_arrival_order_and_chunks_the_last_one() -> None:
    a = make_req("a", prompt_len=300, arrival_s=0.0, tier="be")
    b = make_req("b", prompt_len=100, arrival_s=1.0, tier="rt")
    plan = FcfsPolicy(LATENCY, token_budget=350).plan(make_snapshot(waiting=[a, b]))
    assert [(c.rid, c.tokens) for c in plan.prefills] == [("a", 300), ("b", 50)]


def test_a_head_that_does_not_fit_blocks_the_queue() -> None:
    a = make_req("a", prompt_len=300, arrival_s=0.0)
    b = make_req("b", prompt_len=100, arrival_s=1.0)
    plan = FcfsPolicy(LATENCY).plan(make_snapshot(waiting=[a, b], kv_capacity=250))
    assert plan.prefills == []  # b would fit, but FCFS does not skip ahead


def test_on_oom_the_newest_running_request_is_preempted() -> None:
    old = make_req("old", running=True, arrival_s=0.0, generated=2)
    new = make_req("new", running=True, arrival_s=1.0, generated=2)
    plan = FcfsPolicy(LATENCY).plan(make_snapshot(running=[old, new], kv_free=0))
    assert plan.evictions == ["new"] and plan.decodes == ["old"]


def test_first_tokens_come_in_arrival_order_on_the_engine() -> None:
    reqs = [
        make_request(
            rid=f"r{i}",
            arrival_s=i * 0.001,
            prompt_len=400 - i * 50,
            output_len=5,
            tier="rt" if i % 2 else "be",
        )
        for i in range(6)
    ]
    res = simulate(
        ListSource(reqs),
        FcfsPolicy(LATENCY, token_budget=256),
        LATENCY,
        SimConfig(kv_capacity_tokens=450),
    )
    firsts = [r.first_token_s for r in sorted(res.requests, key=lambda r: r.arrival_s)]
    assert firsts == sorted(firsts)  # type: ignore[type-var]
