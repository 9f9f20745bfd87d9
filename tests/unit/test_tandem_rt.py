"""tandem's RT phase on hand-built snapshots (LATENCY: 10 ms + 20 ms per 1K prefill tokens +
1 ms per 1K decode context; planning time NOW = 10 s)."""

from __future__ import annotations

import pytest

from backend.policy.latency import BatchShape
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.types import IterationResult, ReqState
from tests.unit.tandem_factories import LATENCY, NOW, chunks, make_policy, make_request, snapshot


def test_an_urgent_rt_prompt_evicts_the_be_request_with_the_least_progress() -> None:
    little = make_request("be-little", tier="be", prompt_len=400, running=True, generated=1)
    much = make_request("be-much", tier="be", prompt_len=350, running=True, generated=51)
    urgent = make_request("rt", prompt_len=300, arrival_s=NOW - 0.46)  # due in 40 ms
    snap = snapshot(waiting=[urgent], running=[little, much], kv_capacity=1000)
    plan = make_policy(latency_budget_s=0.03).plan(snap)
    assert plan.evictions == ["be-little"]
    assert chunks(plan) == {"rt": 300}
    assert "be-much" in plan.decodes


def test_an_rt_prompt_that_would_overflow_the_future_peak_waits_and_evicts_nothing() -> None:
    # 800 held + 100 to prefill + 100 predicted output (cold start: max_new_tokens) = 1000;
    # a newcomer of 300 + 100 would take the peak past capacity × 0.95
    rt_partial = make_request(
        "rt-partial", prompt_len=900, running=True, prefilled=800, arrival_s=NOW - 0.2
    )
    fresh = make_request("rt-new", prompt_len=300, arrival_s=NOW)
    be = make_request("be", tier="be", prompt_len=50, running=True, generated=3)
    snap = snapshot(waiting=[fresh], running=[rt_partial, be], kv_capacity=1100)
    plan = make_policy().plan(snap)
    assert plan.evictions == []
    assert chunks(plan) == {"rt-partial": 100}


def test_chunks_fill_the_time_budget_exactly() -> None:
    # L = 50 ms, no decodes: 10 + 20·c/1000 ≤ 50  ⇒  c = 2000 (the cut falls at the budget)
    plan = make_policy(latency_budget_s=0.05).plan(
        snapshot(waiting=[make_request("long", prompt_len=5000, ttft_target_s=5.0)])
    )
    assert chunks(plan) == {"long": 2000}
    assert plan.predicted_s == pytest.approx(0.05)
    # with ten decodes at 1K context (10 ms) the chunk shrinks to what is left: 1500
    decodes = [make_request(f"d{i}", prompt_len=995, running=True, generated=5) for i in range(10)]
    plan = make_policy(latency_budget_s=0.05).plan(
        snapshot(
            waiting=[make_request("long", prompt_len=5000, ttft_target_s=5.0)], running=decodes
        )
    )
    assert chunks(plan) == {"long": 1500}
    assert plan.predicted_s == pytest.approx(0.05)


def test_a_tight_decode_deadline_bounds_tau() -> None:
    # TPOT 20 ms, last token now: τ = (1 − ε)·20 ms = 18 ms with ε = 0.1
    decoding = make_request("d", prompt_len=99, running=True, generated=1, tpot_target_s=0.02)
    waiting = make_request("w", prompt_len=2000, ttft_target_s=5.0)
    plan = make_policy(latency_budget_s=0.05, eps_init=0.1).plan(
        snapshot(waiting=[waiting], running=[decoding])
    )
    c = chunks(plan)["w"]
    tau = 0.9 * 0.02
    base = BatchShape().with_decode(100)
    assert LATENCY.predict(base.with_prefill(c)) <= tau + 1e-9
    assert LATENCY.predict(base.with_prefill(c + 1)) > tau - 1e-9
    assert plan.decodes == ["d"]


