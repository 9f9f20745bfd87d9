"""tandem never plans an empty iteration while the engine has work it could run, even when its
latency model says every candidate is far too slow for the budget (a profile measured on a busy
machine: a real engine sat idle with 47 BE requests queued before this held). Hand-built
snapshots; budgets of 1 µs make every chunk "too slow"."""

from __future__ import annotations

from backend.policy.types import ReqState
from tests.unit.tandem_factories import chunks, make_policy, make_request, snapshot

NO_TIME = {"latency_budget_s": 1e-6, "idle_budget_s": 1e-6, "min_chunk_tokens": 64}


def _partial(rid: str, tier: str) -> ReqState:
    return make_request(rid, tier=tier, prompt_len=500, running=True, prefilled=128)  # type: ignore[arg-type]


def test_a_partial_be_prompt_gets_its_least_chunk() -> None:
    plan = make_policy(**NO_TIME).plan(snapshot(running=[_partial("be", "be")]))
    assert chunks(plan) == {"be": 64}


def test_a_partial_rt_prompt_alone_gets_its_least_chunk() -> None:
    plan = make_policy(**NO_TIME).plan(snapshot(running=[_partial("rt", "rt")]))
    assert chunks(plan) == {"rt": 64}


def test_an_idle_engine_admits_the_rt_head_before_the_be_head() -> None:
    rt = make_request("rt", prompt_len=500)
    be = make_request("be", tier="be", prompt_len=500)
    policy = make_policy(**NO_TIME)
    assert chunks(policy.plan(snapshot(waiting=[be, rt]))) == {"rt": 64}


def test_an_idle_engine_admits_the_be_head_when_no_rt_waits() -> None:
    be = make_request("be", tier="be", prompt_len=40)  # shorter than the least chunk: all of it
    assert chunks(make_policy(**NO_TIME).plan(snapshot(waiting=[be]))) == {"be": 40}


def test_progress_is_only_the_last_resort() -> None:
    be = make_request("be", tier="be", prompt_len=500)
    plan = make_policy(latency_budget_s=0.04, idle_budget_s=0.04).plan(snapshot(waiting=[be]))
    assert chunks(plan)["be"] > 64  # the budget allows more than the least chunk: it is used
