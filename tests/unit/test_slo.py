"""Latency measurement, SLO verdicts and the windowed SLO attainment."""

from __future__ import annotations

import gc
import tracemalloc
from datetime import UTC, datetime

import pytest

from gateway.metrics import GatewayMetrics
from gateway.slo import RequestTimer, SloWindow, slo_met
from gateway.store.types import UsageRecord


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_timer_measures_ttft_tpot_and_longest_gap() -> None:
    clock = FakeClock()
    timer = RequestTimer(clock=clock)
    clock.now += 0.2
    timer.on_tokens(1)
    for gap in (0.01, 0.05, 0.01):
        clock.now += gap
        timer.on_tokens(timer.tokens + 1)
    clock.now += 0.005
    timer.finish()
    assert timer.ttft_ms == pytest.approx(200.0)
    assert timer.tpot_ms == pytest.approx(70.0 / 3)
    assert timer.tbt_max_ms == pytest.approx(50.0)
    assert timer.e2e_ms == pytest.approx(275.0)


def test_timer_ignores_repeated_counts_and_one_token_has_no_tpot() -> None:
    clock = FakeClock()
    timer = RequestTimer(clock=clock)
    clock.now += 0.1
    timer.on_tokens(1)
    clock.now += 0.1
    timer.on_tokens(1)
    assert timer.tpot_ms is None and timer.tbt_max_ms is None


RT = dict(tier="rt", ttft_target_ms=200.0, tpot_target_ms=50.0, deadline_s=None)


def test_rt_slo() -> None:
    assert slo_met(**RT, ok=True, ttft_ms=150, tpot_ms=40, e2e_ms=1000) is True
    assert slo_met(**RT, ok=True, ttft_ms=250, tpot_ms=40, e2e_ms=1000) is False
    assert slo_met(**RT, ok=True, ttft_ms=150, tpot_ms=60, e2e_ms=1000) is False
    assert slo_met(**RT, ok=True, ttft_ms=150, tpot_ms=None, e2e_ms=150) is True
    assert slo_met(**RT, ok=False, ttft_ms=150, tpot_ms=40, e2e_ms=1000) is False


def test_be_slo_is_the_deadline_or_none() -> None:
    be = dict(tier="be", ttft_target_ms=None, tpot_target_ms=None)
    assert slo_met(**be, deadline_s=None, ok=True, ttft_ms=1, tpot_ms=1, e2e_ms=9e9) is None
    assert slo_met(**be, deadline_s=10, ok=True, ttft_ms=1, tpot_ms=1, e2e_ms=9_000) is True
    assert slo_met(**be, deadline_s=10, ok=True, ttft_ms=1, tpot_ms=1, e2e_ms=11_000) is False


def test_slo_window_holds_a_bounded_number_of_buckets_however_many_verdicts() -> None:
    now = [0.0]
    window = SloWindow[str](window_s=300.0, bucket_s=1.0, clock=lambda: now[0])
    for step in range(100_000):  # 1000 s at 100 verdicts a second, never read
        now[0] = step / 100.0
        window.add("rt", met=step % 4 != 0)
    assert window.buckets <= 301
    assert window.attainment() == {"rt": pytest.approx(0.75)}
    now[0] += 301.0  # nothing judged within the window: the key is forgotten
    assert window.attainment() == {} and window.buckets == 0


def test_unscraped_metrics_memory_does_not_grow_with_requests() -> None:
    """A gateway whose /metrics is never scraped keeps no per-request state (it grew by about
    90 B a request: every verdict stayed in the SLO window until a scrape trimmed it)."""
    metrics = GatewayMetrics()
    finished = UsageRecord(
        request_id="r",
        tenant_id="ten_a",
        tier="rt",
        model="m",
        endpoint="chat",
        prompt_tokens=10,
        completion_tokens=5,
        ttft_ms=120.0,
        tpot_ms=20.0,
        e2e_ms=300.0,
        status="ok",
        http_status=200,
        slo_met=True,
        created_at=datetime(2026, 11, 21, tzinfo=UTC),
        finished_at=datetime(2026, 11, 21, tzinfo=UTC),
    )
    for _ in range(100):  # every series and label set exists now
        metrics.request_started("ten_a", "rt")
        metrics.request_finished(finished, started=True)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20_000):
            metrics.request_started("ten_a", "rt")
            metrics.request_finished(finished, started=True)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000 * 5, f"{grown / 20_000:.0f} B per request"