def test_a_decode_token_already_late_keeps_its_pace_from_now_and_prompts_still_run() -> None:
    # due 2 ms from now, but the decode alone takes 10 ms: that token is late whatever the
    # iteration carries; the stream is held to its TPOT from now (τ = 0.9 × 40 ms), so the
    # prompt behind it gets a chunk instead of waiting for the stream to end
    late = make_request(
        "d", prompt_len=99, running=True, generated=4, tpot_target_s=0.04, last_token_s=NOW - 0.038
    )
    waiting = make_request("w", prompt_len=2000, ttft_target_s=5.0)
    plan = make_policy(latency_budget_s=0.05, eps_init=0.1).plan(
        snapshot(waiting=[waiting], running=[late])
    )
    c = chunks(plan)["w"]
    base = BatchShape().with_decode(103)
    assert LATENCY.predict(base.with_prefill(c)) <= 0.9 * 0.04 + 1e-9
    assert LATENCY.predict(base.with_prefill(c + 1)) > 0.9 * 0.04 - 1e-9
    assert plan.decodes == ["d"]


def test_a_stream_slower_than_its_contract_does_not_starve_the_prompts() -> None:
    # TPOT 5 ms on an engine whose decode alone takes 10 ms: no iteration keeps that stream at
    # pace. It still gets its tokens as fast as the engine can give them (τ starts at 0.9 × 5
    # ms: BE and prompts with time to spare wait), but it is no deadline: the urgent prompt
    # raises τ to what it needs — two iterations of 500 tokens (20 ms each) make its 50 ms —
    # where before the stream capped every iteration and the prompt got nothing
    hopeless = make_request("d", prompt_len=99, running=True, generated=4, tpot_target_s=0.005)
    urgent = make_request("p", prompt_len=1000, arrival_s=NOW - 0.45)  # due in 50 ms
    be = make_request("be", tier="be", prompt_len=5000)
    policy = make_policy(latency_budget_s=0.03, eps_init=0.1, be_min_share=0.0)
    plan = policy.plan(snapshot(waiting=[urgent, be], running=[hopeless]))
    assert chunks(plan) == {"p": 500}
    assert plan.decodes == ["d"]
    relaxed = make_request("p", prompt_len=1000, ttft_target_s=5.0)
    policy = make_policy(latency_budget_s=0.03, eps_init=0.1, be_min_share=0.0)
    plan = policy.plan(snapshot(waiting=[relaxed, be], running=[hopeless]))
    assert chunks(plan) == {}
    assert plan.decodes == ["d"]


def test_an_urgent_prompt_raises_tau_as_far_as_it_needs() -> None:
    # 3000 tokens due in 80 ms: 1000-token chunks at L = 30 ms would take 3 × 30 ms; two
    # iterations of 50 ms take 100 ms; only one iteration of 70 ms makes it (≤ 0.9 × 80 ms)
    urgent = make_request("u", prompt_len=3000, arrival_s=NOW - 0.42)
    plan = make_policy(latency_budget_s=0.03, eps_init=0.1).plan(snapshot(waiting=[urgent]))
    assert chunks(plan) == {"u": 3000}
    assert plan.predicted_s == pytest.approx(0.07)
    # due in 110 ms, the same prompt is urgent but L's three iterations still make it: τ stays
    relaxed = make_request("u", prompt_len=3000, arrival_s=NOW - 0.39)
    plan = make_policy(latency_budget_s=0.03, eps_init=0.1).plan(snapshot(waiting=[relaxed]))
    assert chunks(plan) == {"u": 1000}


def _noisy(policy: TandemPolicy, low: float, high: float) -> TandemPolicy:
    """The policy once its recent iterations ran *low* and *high* × their prediction in turn
    (a noisy engine as fast as the model on average: the calibration's factors stay 1)."""
    for i in range(32):
        policy.pace_spread.observe(0.03, 0.03 * (low if i % 2 else high))
    return policy


