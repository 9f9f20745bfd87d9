"""tandem's incremental waiting queues: newcomers found at the tail, rebuilds on mismatch,
service order per tier."""

from __future__ import annotations

from backend.policy.tandem.queues import BeQueue, PromptPace, RtQueue, WaitingSet
from tests.unit.tandem_factories import NOW, make_request


def test_sync_finds_newcomers_at_the_tail_and_rebuilds_on_mismatch() -> None:
    known = WaitingSet()
    a, b, c = (make_request(x) for x in "abc")
    assert known.sync([a, b]) == [a, b]
    assert known.sync([a, b, c]) == [c]
    known.take("a")  # admitted by the plan: gone from the next list
    assert known.sync([b, c]) == []
    assert known.sync([c]) == []  # b vanished without an admission (an abort): reconciled
    assert set(known.reqs) == {"c"}
    assert known.sync([c, a]) == [a]  # a came back (an admission never executed)


def test_rt_queue_serves_feasible_by_latest_start_then_hopeless_oldest_first() -> None:
    queue = RtQueue(lambda r: (r.ttft_due_s or 0.0) - r.prompt_len / 1000)
    late_old = make_request("late-old", arrival_s=NOW - 5.0)
    late_new = make_request("late-new", arrival_s=NOW - 3.0)
    relaxed = make_request("relaxed", arrival_s=NOW, prompt_len=100)
    tight = make_request("tight", arrival_s=NOW - 0.2, prompt_len=100)
    evicted = make_request("evicted", arrival_s=NOW - 9.0, generated=3)  # mid-decode
    queue.sync([evicted, late_old, late_new, tight, relaxed])
    order = [r.rid for r in queue.candidates(NOW)]
    assert order == ["evicted", "tight", "relaxed", "late-old", "late-new"]
    queue.restore()
    queue.take(relaxed)
    assert [r.rid for r in queue.candidates(NOW)] == ["evicted", "tight", "late-old", "late-new"]


def test_be_queue_resumes_evicted_work_first_then_deadlines_then_the_mix() -> None:
    queue = BeQueue(
        lambda r: r.deadline_due_s or 0.0,
        lambda r, now: False,
        seed=0,
        order_prob=1.0,
        max_wait_s=60.0,
    )
    plain = [make_request(f"p{i}", tier="be", order_key=i, arrival_s=NOW - i) for i in range(3)]
    due = make_request("due", tier="be", deadline_due_s=NOW + 10, order_key=9)
    queue.sync([*plain, due])
    resumed = make_request("resumed", tier="be", order_key=99, arrival_s=NOW)
    queue.requeue(resumed)
    assert [r.rid for r in queue.candidates(NOW)] == ["resumed", "due", "p0", "p1", "p2"]
    queue.restore()
    oldest_first = BeQueue(
        lambda r: 0.0, lambda r, now: False, seed=0, order_prob=0.0, max_wait_s=60.0
    )
    oldest_first.sync(plain)
    assert [r.rid for r in oldest_first.candidates(NOW)] == ["p2", "p1", "p0"]


def test_rt_queue_offers_the_least_served_tenant_first_each_lane_by_latest_start() -> None:
    queue = RtQueue(lambda r: r.ttft_due_s or 0.0)
    burst = [
        make_request(f"b{i}", tenant_id="burst", arrival_s=NOW - 0.3 + i * 0.01) for i in range(3)
    ]
    steady = [
        make_request("s-late", tenant_id="steady", arrival_s=NOW),
        make_request("s-early", tenant_id="steady", arrival_s=NOW - 0.05),
    ]
    queue.sync([*burst, *steady])
    queue.fair.charge("burst", 1000)  # its running decodes and earlier prompts
    order = [r.rid for r in queue.candidates(NOW)]
    # steady is behind by more than its two prompts (100 tokens each): they go first, by
    # latest start, then burst's in their own order
    assert order == ["s-early", "s-late", "b0", "b1", "b2"]
    queue.restore()
    # taken ones leave their lane; a lane with nothing waiting is idle for the fair share
    for r in steady:
        queue.take(r)
    assert queue.fair.backlogged == {"burst"}


def test_rt_queue_serves_every_tenants_feasible_requests_before_any_hopeless_one() -> None:
    queue = RtQueue(lambda r: r.ttft_due_s or 0.0)
    lost = make_request("lost", tenant_id="a", arrival_s=NOW - 5.0)  # TTFT long gone
    fresh = make_request("fresh", tenant_id="b", arrival_s=NOW)
    queue.sync([lost, fresh])
    queue.fair.charge("b", 10_000)  # b is far ahead, yet its feasible one goes first
    assert [r.rid for r in queue.candidates(NOW)] == ["fresh", "lost"]


def test_be_queue_interleaves_tenants_by_weight_keeping_each_batchs_order() -> None:
    queue = BeQueue(lambda r: 0.0, lambda r, now: False, seed=0, order_prob=1.0, max_wait_s=60.0)
    lines = [
        make_request(f"{t}{i}", tier="be", tenant_id=t, tenant_weight=w, order_key=i)
        for t, w in (("a", 2.0), ("b", 1.0))
        for i in range(6)
    ]
    queue.sync(lines)
    order = [r.rid for r in queue.candidates(NOW)]  # 100-token prompts: a's cost 50, b's 100
    assert order[:6] == ["a0", "b0", "a1", "a2", "b1", "a3"]  # 2 : 1 by tokens
    assert [x for x in order if x[0] == "a"] == [f"a{i}" for i in range(6)]  # prefix order kept
    assert [x for x in order if x[0] == "b"] == [f"b{i}" for i in range(6)]


