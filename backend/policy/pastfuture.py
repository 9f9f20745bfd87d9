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

import collections
from collections.abc import Iterable

import numpy as np

DEFAULT_WINDOW = 1000
DEFAULT_RESERVE = 0.05
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
            self._sorted = np.sort(np.fromiter(self._values, dtype=np.int64,
                                               count=len(self._values)))
        return self._sorted

    def sample_total(self, rng: np.random.Generator, generated: np.ndarray,
                     max_len: np.ndarray | int) -> np.ndarray:
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


def _point(hist: np.ndarray, gen: np.ndarray, top: np.ndarray, pos: np.ndarray,
           n_points: np.ndarray, j: np.ndarray) -> np.ndarray:
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


class PeakAdmission:
    """Admits candidates one at a time while the predicted future peak fits.

    Built once per scheduling round from the running requests' current tokens and their
    predicted remaining tokens (one row per sample list); `try_admit` tests a candidate
    against every list and keeps it only if all peaks fit.
    """

    def __init__(self, current: np.ndarray, remaining_lists: np.ndarray, limit_tokens: float
                 ) -> None:
        self.limit_tokens = limit_tokens
        self._current = np.asarray(current, dtype=np.int64)
        self._remaining = np.atleast_2d(np.asarray(remaining_lists, dtype=np.int64))

    @property
    def peak(self) -> int:
        """The current future peak (the largest over the sample lists)."""
        return max(future_peak(self._current, rem) for rem in self._remaining)

    def peak_with(self, current: int, remaining: np.ndarray) -> int:
        """The peak if a request with `current` tokens and `remaining[l]` (per list) joined."""
        cur = np.append(self._current, current)
        return max(future_peak(cur, np.append(rem, remaining[i]))
                   for i, rem in enumerate(self._remaining))

    def try_admit(self, current: int, remaining: np.ndarray) -> bool:
        """Admits (and remembers) the candidate if the peak stays within the limit."""
        remaining = np.broadcast_to(np.asarray(remaining, dtype=np.int64),
                                    (self._remaining.shape[0],))
        if self.peak_with(current, remaining) > self.limit_tokens:
            return False
        self._current = np.append(self._current, current)
        self._remaining = np.concatenate([self._remaining, remaining[:, None]], axis=1)
        return True