def _long_rt_mid_prefill() -> ReqState:
    """A long RT prompt (ERA's sense) mid-prefill, with time to spare."""
    return make_request(
        "rt-long-a",
        prompt_len=5000,
        running=True,
        prefilled=2000,
        arrival_s=NOW - 1.0,
        ttft_target_s=5.0,
    )


def test_on_a_noisy_engine_a_prompt_turns_urgent_at_the_upper_pace() -> None:
    # A second long prompt waits while one is mid-prefill (ERA), unless it is urgent. Due in
    # 460 ms, with one iteration of L = 200 ms to go: at the model's pace it can wait one more
    # (slack 260 ms > L), but not when iterations run 1.3x as long (slack 200 ms <= 260 ms).
    partial = _long_rt_mid_prefill()
    due = make_request("rt-long-u", prompt_len=5000, arrival_s=NOW - 0.14, ttft_target_s=0.6)
    snap = snapshot(waiting=[due], running=[partial])
    steady = make_policy(latency_budget_s=0.2)
    assert "rt-long-u" not in chunks(steady.plan(snap))
    noisy = _noisy(make_policy(latency_budget_s=0.2), 0.7, 1.3)
    assert "rt-long-u" in chunks(noisy.plan(snap))
    # the option off: the mean pace, as on the steady engine
    off = _noisy(make_policy(latency_budget_s=0.2, deadline_spread=False), 0.7, 1.3)
    assert "rt-long-u" not in chunks(off.plan(snap))


def test_the_policy_learns_its_pace_spread_from_the_iterations_it_ran() -> None:
    policy = make_policy(latency_budget_s=0.03)
    snap = snapshot(waiting=[make_request("u", prompt_len=3000, ttft_target_s=60.0)])
    plan = policy.plan(snap)
    assert plan.predicted_s is not None
    policy.observe(IterationResult(start_s=NOW, duration_s=plan.predicted_s, plan=plan))
    assert policy.pace_spread.upper(policy.timer.scale) == pytest.approx(1.0)  # as predicted
    plan = policy.plan(snap)
    assert plan.predicted_s is not None
    policy.observe(IterationResult(start_s=NOW, duration_s=2 * plan.predicted_s, plan=plan))
    assert policy.pace_spread.upper(policy.timer.scale) > 1.2  # one ran long: the upper pace


def test_at_most_one_long_prompt_mid_prefill_per_tier() -> None:
    partial = _long_rt_mid_prefill()
    second = make_request("rt-long-b", prompt_len=6000, arrival_s=NOW - 0.5, ttft_target_s=5.0)
    short = make_request("rt-short", prompt_len=100, arrival_s=NOW - 0.1, ttft_target_s=5.0)
    be_partial = make_request("be-long-a", tier="be", prompt_len=8000, running=True, prefilled=1000)
    be_long = make_request("be-long-b", tier="be", prompt_len=9000, order_key=0)
    be_short = make_request("be-short", tier="be", prompt_len=50, order_key=1)
    snap = snapshot(waiting=[second, short, be_long, be_short], running=[partial, be_partial])
    plan = make_policy(latency_budget_s=0.2).plan(snap)
    got = chunks(plan)
    assert "rt-long-b" not in got and "be-long-b" not in got
    assert {"rt-long-a", "rt-short"} <= set(got)
    # an urgent long prompt bypasses the limit
    urgent = make_request("rt-long-u", prompt_len=5000, arrival_s=NOW - 0.45, ttft_target_s=0.6)
    plan = make_policy(latency_budget_s=0.2).plan(snapshot(waiting=[urgent], running=[partial]))
    assert "rt-long-u" in chunks(plan)


