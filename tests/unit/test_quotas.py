"""Quota admission in memory: token buckets, concurrency, monthly budget, limit changes, and the
split of limits between gateway instances (pure; fake clocks)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.pipeline.stages import duration_text
from gateway.quotas.bucket import TokenBucket
from gateway.quotas.limiter import (
    DemandReport,
    LimitIsZero,
    QuotaExceeded,
    QuotaLimiter,
    RequestTooLarge,
    SyncView,
)
from gateway.quotas.shares import FLOOR_SHARE, allocate, weights
from gateway.store.types import Quota, Slo, Tenant

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str = "acme", **quota: int) -> Tenant:
    return Tenant(
        id=f"ten_{name}",
        name=name,
        tier="rt",
        slo=Slo(),
        quota=Quota(**quota),
        created_at=T0,
        updated_at=T0,
    )


def limiter(clock: Clock, instance: str = "gw_a", wall: datetime = T0) -> QuotaLimiter:
    return QuotaLimiter(instance, clock=clock, wall_clock=lambda: wall)


def refused(lim: QuotaLimiter, t: Tenant, prompt: int = 1, max_tokens: int = 1) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as info:
        lim.admit(t, prompt, max_tokens)
    return info.value


def test_requests_per_min_refuses_with_retry_after_then_serves_again() -> None:
    clock = Clock()
    lim, t = limiter(clock), tenant(requests_per_min=3)
    for _ in range(3):
        lim.admit(t, 10, 10)
    exc = refused(lim, t)
    assert exc.limit == "requests_per_min" and exc.retry_after_s == 20
    assert "requests_per_min is 3" in exc.message and "'acme'" in exc.message
    clock.now += 19.0
    assert refused(lim, t).retry_after_s == 1
    clock.now += 1.0
    lim.admit(t, 10, 10)


def test_tokens_per_min_counts_prompt_plus_max_tokens_and_refunds_the_unused_part() -> None:
    clock = Clock()
    lim, t = limiter(clock), tenant(tokens_per_min=1000)
    first = lim.admit(t, 100, 400)
    lim.admit(t, 100, 400)
    exc = refused(lim, t, 100, 400)
    assert exc.limit == "tokens_per_min" and exc.retry_after_s == 30  # 500 at 1000/60 per s
    lim.release(first, used_tokens=120)  # 380 of the 500 reserved come back
    exc = refused(lim, t, 100, 400)
    assert exc.retry_after_s == 8  # 120 missing at 16.7 tokens/s
    clock.now += 8.0
    lim.admit(t, 100, 400)


def test_a_request_larger_than_the_whole_token_limit_is_refused_for_good() -> None:
    lim, t = limiter(Clock()), tenant(tokens_per_min=100, requests_per_min=1)
    lim.admit(t, 1, 1)  # requests_per_min is spent: it is still told it can never pass
    with pytest.raises(RequestTooLarge) as info:
        lim.admit(t, 20, 200)
    assert (info.value.needed_tokens, info.value.limit_tokens) == (220, 100)
    assert "lower max_tokens" in info.value.message and "220" in info.value.message
    lim.admit(t, 20, 200, interactive=False)  # a batch line: no per-minute limit applies


def test_a_refusal_takes_nothing_from_the_other_limits() -> None:
    clock = Clock()
    lim, t = limiter(clock), tenant(requests_per_min=2, tokens_per_min=100)
    lim.admit(t, 50, 40)
    assert refused(lim, t, 50, 40).limit == "tokens_per_min"  # not counted against rpm
    lim.admit(t, 1, 1)  # so one request of the two per minute is still there
    assert refused(lim, t, 1, 1).limit == "requests_per_min"


def test_max_concurrent_frees_a_slot_when_a_request_ends() -> None:
    lim, t = limiter(Clock()), tenant(max_concurrent=2)
    a = lim.admit(t, 1, 1)
    lim.admit(t, 1, 1)
    exc = refused(lim, t)
    assert exc.limit == "max_concurrent" and exc.retry_after_s == 1
    assert lim.in_flight() == {t.id: 2}
    lim.release(a, 2)
    lim.release(a, 2)  # a second release of the same ticket changes nothing
    lim.admit(t, 1, 1)
    assert refused(lim, t).limit == "max_concurrent"


def test_monthly_budget_holds_until_the_next_month() -> None:
    clock = Clock()
    wall = datetime(2026, 11, 30, 23, 59, 0, tzinfo=UTC)
    lim, t = limiter(clock, wall=wall), tenant(monthly_tokens=1000)
    ticket = lim.admit(t, 100, 900)
    assert refused(lim, t).limit == "monthly_tokens"  # the reservation counts while in flight
    lim.release(ticket, used_tokens=1000)
    exc = refused(lim, t)
    assert exc.limit == "monthly_tokens" and exc.retry_after_s == 60
    assert "1000 have been used in 2026-11" in exc.message


def test_unlimited_tenants_are_always_admitted() -> None:
    lim, t = limiter(Clock()), tenant()
    for _ in range(10_000):
        lim.release(lim.admit(t, 1000, 1000), 2000)


def test_a_raised_limit_applies_at_once_and_a_lowered_one_too() -> None:
    clock = Clock()
    lim = limiter(clock)
    lim.admit(tenant(requests_per_min=1), 1, 1)
    refused(lim, tenant(requests_per_min=1))
    lim.admit(tenant(requests_per_min=10), 1, 1)  # the admin raised it: the extra burst is there
    lowered = tenant(requests_per_min=10, max_concurrent=1)  # two are in flight
    assert refused(lim, lowered).limit == "max_concurrent"


def test_a_limit_of_zero_refuses_for_good_and_batch_lines_only_on_the_monthly_budget() -> None:
    lim = limiter(Clock())
    for limit in ("requests_per_min", "max_concurrent", "monthly_tokens"):
        with pytest.raises(LimitIsZero) as info:
            lim.admit(tenant(**{limit: 0}), 1, 1)
        assert info.value.limit == limit
    # a batch line is held to the monthly budget only (per-minute limits do not pace batches)
    lim.admit(tenant(requests_per_min=0), 1, 1, interactive=False)
    with pytest.raises(LimitIsZero):
        lim.admit(tenant(monthly_tokens=0), 1, 1, interactive=False)


def test_two_instances_split_the_limit_and_never_exceed_it_together() -> None:
    clock = Clock()
    a, b = limiter(clock, "gw_a"), limiter(clock, "gw_b")
    t = tenant(requests_per_min=10, max_concurrent=3)
    view = SyncView(instances=["gw_a", "gw_b"], demand={}, monthly_tokens={}, month="2026-11")
    for lim in (a, b):
        lim.apply_sync(view)
    admitted = 0
    for lim in (a, b) * 10:
        try:
            lim.admit(t, 1, 1)
            admitted += 1
        except QuotaExceeded:
            pass
    assert admitted == 3  # max_concurrent 3 split 2 + 1 (every instance computes the same)
    assert sum(lim.in_flight().get(t.id, 0) for lim in (a, b)) == 3


def test_shares_follow_demand() -> None:
    clock = Clock()
    a = limiter(clock, "gw_a")
    t = tenant(requests_per_min=100)
    a.apply_sync(
        SyncView(instances=["gw_a", "gw_b"], demand={}, monthly_tokens={}, month="2026-11")
    )
    for _ in range(50):
        a.admit(t, 1, 1)
    assert refused(a, t).limit == "requests_per_min"  # an even split: 50 each
    reports, _ = a.sync_out()
    assert reports[0].requests > 0
    idle_b = DemandReport(t.id, 0.0, 0.0, 0.0, 0)
    a.apply_sync(
        SyncView(
            instances=["gw_a", "gw_b"],
            demand={t.id: {"gw_b": idle_b}},
            monthly_tokens={},
            month="2026-11",
        )
    )
    clock.now += 60.0  # a full refill at the new share
    served = 0
    while True:
        try:
            a.admit(t, 1, 1)
            served += 1
        except QuotaExceeded:
            break
    assert served == int(100 * (1 - FLOOR_SHARE / 2))


def test_month_counts_are_handed_to_the_sync_and_kept_when_it_fails() -> None:
    lim, t = limiter(Clock()), tenant(monthly_tokens=10_000)
    lim.release(lim.admit(t, 10, 10), 15)
    _, deltas = lim.sync_out()
    assert deltas == {(t.id, "2026-11"): 15}
    lim.sync_failed(deltas)
    assert lim.sync_out()[1] == deltas
    lim.apply_sync(
        SyncView(instances=["gw_a"], demand={}, monthly_tokens={t.id: 9_990}, month="2026-11")
    )
    ticket = lim.admit(t, 1, 1)  # 10 left: admitted while any budget is left
    lim.release(ticket, used_tokens=10)
    assert refused(lim, t).limit == "monthly_tokens"


def test_weights_and_allocation_add_up() -> None:
    w = weights(["a", "b", "c"], {"a": 10.0})
    assert sum(w.values()) == pytest.approx(1.0)
    assert w["b"] == w["c"] == pytest.approx(FLOOR_SHARE / 3)
    assert weights(["a", "b"], {}) == {"a": 0.5, "b": 0.5}
    for limit in range(0, 12):
        assert sum(allocate(limit, w).values()) == limit
    # one slot, equal demand: who gets it rotates with the epoch
    winners = {
        max(allocate(1, {"a": 0.5, "b": 0.5}, e).items(), key=lambda kv: kv[1])[0]
        for e in range(20)
    }
    assert winners == {"a", "b"}


def test_bucket_resize_keeps_level_unless_growth_is_granted() -> None:
    bucket = TokenBucket.full(10, 1, 0.0)
    bucket.take(10)
    bucket.resize(20, 2, 0.0)
    assert bucket.level == 0
    bucket.resize(30, 3, 0.0, grant_growth=True)
    assert bucket.level == 10
    bucket.resize(5, 1, 0.0)
    assert bucket.level == 5


def test_batch_lines_count_toward_the_monthly_budget_only() -> None:
    lim = limiter(Clock())
    t = tenant(requests_per_min=1, max_concurrent=1, tokens_per_min=10, monthly_tokens=1000)
    tickets = [lim.admit(t, 100, 100, interactive=False) for _ in range(3)]
    assert lim.in_flight() == {}  # batch lines hold no concurrency slot
    lim.release(lim.admit(t, 2, 2), 4)  # the interactive limits are untouched
    for ticket in tickets:
        lim.release(ticket, used_tokens=400)
    exc = refused(lim, t)
    assert exc.limit == "monthly_tokens"
    with pytest.raises(QuotaExceeded):
        lim.admit(t, 1, 1, interactive=False)


def test_retry_after_with_several_instances_is_what_the_whole_limit_needs() -> None:
    clock = Clock()
    a = limiter(clock, "gw_a")
    t = tenant(requests_per_min=60)
    a.apply_sync(
        SyncView(instances=["gw_a", "gw_b"], demand={}, monthly_tokens={}, month="2026-11")
    )
    for _ in range(30):
        a.admit(t, 1, 1)
    # this instance's half refills one request in 2 s; the whole limit does it in 1 s, and the
    # shares follow the demand at the next sync
    assert refused(a, t).retry_after_s == 1


def test_limit_status_says_what_is_left_and_when_it_is_full_again() -> None:
    clock = Clock()
    lim, t = limiter(clock), tenant(requests_per_min=3, tokens_per_min=600)
    assert lim.limit_status(t.id) == (None, None)  # not seen yet
    ticket = lim.admit(t, 10, 290)
    requests, tokens = lim.limit_status(t.id)
    assert requests is not None and tokens is not None
    assert (requests.limit, requests.remaining, requests.reset_s) == (3, 2, 20.0)
    assert (tokens.limit, tokens.remaining, tokens.reset_s) == (600, 300, 30.0)
    lim.release(ticket, 100)  # the unused 200 come back
    clock.now += 1.0
    _, tokens = lim.limit_status(t.id)
    assert tokens is not None and (tokens.remaining, tokens.reset_s) == (510, 9.0)
    only_requests = tenant("solo", requests_per_min=5)
    lim.admit(only_requests, 1, 1)
    assert lim.limit_status(only_requests.id)[1] is None


def test_reset_durations_are_spelled_as_openai_does() -> None:
    assert [duration_text(s) for s in (0.0, 0.25, 1.5, 20.0, 60.0, 90.5)] == [
        "0ms",
        "250ms",
        "1.5s",
        "20s",
        "1m0s",
        "1m30.5s",
    ]
