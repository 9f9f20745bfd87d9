"""Per-request latency measurement and SLO verdicts (pure; no I/O).

All times are taken on the gateway's monotonic clock, from the moment the request was accepted,
so the numbers are what the client experiences (minus the network).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class RequestTimer:
    """Collects token arrival times of one request and derives its latency metrics.

    Its ttft_ms / tpot_ms are measurements; the contract's targets are called ttft_target_ms /
    tpot_target_ms everywhere (see :func:`slo_met`).
    """

    clock: Callable[[], float] = time.monotonic
    """The clock every instant below is read from, seconds (monotonic by default)."""
    start_s: float = field(default=0.0)
    """When the request was accepted, s on *clock* (0.0: read the clock at construction)."""
    first_token_s: float | None = None
    """When the first output token arrived, s on *clock* (None: none yet)."""
    last_token_s: float | None = None
    """When the latest output token arrived, s on *clock* (None: none yet)."""
    end_s: float | None = None
    """When the response ended, s on *clock* (None: not finished)."""
    max_gap_s: float = 0.0
    """Longest gap between two token arrivals so far, s."""
    tokens: int = 0
    """Output tokens seen so far (cumulative count), tokens."""

    def __post_init__(self) -> None:
        if self.start_s == 0.0:
            self.start_s = self.clock()

    def on_tokens(self, total_tokens: int) -> None:
        """Records that the output has reached *total_tokens* tokens (cumulative)."""
        if total_tokens <= self.tokens:
            return
        now = self.clock()
        if self.first_token_s is None:
            self.first_token_s = now
        elif self.last_token_s is not None:
            self.max_gap_s = max(self.max_gap_s, now - self.last_token_s)
        self.last_token_s = now
        self.tokens = total_tokens

    def finish(self) -> None:
        """Records that the response ended (the last byte was sent)."""
        self.end_s = self.clock()

    @property
    def ttft_ms(self) -> float | None:
        """Measured time to first token, ms after acceptance; None before the first token."""
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.start_s) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (TPOT), ms; None with < 2 tokens."""
        if self.first_token_s is None or self.last_token_s is None or self.tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) * 1000.0 / (self.tokens - 1)

    @property
    def tbt_max_ms(self) -> float | None:
        """Longest gap between two token arrivals, ms."""
        if self.tokens < 2:
            return None
        return self.max_gap_s * 1000.0

    @property
    def e2e_ms(self) -> float:
        """Acceptance to the end of the response (to now while it runs), ms."""
        end = self.end_s if self.end_s is not None else self.clock()
        return (end - self.start_s) * 1000.0


def slo_met(
    *,
    tier: str,
    ttft_target_ms: float | None,
    tpot_target_ms: float | None,
    deadline_s: float | None,
    ok: bool,
    ttft_ms: float | None,
    tpot_ms: float | None,
    e2e_ms: float,
) -> bool | None:
    """Did this request meet its tenant's contract? None when the contract sets no target.

    RT: TTFT within target and mean TPOT within target (a one-token answer has no TPOT).
    BE: finished within the deadline, when there is one. A failed request never meets its SLO.

    The targets come from the contract: ttft_target_ms and tpot_target_ms in ms, deadline_s in
    seconds after arrival. The measurements come from :class:`RequestTimer`, all in ms: ttft_ms,
    tpot_ms (the mean over every token after the first: contracts have no token groups) and
    e2e_ms.
    """
    if tier == "rt":
        if ttft_target_ms is None and tpot_target_ms is None:
            return None
        if not ok:
            return False
        if ttft_target_ms is not None and (ttft_ms is None or ttft_ms > ttft_target_ms):
            return False
        return not (tpot_target_ms is not None and tpot_ms is not None and tpot_ms > tpot_target_ms)
    if deadline_s is None:
        return None
    return ok and e2e_ms <= deadline_s * 1000.0


class SloWindow(Generic[K]):
    """SLO verdicts of the last `window_s` seconds per key (tenant and tier), for a windowed
    attainment ratio: how many met and how many were judged, in buckets of `bucket_s`.

    Memory is bounded by time, never by the request rate: a key holds at most
    ``window_s / bucket_s + 1`` buckets, each two counts, and old buckets are dropped on every
    insert as well as on every read, so a gateway whose attainment is never read (no /metrics
    scrape) keeps no more than one that is scraped. The ratio's window is exact to a bucket.
    """

    def __init__(
        self, window_s: float, bucket_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s <= 0 or bucket_s <= 0:
            raise ValueError("window_s and bucket_s must be positive")
        self.window_s = window_s
        """How far back verdicts count, seconds."""
        self.bucket_s = bucket_s
        """Width of one bucket, seconds."""
        self._clock = clock
        self._buckets: dict[K, deque[list[int]]] = {}
        """key → [bucket index, verdicts met, verdicts judged], oldest first."""

    def add(self, key: K, met: bool) -> None:
        """Counts one verdict for *key* now."""
        index = self._index()
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = self._buckets[key] = deque()
        if buckets and buckets[-1][0] == index:
            bucket = buckets[-1]
        else:
            bucket = [index, 0, 0]
            buckets.append(bucket)
            self._trim(buckets, index)
        bucket[1] += met
        bucket[2] += 1

    def attainment(self) -> dict[K, float]:
        """Share of verdicts met within the window, per key with any; forgets the others."""
        index = self._index()
        out: dict[K, float] = {}
        for key, buckets in list(self._buckets.items()):
            self._trim(buckets, index)
            judged = sum(b[2] for b in buckets)
            if judged:
                out[key] = sum(b[1] for b in buckets) / judged
            else:
                del self._buckets[key]
        return out

    @property
    def buckets(self) -> int:
        """Buckets held now, all keys together (what the window's memory grows with)."""
        return sum(len(b) for b in self._buckets.values())

    def _index(self) -> int:
        return int(self._clock() // self.bucket_s)

    def _trim(self, buckets: deque[list[int]], index: int) -> None:
        oldest = index - int(self.window_s // self.bucket_s)
        while buckets and buckets[0][0] < oldest:
            buckets.popleft()