def test_a_hopeless_prompt_waits_behind_a_feasible_one_that_cannot_spare_the_time() -> None:
    hopeless = make_request("late", prompt_len=1000, arrival_s=NOW - 0.6)  # due 0.1 s ago
    # due in 0.2 s, past 0.65 of its target already: no time of it is the late one's
    tight = make_request("fresh", prompt_len=1000, arrival_s=NOW - 0.3)
    plan = make_policy(latency_budget_s=0.035).plan(snapshot(waiting=[hopeless, tight]))
    assert chunks(plan) == {"fresh": 1000, "late": 250}
    assert plan.prefills[0].rid == "fresh"
    # one more than its whole target past its deadline goes first all the same
    # (rt_late_bound_frac): a request let in is served, however busy the queue
    overdue = make_request("late", prompt_len=1000, arrival_s=NOW - 1.2)
    plan = make_policy(latency_budget_s=0.035).plan(snapshot(waiting=[overdue, tight]))
    assert chunks(plan) == {"late": 1000, "fresh": 250}
    # one that just came has the time: the late one goes first, and it still comes within
    # 0.65 of its target
    feasible = make_request("fresh", prompt_len=1000, arrival_s=NOW - 0.05)
    plan = make_policy(latency_budget_s=0.035).plan(snapshot(waiting=[hopeless, feasible]))
    assert plan.prefills[0].rid == "late"
    # stealing off: EDF's order under overload, the late one last
    policy = make_policy(latency_budget_s=0.035, use_slack_stealing=False)
    plan = policy.plan(snapshot(waiting=[hopeless, feasible]))
    assert plan.prefills[0].rid == "fresh"


def test_every_rt_decode_runs_even_past_the_budget() -> None:
    decodes = [
        make_request(f"d{i}", prompt_len=4000, running=True, generated=10) for i in range(20)
    ]  # 80K context: 90 ms > L
    be = make_request("be", tier="be", prompt_len=500)
    plan = make_policy(latency_budget_s=0.03).plan(snapshot(waiting=[be], running=decodes))
    assert sorted(plan.decodes) == sorted(d.rid for d in decodes)


def test_the_window_is_placed_by_best_fit_finishers_first() -> None:
    # τ = 30 ms with nothing else: 1000 prompt tokens fit. The 900-token prompt finishes and
    # fills best; what is left (100 tokens) goes to the earliest of the two that are cut.
    a = make_request("a", prompt_len=1500, arrival_s=NOW - 0.03, ttft_target_s=5.0)
    b = make_request("b", prompt_len=300, arrival_s=NOW - 0.02, ttft_target_s=5.0)
    c = make_request("c", prompt_len=900, arrival_s=NOW - 0.01, ttft_target_s=5.0)
    plan = make_policy(latency_budget_s=0.03).plan(snapshot(waiting=[a, b, c]))
    assert [(p.rid, p.tokens) for p in plan.prefills] == [("c", 900), ("a", 100)]


# --------------------------------------------------------------- overload: BE holds the engine
# The bundled CPU engine's shape: a 16384-token pool and 16 request slots.
POOL_TOKENS, MAX_RUNNING = 16_384, 16


def _long_be(rid: str, *, prompt_len: int = 8190, deadline_due_s: float = NOW + 100.0) -> ReqState:
    return make_request(
        rid,
        tier="be",
        prompt_len=prompt_len,
        running=True,
        generated=1,
        deadline_due_s=deadline_due_s,
    )


def _first_be_offered(policy: TandemPolicy, victim: ReqState) -> ReqState:
    """The request the policy's BE queue would admit next once *victim*'s eviction ran (the
    engine then reports it waiting, its KV gone); the queue is left as it was."""
    victim.is_running, victim.prefilled, victim.kv_tokens = False, 0, 0
    offered = next(iter(policy.be_queue.candidates(NOW)))
    policy.be_queue.restore()
    return offered


