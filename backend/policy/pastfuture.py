"""Past-Future memory admission (LightLLM's scheduler; shared/digests/001_pastfuture.md).

*Past*: the output lengths of the last `window` finished requests of a key (tenant or job) form an
empirical distribution. Every iteration each running request gets a fresh sample conditioned on
the tokens it has already produced (a request that runs long is pushed to the tail); a waiting
request gets an unconditional sample.

*Future*: with every request's (current tokens, predicted remaining tokens), the batch's future
KV peak is exact. Sort by remaining, descending; when the i-th finishes, requests 1..i are still
alive and each has grown by rem_i::

    M_i = Σ_{j≤i} cur_j + rem_i · i            M* = max_i M_i

    tokens ▲      ┌─ request 1 (longest remaining) finishes last
           │  ╱╲  │
           │ ╱  ╲╱╲          memory rises between completions and drops at each one,
           │╱      ╲___      so the peak is at a completion instant: M* is exact
           └──────────────▶ time

A request is admitted only while M* (over running + already admitted + it) stays under
capacity × (1 − reserve). Several independent sample lists are drawn when the batch is small
(variance), and the largest peak counts.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable

import numpy as np

DEFAULT_WINDOW = 1000
MIN_SAMPLES = 200
MAX_LISTS = 5


class LengthHistory:
    """Finished output lengths of one key, windowed, with the Past-Future samplers."""

    def __init__(self, window: int = DEFAULT_WINDOW, prior: Iterable[int] = ()) -> None:
        self._values: collections.deque[int] = collections.deque(maxlen=window)
        self._values.extend(int(v) for v in prior)
        self._sorted: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._values)

    def add(self, output_len: int) -> None:
        """Records a finished request's output length (the oldest falls out of the window)."""
        self._values.append(int(output_len))
        self._sorted = None

    def extend(self, output_lens: Iterable[int]) -> None:
        self._values.extend(int(v) for v in output_lens)
        self._sorted = None

    def sorted_values(self) -> np.ndarray:
        if self._sorted is None:
            self._sorted = np.sort(
                np.fromiter(self._values, dtype=np.int64, count=len(self._values))
            )
        return self._sorted

    def sample_total(
        self, rng: np.random.Generator, generated: np.ndarray, max_len: np.ndarray | int
    ) -> np.ndarray:
        """Predicted final lengths of requests that have produced `generated` tokens each.

        The inverse CDF of the history values above `generated`, made piecewise linear between
        the endpoints `generated` and max(`max_len`, largest value seen), so a request past every
        recorded length is predicted uniformly up to `max_len`. `generated = 0` gives the
        unconditional sample of a new request. Callers clamp to each request's own output cap.
        """
        gen = np.asarray(generated, dtype=np.int64)
        hist = self.sorted_values()
        top = np.broadcast_to(np.asarray(max_len, dtype=np.int64), gen.shape)
        if hist.size == 0:  # no history yet: assume the longest
            return np.maximum(gen, top)
        top = np.maximum(top, hist[-1])
        pos = np.searchsorted(hist, gen, side="right")
        n_points = hist.size - pos + 2  # [gen] + hist[pos:] + [top]
        u = rng.random(gen.shape) * (n_points - 1)
        lo = np.minimum(np.floor(u).astype(np.int64), n_points - 2)
        frac = u - lo
        left = _point(hist, gen, top, pos, n_points, lo)
        right = _point(hist, gen, top, pos, n_points, lo + 1)
        total = np.rint(left + (right - left) * frac).astype(np.int64)
        clipped: np.ndarray = np.clip(total, gen, np.maximum(top, gen))
        return clipped


def _point(
    hist: np.ndarray,
    gen: np.ndarray,
    top: np.ndarray,
    pos: np.ndarray,
    n_points: np.ndarray,
    j: np.ndarray,
) -> np.ndarray:
    """The j-th point of each request's range [gen] + hist[pos:] + [top]."""
    inner = hist[np.clip(pos + j - 1, 0, hist.size - 1)]
    return np.where(j == 0, gen, np.where(j == n_points - 1, top, inner))


def future_peak(current: np.ndarray, remaining: np.ndarray) -> int:
    """M*: the largest KV occupancy before the batch drains, in tokens (Eqs. 2–4)."""
    if current.size == 0:
        return 0
    order = np.argsort(-remaining, kind="stable")
    rem = remaining[order]
    grown = np.cumsum(current[order]) + rem * np.arange(1, rem.size + 1)
    return int(grown.max())


