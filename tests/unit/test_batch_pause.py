"""The batch runner's pause (gateway/batch/runner.py): no new line goes to the engine while its
newest report shows RT requests waiting; without a report nothing pauses."""

from __future__ import annotations

from common.wire import EngineLoad
from gateway.batch.runner import be_dispatch_paused


def load(num_rt_waiting: int, **fields: int) -> EngineLoad:
    return EngineLoad(iteration=7, at_unix_s=100.0, num_rt_waiting=num_rt_waiting, **fields)


def test_lines_pause_while_rt_waits_and_resume_once_it_does_not() -> None:
    assert be_dispatch_paused(load(1))
    assert be_dispatch_paused(load(5, num_be_waiting=3))
    assert not be_dispatch_paused(load(0))  # resumed: the RT queue is empty
    assert not be_dispatch_paused(load(0, num_rt_running=8, num_be_waiting=20))  # RT decoding


def test_without_a_report_nothing_pauses() -> None:
    # no watcher, or the engine's reports are down: the engine's policy still puts RT first
    assert not be_dispatch_paused(None)
