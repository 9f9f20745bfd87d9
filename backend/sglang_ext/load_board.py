"""Hands the scheduler's per-iteration `EngineLoad` to the control endpoint's long polls.

The scheduler loop publishes (``EngineDriver.plan_iteration``, once per completed iteration);
each ``GET /load?after=N&wait_s=S`` runs in its own thread of the control server
(``socketserver.ThreadingMixIn``) and blocks on a condition variable until a load newer than
iteration N is published, or S seconds pass. Publishing takes the lock for an assignment and a
notify: the scheduler never waits on a reader.
"""

from __future__ import annotations

import threading
from collections import deque

from common.wire import (
    ITERATION_LOG_SIZE,
    EngineLoad,
    IterationMix,
    IterationRecord,
    RecentIterations,
)


class LoadBoard:
    """The newest `EngineLoad`, and a way to wait for a newer one (thread-safe)."""

    def __init__(self, initial: EngineLoad) -> None:
        self._cond = threading.Condition()
        self._load = initial
        self._log: deque[IterationRecord] = deque(maxlen=ITERATION_LOG_SIZE)

    @property
    def latest(self) -> EngineLoad:
        """The newest published load."""
        return self._load

    def publish(self, load: EngineLoad, mix: IterationMix | None = None) -> None:
        """Makes *load* the newest and wakes every waiter (the scheduler thread calls this);
        *mix*: the token mix of the iteration it follows, for the iteration log."""
        record = IterationRecord(
            load.iteration, load.at_unix_s, load.iteration_s, load.predicted_iteration_s, mix
        )
        with self._cond:
            self._load = load
            if load.iteration > 0:
                self._log.append(record)
            self._cond.notify_all()

    def wait_after(self, after_iteration: int, wait_s: float) -> EngineLoad:
        """The newest load once its iteration is past *after_iteration* (at once when it
        already is), else after *wait_s* seconds whatever is newest."""
        with self._cond:
            self._cond.wait_for(lambda: self._load.iteration > after_iteration, timeout=wait_s)
            return self._load

    def iterations_after(self, after_iteration: int, wait_s: float) -> RecentIterations:
        """Every kept iteration past *after_iteration*, oldest first, once there is one (or
        after *wait_s* seconds, maybe none); `missed` counts those no longer kept."""
        with self._cond:
            self._cond.wait_for(lambda: self._load.iteration > after_iteration, timeout=wait_s)
            records = [r for r in self._log if r.iteration > after_iteration]
            newest = self._load.iteration
        first = records[0].iteration if records else newest + 1
        missed = max(0, first - max(after_iteration, 0) - 1) if after_iteration >= 0 else 0
        return RecentIterations(iterations=records, missed=missed)