@pytest.mark.parametrize("ttft_target_s", [0.5, 5.0], ids=["urgent", "relaxed"])
def test_an_rt_prompt_finding_the_pool_full_of_8k_be_prompts_is_planned_at_once(
    ttft_target_s: float,
) -> None:
    # two 8K BE prompts hold 16380 of 16384 slots; an RT prompt of 300 arrives
    be = [_long_be("be-a"), _long_be("be-b", deadline_due_s=NOW + 50.0)]
    rt = make_request("rt", prompt_len=300, arrival_s=NOW, ttft_target_s=ttft_target_s)
    policy = make_policy()
    plan = policy.plan(
        snapshot(waiting=[rt], running=be, kv_capacity=POOL_TOKENS, max_running=MAX_RUNNING)
    )
    assert chunks(plan).get("rt") == 300  # in its first plan, whole
    assert len(plan.evictions) == 1 and plan.evictions[0].startswith("be-")
    # the victim waits again at the front of BE, its deadline unchanged
    victim = next(r for r in be if r.rid == plan.evictions[0])
    assert _first_be_offered(policy, victim) is victim
    assert victim.deadline_due_s == {"be-a": NOW + 100.0, "be-b": NOW + 50.0}[victim.rid]


def test_an_rt_prompt_finding_every_request_slot_held_by_be_evicts_one_for_a_slot() -> None:
    # 16 BE requests take every slot (KV is plentiful): RT must not wait for one to finish
    be = [
        make_request(f"be{i}", tier="be", prompt_len=500, running=True, generated=5 + i)
        for i in range(MAX_RUNNING)
    ]
    rt = make_request("rt", prompt_len=300, arrival_s=NOW, ttft_target_s=5.0)
    policy = make_policy()
    plan = policy.plan(
        snapshot(waiting=[rt], running=be, kv_capacity=POOL_TOKENS, max_running=MAX_RUNNING)
    )
    assert chunks(plan) == {"rt": 300}
    assert plan.evictions == ["be0"]  # the least progress: the least recompute lost
    assert _first_be_offered(policy, be[0]) is be[0]


def test_slots_held_by_rt_are_never_taken_from_rt_for_another_rt_prompt() -> None:
    rt_running = [
        make_request(f"rt{i}", prompt_len=100, running=True, generated=2, ttft_target_s=5.0)
        for i in range(MAX_RUNNING)
    ]
    fresh = make_request("rt-new", prompt_len=300, arrival_s=NOW, ttft_target_s=5.0)
    plan = make_policy().plan(
        snapshot(
            waiting=[fresh], running=rt_running, kv_capacity=POOL_TOKENS, max_running=MAX_RUNNING
        )
    )
    assert plan.evictions == [] and "rt-new" not in chunks(plan)


def test_a_long_be_prompt_mid_prefill_holding_the_whole_pool_gives_way_to_rt() -> None:
    # a 20K-token BE prompt has 16380 of its tokens in the 16384-token pool, mid-prefill
    long_be = make_request(
        "be-long",
        tier="be",
        prompt_len=20_000,
        running=True,
        prefilled=16_380,
        deadline_due_s=NOW + 100.0,
    )
    rt = make_request("rt", prompt_len=300, arrival_s=NOW, ttft_target_s=5.0)
    policy = make_policy()
    plan = policy.plan(
        snapshot(waiting=[rt], running=[long_be], kv_capacity=POOL_TOKENS, max_running=MAX_RUNNING)
    )
    assert chunks(plan) == {"rt": 300} and plan.evictions == ["be-long"]
    assert _first_be_offered(policy, long_be) is long_be
    assert long_be.deadline_due_s == NOW + 100.0


def test_a_burst_of_rt_prompts_each_gets_a_slot_held_by_be_in_the_same_plan() -> None:
    be = [
        make_request(f"be{i}", tier="be", prompt_len=500, running=True, generated=5 + i)
        for i in range(MAX_RUNNING)
    ]
    burst = [
        make_request(f"rt{i}", prompt_len=200, arrival_s=NOW, ttft_target_s=5.0) for i in range(4)
    ]
    plan = make_policy().plan(
        snapshot(waiting=burst, running=be, kv_capacity=POOL_TOKENS, max_running=MAX_RUNNING)
    )
    assert chunks(plan) == {f"rt{i}": 200 for i in range(4)}
    assert plan.evictions == ["be0", "be1", "be2", "be3"]  # the least advanced BE first