def num_sample_lists(batch_size: int) -> int:
    """Independent sample lists to draw: more when the batch is small (less variance)."""
    return min(MAX_LISTS, MIN_SAMPLES // max(batch_size, 1) + 1)


class PeakTracker:
    """`future_peak` of a growing set, answering "peak if this one joined?" in O(log k).

    With the set sorted by remaining (descending), held_j = Σ_{i≤j} c_i and
    P_j = held_j + (j+1)·r_j, a newcomer (c, r) inserted at position p gives
    max( max_{j<p} P_j,  held_{p−1} + c + (p+1)·r,  c + max_{j≥p} (P_j + r_j) ).
    Ties in remaining do not change the peak (the group's last member attains it), so this
    equals `future_peak` of the set with the newcomer appended, exactly.
    """

    def __init__(self, items: Iterable[tuple[int, int]]) -> None:
        pairs = sorted(items, key=lambda x: -x[1])
        self._c = np.array([c for c, _ in pairs], dtype=np.int64)
        self._r = np.array([r for _, r in pairs], dtype=np.int64)
        self._rebuild()

    @classmethod
    def from_arrays(cls, current: np.ndarray, remaining: np.ndarray) -> PeakTracker:
        """A tracker over parallel arrays (no Python-level pairs: the hot path)."""
        tracker = cls.__new__(cls)
        order = np.argsort(-np.asarray(remaining, dtype=np.int64), kind="stable")
        tracker._c = np.asarray(current, dtype=np.int64)[order]
        tracker._r = np.asarray(remaining, dtype=np.int64)[order]
        tracker._rebuild()
        return tracker

    def _rebuild(self) -> None:
        c, r = self._c, self._r
        rank = np.arange(1, len(c) + 1, dtype=np.int64)
        self._held = np.cumsum(c)
        self._prefix_max = np.maximum.accumulate(self._held + rank * r)
        shifted = (self._held + (rank + 1) * r)[::-1]
        self._suffix_max = np.append(np.maximum.accumulate(shifted)[::-1], 0)
        self._neg_r = (-r).tolist()

    def __len__(self) -> int:
        return len(self._c)

    @property
    def peak(self) -> int:
        return int(self._prefix_max[-1]) if len(self._c) else 0

    def peak_with(self, item: tuple[int, int]) -> int:
        """The peak if `item` (current, remaining) joined."""
        c, r = item
        p = bisect.bisect_right(self._neg_r, -r)  # after every item with remaining ≥ r
        before = int(self._prefix_max[p - 1]) if p else 0
        held = int(self._held[p - 1]) if p else 0
        after = c + int(self._suffix_max[p]) if p < len(self._c) else 0
        return max(before, held + c + (p + 1) * r, after)

    def add(self, item: tuple[int, int]) -> None:
        """Adds `item` for good (O(k): the prefix/suffix maxima are rebuilt)."""
        p = bisect.bisect_right(self._neg_r, -item[1])
        self._c = np.insert(self._c, p, item[0])
        self._r = np.insert(self._r, p, item[1])
        self._rebuild()


class PeakAdmission:
    """Admits candidates one at a time while the predicted future peak fits.

    Built once per scheduling round from the running requests' current tokens and their
    predicted remaining tokens (one row per sample list); `try_admit` tests a candidate
    against every list (one `PeakTracker` each, O(log k) per test) and keeps it only if all
    peaks fit.
    """

    def __init__(
        self, current: np.ndarray, remaining_lists: np.ndarray, limit_tokens: float
    ) -> None:
        self.limit_tokens = limit_tokens
        cur = np.asarray(current, dtype=np.int64)
        lists = np.atleast_2d(np.asarray(remaining_lists, dtype=np.int64))
        self._trackers = [PeakTracker.from_arrays(cur, rem) for rem in lists]

    @property
    def peak(self) -> int:
        """The current future peak (the largest over the sample lists)."""
        return max(t.peak for t in self._trackers)

    def peak_with(self, current: int, remaining: np.ndarray) -> int:
        """The peak if a request with `current` tokens and `remaining[l]` (per list) joined."""
        rem = np.broadcast_to(np.asarray(remaining, dtype=np.int64), (len(self._trackers),))
        return max(t.peak_with((int(current), int(rem[i]))) for i, t in enumerate(self._trackers))

    def try_admit(self, current: int, remaining: np.ndarray | int) -> bool:
        """Admits (and remembers) the candidate if the peak stays within the limit."""
        rem = np.broadcast_to(np.asarray(remaining, dtype=np.int64), (len(self._trackers),))
        if self.peak_with(current, rem) > self.limit_tokens:
            return False
        for i, tracker in enumerate(self._trackers):
            tracker.add((int(current), int(rem[i])))
        return True
