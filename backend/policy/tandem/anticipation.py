"""Anticipatory scheduling for closed-loop RT clients (`TandemConfig.rt_anticipation_s`).

An agent sends its next call, and a chat client often its next message, as soon as the last
answer ended. That request is then on its way through the gateway and the engine's front end
(a few milliseconds) while the engine, finding no RT work, starts an iteration of BE work: the
request arrives just after it started and waits for all of it, not half of it on average, as a
request arriving at a random instant would. On the CPU engine a BE iteration lasts about as long
as the RT prompt's own (one decode step is most of either), so a chat beside a batch got its
first token about 1.5× later than alone, nearly all of it spent in that one iteration.

This is the "deceptive idleness" of synchronous requesters that anticipatory disk scheduling
answers (Iyer and Druschel, SOSP 2001): after a synchronous request completes, wait a moment
for its issuer's next one before serving another. Here: when the last RT request around has
ended, BE waits up to `window_s` for the next RT arrival — but only while the recent RT
arrivals that followed such an end mostly came within that window (a client that thinks for
seconds, or open-loop traffic, turns it off: every wait would be lost). The wait ends as soon
as an RT request is seen, so a hit costs BE only the request's time in transit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from backend.policy.types import ReqState

HISTORY = 8
"""How many of the latest "RT end, then the next RT arrival" episodes decide whether to wait."""
MIN_EPISODES = 4
"""No waiting before this many episodes were seen."""
HIT_FRAC = 0.5
"""Wait while at least this share of those episodes had the next arrival within the window."""


class Anticipation:
    """Tracks RT ends and the arrivals that follow them; says when BE should wait."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0.0:
            raise ValueError(f"the anticipation window must be > 0 s, got {window_s}")
        self.window_s = window_s
        """How long BE waits after the last RT request ended, seconds."""
        self._hits: deque[bool] = deque(maxlen=HISTORY)  # next arrival within the window?
        self._ended_s: float | None = None  # when RT work last ran out (policy clock)
        self._around = False  # RT work was around at the last plan
        self.holds = 0
        """Plans that held BE back (the engine idled waiting for an RT arrival)."""

    @property
    def active(self) -> bool:
        """Whether recent RT arrivals mostly followed the previous RT end within the window."""
        hits = self._hits
        return len(hits) >= MIN_EPISODES and sum(hits) >= HIT_FRAC * len(hits)

    def note(self, now_s: float, arrivals: Iterable[ReqState], rt_around: bool) -> None:
        """One plan's view: the RT requests first seen now (*arrivals*, health probes left
        out) and whether any RT request (not a probe) is waiting or running."""
        if self._ended_s is not None:
            first_s = min((r.arrival_s for r in arrivals), default=None)
            if first_s is not None:
                # the gateway's arrival instant: the time in transit to the engine is not the
                # client's, and is what the wait is for
                self._hits.append(first_s - self._ended_s <= self.window_s)
                self._ended_s = None
        if rt_around:
            self._around, self._ended_s = True, None
        elif self._around:
            self._around, self._ended_s = False, now_s

    def hold_until_s(self, now_s: float) -> float | None:
        """Until when BE should wait now (policy clock), or None: no RT end to anticipate a
        follow-up of, its window has passed, or follow-ups have not been coming that soon."""
        if self._ended_s is None or not self.active:
            return None
        until_s = self._ended_s + self.window_s
        if now_s >= until_s:
            return None
        self.holds += 1
        return until_s
