"""The event loop's own latency, watched from a thread.

Every request the gateway serves waits on one event loop: anything that holds it — a big JSON
body parsed inline, a database driver's parameter processing, the garbage collector — adds its
time to every request in flight, and shows up only as a latency tail nobody can place. A thread
(which the held loop cannot stop) schedules a no-op callback on the loop every `interval_s` and
times how late it runs: that delay is `tandem_event_loop_lag_seconds`. When a callback is later
than `stall_s`, the thread samples the loop thread's Python stack while it is still held, and
logs the stall's length and where the loop was (at most one line per `_LOG_EVERY_S`, with how
many stalls the line stands for, but at once for a stall twice as long as any logged then);
`tandem_event_loop_stalls` counts them by the innermost frame of tandem's own code, so an
operator can see which part of the gateway holds the loop.

A busy machine (the gateway's core given to another process) also delays the callback; its
samples land wherever the loop happened to be, where a real stall's land on one place.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import Counter as Tally
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger(__name__)

_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LOG_EVERY_S = 30.0
"""At most one stall warning per this many seconds (the rest are tallied into the next)."""
_REPO = Path(__file__).resolve().parents[1]
_OUR_PACKAGES = ("gateway", "backend", "common", "tandem")


class LoopWatch:
    """Times the event loop *loop* from a daemon thread (module docstring).

    *interval_s*: how often a probe callback is scheduled; *stall_s*: a probe later than this
    is a stall (its stack is sampled and logged; 0: lag only, no sampling)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        registry: CollectorRegistry,
        *,
        interval_s: float,
        stall_s: float,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._loop = loop
        self._interval_s = interval_s
        self._stall_s = stall_s
        self._loop_thread_id = threading.get_ident()  # built on the loop's thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unlogged: Tally[str] = Tally()
        self._last_log = 0.0
        self._logged_longest_s = 0.0
        """The longest stall logged since `_last_log` (a stall twice as long is logged at once)."""
        self.lag = Histogram(
            "tandem_event_loop_lag_seconds",
            "How late a callback scheduled on the gateway's event loop ran.",
            buckets=_LAG_BUCKETS_S,
            registry=registry,
        )
        self.stalls = Counter(
            "tandem_event_loop_stalls",
            "Probes later than gateway.loop_stall_ms, by where the loop was held (the function "
            "of tandem's code innermost on the loop thread's stack when sampled).",
            ["where"],
            registry=registry,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._interval_s + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            ran = threading.Event()
            started = time.monotonic()
            try:
                self._loop.call_soon_threadsafe(ran.set)
            except RuntimeError:  # the loop is closed: nothing left to watch
                return
            where: tuple[str, str] | None = None
            if self._stall_s > 0 and not ran.wait(self._stall_s):
                frame = sys._current_frames().get(self._loop_thread_id)
                where = _innermost_own_frame(frame)
            while not ran.wait(0.5):
                if self._stop.is_set() or self._loop.is_closed():
                    return
            lag_s = time.monotonic() - started
            self.lag.observe(lag_s)
            if where is not None:
                self._stalled(lag_s, where)

    def _stalled(self, lag_s: float, where: tuple[str, str]) -> None:
        label, detail = where
        self.stalls.labels(where=label).inc()
        self._unlogged[detail] += 1
        now = time.monotonic()
        recent = now - self._last_log < _LOG_EVERY_S
        if recent and lag_s < 2.0 * self._logged_longest_s:
            return  # rate-limited, unless twice as long as any stall logged in the window
        self._logged_longest_s = max(lag_s, self._logged_longest_s) if recent else lag_s
        if not recent:
            self._last_log = now
        total = sum(self._unlogged.values())
        places = ", ".join(f"{w} ×{n}" for w, n in self._unlogged.most_common(3))
        self._unlogged.clear()
        log.warning(
            "event loop held %.0f ms (in %s); %d stall(s) over %.0f ms since the last warning, "
            "most at: %s",
            lag_s * 1000.0,
            detail,
            total,
            self._stall_s * 1000.0,
            places,
        )


def _innermost_own_frame(frame: FrameType | None) -> tuple[str, str]:
    """(label, detail) of where the loop thread is: the label is `package/module.py (function)`
    of the innermost frame in tandem's own code (bounded: one per function); the detail adds
    the line and the innermost frame of all (a library's) when that is elsewhere."""
    innermost = frame
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        try:
            rel = path.resolve().relative_to(_REPO)
        except ValueError:
            rel = None
        if rel is not None and rel.parts and rel.parts[0] in _OUR_PACKAGES:
            label = f"{rel.as_posix()} ({frame.f_code.co_name})"
            detail = f"{rel.as_posix()}:{frame.f_lineno} ({frame.f_code.co_name})"
            if innermost is not None and innermost is not frame:
                detail += f" → {_describe(innermost)}"
            return label, detail
        frame = frame.f_back
    if innermost is None:
        return "unknown", "unknown"
    return "outside tandem", _describe(innermost)


def _describe(frame: FrameType) -> str:
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
