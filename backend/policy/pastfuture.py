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
        self._bracketed: np.ndarray | None = None  # see `sample_total`

    def __len__(self) -> int:
        return len(self._values)

    def add(self, output_len: int) -> None:
        """Records a finished request's output length (the oldest falls out of the window)."""
        self._values.append(int(output_len))
        self._forget_sorted()

    def extend(self, output_lens: Iterable[int]) -> None:
        self._values.extend(int(v) for v in output_lens)
        self._forget_sorted()

    def _forget_sorted(self) -> None:
        self._sorted = self._bracketed = None

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
        # Written for few numpy calls: a scheduler calls this for a few hundred draws or for one
        # candidate's handful, where each call costs more than its arithmetic.
        gen = np.asarray(generated, dtype=np.int64)
        hist = self.sorted_values()
        # A plain int cap broadcasts by itself; only an array cap is checked against the shape.
        top: np.ndarray | int = (
            int(max_len)
            if isinstance(max_len, int | np.integer)
            else np.broadcast_to(np.asarray(max_len, dtype=np.int64), gen.shape)
        )
        if hist.size == 0:  # no history yet: assume the longest
            return np.maximum(gen, top)
        if self._bracketed is None:
            # [-∞] + hist + [0]: indexing it at pos + lo gives hist[pos + lo − 1] (or −∞, or
            # the value just below `gen`, both ≤ gen) and at pos + lo + 1 gives hist[pos + lo]
            # (the 0 stands for `top`, put in by `where`).
            self._bracketed = np.concatenate(([np.iinfo(np.int64).min], hist, [0]))
        largest = int(hist[-1])
        top = max(top, largest) if isinstance(top, int) else np.maximum(top, largest)
        pos = hist.searchsorted(gen, side="right")
        last = hist.size - pos  # [gen] + hist[pos:] + [top]: last + 2 points, last + 1 segments
        u = rng.random(gen.shape) * (last + 1)
        lo = np.minimum(u.astype(np.int64), last)  # u ≥ 0: truncation is the floor
        frac = u - lo
        # Segment lo runs from point lo (gen for lo = 0, else hist[pos + lo − 1] > gen) to point
        # lo + 1 (top for lo = last, else hist[pos + lo]); see `_bracketed`.
        idx = pos + lo
        left = np.maximum(self._bracketed[idx], gen)
        right = np.where(idx == hist.size, top, self._bracketed[idx + 1])
        total = np.rint(left + (right - left) * frac).astype(np.int64)
        # np.clip(total, gen, max(top, gen)), without np.clip's slower Python wrapper
        clipped: np.ndarray = np.minimum(np.maximum(total, gen), np.maximum(top, gen))
        return clipped


def future_peak(current: np.ndarray, remaining: np.ndarray) -> int:
    """M*: the largest KV occupancy before the batch drains, in tokens (Eqs. 2–4)."""
    if current.size == 0:
        return 0
    order = (-remaining).argsort(kind="stable")
    rem = remaining[order]
    grown = current[order].cumsum() + rem * np.arange(1, rem.size + 1)
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
    against every list and keeps it only if all peaks fit.

    Each test is `future_peak` of the set with the candidate appended, for all lists at once
    (one row per list): O(L·k log k) in a dozen numpy calls. A round tests a candidate or two
    (usually the queue's head, refused), so that is cheaper than building a `PeakTracker`
    per list for O(log k) tests; for token counts (≥ 0) both give exactly `future_peak`'s
    integers.
    """

    def __init__(
        self, current: np.ndarray, remaining_lists: np.ndarray, limit_tokens: float
    ) -> None:
        self.limit_tokens = limit_tokens
        cur = np.asarray(current, dtype=np.int64)
        rem = np.atleast_2d(np.asarray(remaining_lists, dtype=np.int64))
        self._lists, self._size = rem.shape
        # The set plus one spare slot (the last column) where a candidate is written to be
        # tested, so a test allocates nothing for the set itself.
        self._current = np.zeros(self._size + 1, dtype=np.int64)
        self._current[: self._size] = cur
        self._remaining = np.zeros((self._lists, self._size + 1), dtype=np.int64)
        self._remaining[:, : self._size] = rem
        self._list_index = np.arange(self._lists)[:, None]
        self._rank = np.arange(1, self._size + 2, dtype=np.int64)

    def _peak_of(self, size: int) -> int:
        """The largest `future_peak` over the lists of the first `size` columns."""
        if size == 0:
            return 0
        cur, rem = self._current[:size], self._remaining[:, :size]
        order = (-rem).argsort(axis=1, kind="stable")  # as `future_peak` sorts
        grown = cur[order].cumsum(axis=1) + rem[self._list_index, order] * self._rank[:size]
        return int(grown.max())

    def _per_list(self, remaining: np.ndarray | int) -> np.ndarray:
        rem = np.asarray(remaining, dtype=np.int64)
        if rem.shape != (self._lists,):
            rem = np.broadcast_to(rem, (self._lists,))
        return rem

    @property
    def peak(self) -> int:
        """The current future peak (the largest over the sample lists)."""
        if self._lists == 0:  # as the largest of no peaks
            raise ValueError("no sample lists")
        return self._peak_of(self._size)

    def peak_with(self, current: int, remaining: np.ndarray) -> int:
        """The peak if a request with `current` tokens and `remaining[l]` (per list) joined."""
        self._current[self._size] = int(current)
        self._remaining[:, self._size] = self._per_list(remaining)
        return self._peak_of(self._size + 1)

    def try_admit(self, current: int, remaining: np.ndarray | int) -> bool:
        """Admits (and remembers) the candidate if the peak stays within the limit."""
        if self.peak_with(current, self._per_list(remaining)) > self.limit_tokens:
            return False
        # The candidate already sits in the spare slot: keep it, and open a new spare (a round
        # admits a few requests at most, so growing by one column each time costs little).
        self._size += 1
        self._current = np.append(self._current, 0)
        self._remaining = np.hstack([self._remaining, np.zeros((self._lists, 1), np.int64)])
        self._rank = np.arange(1, self._size + 2, dtype=np.int64)
        return True