def test_with_fair_share_off_tenants_share_one_lane() -> None:
    queue = RtQueue(lambda r: r.ttft_due_s or 0.0, by_tenant=False)
    a = make_request("a", tenant_id="x", arrival_s=NOW - 0.2)
    b = make_request("b", tenant_id="y", arrival_s=NOW - 0.1)
    queue.sync([b, a])
    queue.fair.charge("x", 10_000)
    assert [r.rid for r in queue.candidates(NOW)] == ["a", "b"]  # latest start only


def test_a_hopeless_request_goes_first_where_the_feasible_ones_can_spare_the_time() -> None:
    queue = RtQueue(lambda r: (r.ttft_due_s or 0.0) - r.prompt_len / 1000)
    pace = PromptPace(chunk_tokens=100, iteration_s=0.1, headroom=0.65)  # 1000 tokens/s
    tight = make_request("tight", arrival_s=NOW - 0.2, prompt_len=100)  # due in 0.3 s
    # due in 2 s; 0.65 of it is 1.3 s, of which its prompt and the one ahead take 0.3
    relaxed = make_request("relaxed", arrival_s=NOW, prompt_len=100, ttft_target_s=2.0)
    late_old = make_request("late-old", arrival_s=NOW - 2.0, prompt_len=600)  # 0.6 s each
    late_new = make_request("late-new", arrival_s=NOW - 1.0, prompt_len=600)
    queue.sync([late_old, late_new, tight, relaxed])
    # the tight one cannot wait 0.6 s more; the relaxed one can, once: the older late one
    # goes before it, the other after every feasible one
    order = [r.rid for r in queue.candidates(NOW, pace)]
    assert order == ["tight", "late-old", "relaxed", "late-new"]
    queue.restore()
    # without a pace (stealing off) every hopeless one waits behind every feasible one
    assert [r.rid for r in queue.candidates(NOW)] == ["tight", "relaxed", "late-old", "late-new"]
    queue.restore()
    queue.take(tight)
    order = [r.rid for r in queue.candidates(NOW, pace)]
    assert order == ["late-old", "relaxed", "late-new"]


def test_a_hopeless_request_never_takes_the_request_slot_a_feasible_one_needs() -> None:
    """The feasible one can spare the hopeless one's prompt time, but not its slot: with one
    slot free the hopeless one waits behind it (taking the slot would cost it the wait for a
    running request to finish); with two it goes first, as before."""
    queue = RtQueue(lambda r: (r.ttft_due_s or 0.0) - r.prompt_len / 1000)
    relaxed = make_request("relaxed", arrival_s=NOW, prompt_len=100, ttft_target_s=2.0)
    late = make_request("late", arrival_s=NOW - 1.0, prompt_len=100)
    queue.sync([late, relaxed])
    for slots, order in ((1, ["relaxed", "late"]), (2, ["late", "relaxed"])):
        pace = PromptPace(chunk_tokens=100, iteration_s=0.1, headroom=0.65, slots=slots)
        assert [r.rid for r in queue.candidates(NOW, pace)] == order, slots
        queue.restore()
    unbounded = PromptPace(chunk_tokens=100, iteration_s=0.1, headroom=0.65)
    assert [r.rid for r in queue.candidates(NOW, unbounded)] == ["late", "relaxed"]


def test_a_request_far_past_its_deadline_goes_first_even_when_no_one_can_spare_the_time() -> None:
    queue = RtQueue(lambda r: (r.ttft_due_s or 0.0) - r.prompt_len / 1000)
    pace = PromptPace(chunk_tokens=100, iteration_s=0.1, headroom=0.65)
    # each of these is past 0.65 of its 0.5 s target already: none can spare a moment
    tight = [make_request(f"t{i}", arrival_s=NOW - 0.3, prompt_len=10) for i in range(3)]
    little_late = make_request("little-late", arrival_s=NOW - 0.6)  # 0.1 s past its deadline
    overdue = make_request("overdue", arrival_s=NOW - 1.2)  # 0.7 s past it: > 1 × 0.5 s
    very_overdue = make_request("very-overdue", arrival_s=NOW - 1.5)
    queue.sync([*tight, little_late, overdue, very_overdue])
    # one a plan, the one latest past its deadline; the others wait behind the feasible ones
    order = [r.rid for r in queue.candidates(NOW, pace, late_bound_frac=1.0)]
    assert order == ["very-overdue", "t0", "t1", "t2", "overdue", "little-late"]
    queue.restore()
    assert [r.rid for r in queue.candidates(NOW, pace)][:3] == ["t0", "t1", "t2"]
    queue.restore()
    queue.take(very_overdue)
    order = [r.rid for r in queue.candidates(NOW, None, late_bound_frac=1.0)]
    assert order == ["overdue", "t0", "t1", "t2", "little-late"]
