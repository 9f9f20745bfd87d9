"""Latency measurement and SLO verdicts."""

from __future__ import annotations

import pytest

from gateway.slo import RequestTimer, slo_met


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
