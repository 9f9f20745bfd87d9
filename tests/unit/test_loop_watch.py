"""The event-loop watch: a loop held by synchronous work is measured and placed, an idle one is
not reported as stalled."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from gateway.loop_watch import LoopWatch
from tests.waiting import wait_until


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == name
    }


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a CPU-bound step on the loop does to every request in flight


async def test_a_held_loop_is_measured_counted_and_located(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    watch = LoopWatch(asyncio.get_running_loop(), registry, interval_s=0.01, stall_s=0.05)
    watch.start()
    try:
        await wait_until(  # a few probes on an idle loop first
            lambda: _samples(registry, "tandem_event_loop_lag_seconds_count").get((), 0) >= 3,
            what="three probes of the idle loop",
        )
        with caplog.at_level(logging.WARNING, logger="gateway.loop_watch"):
            hold_the_loop(0.3)
            await wait_until(
                lambda: _samples(registry, "tandem_event_loop_stalls_total"),
                what="the stall to be counted",
            )
    finally:
        watch.stop()
    counts = _samples(registry, "tandem_event_loop_stalls_total")
    assert sum(counts.values()) >= 1
    # the held loop was in this test's code, not tandem's: labelled so, the log line names it
    assert {dict(k)["where"] for k in counts} <= {"outside tandem"}
    assert any("hold_the_loop" in r.getMessage() for r in caplog.records)
    lags = _samples(registry, "tandem_event_loop_lag_seconds_bucket")
    over_quarter_s = [v for k, v in lags.items() if dict(k)["le"] == "0.25"]
    total = _samples(registry, "tandem_event_loop_lag_seconds_count")[()]
    assert over_quarter_s[0] < total  # one probe waited out the 0.3 s hold


def test_bad_interval_is_refused() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="interval_s"):
            LoopWatch(loop, CollectorRegistry(), interval_s=0, stall_s=0.05)
    finally:
        loop.close()


def test_warnings_are_rate_limited_but_a_much_longer_stall_is_logged_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.new_event_loop()
    try:
        watch = LoopWatch(loop, CollectorRegistry(), interval_s=0.01, stall_s=0.05)
        where = ("gateway/x.py (f)", "gateway/x.py:1 (f)")
        with caplog.at_level(logging.WARNING, logger="gateway.loop_watch"):
            for lag_s in (0.08, 0.1, 0.12, 0.15):  # one line for the first, the rest tallied
                watch._stalled(lag_s, where)
            watch._stalled(1.2, where)  # 8× the longest logged: said at once
            watch._stalled(1.3, where)
    finally:
        loop.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "held 80 ms" in messages[0]
    assert "held 1200 ms" in messages[1] and "4 stall(s)" in messages[1]
