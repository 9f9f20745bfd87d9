"""Memory admission (Past-Future, shared/digests/001_pastfuture.md): predicted output lengths
per length key, the future KV peak of the running set, and an adaptive RT headroom.

    RT candidate:  peak(RT running + RT admitted now + it)  ≤ cap·(1 − reserve)
                   (BE memory counts as free: RT may evict BE)
    BE candidate:  peak(all running + admitted now + it)     ≤ cap·(1 − reserve) − headroom

Predictions (`LengthModel`): a key with fewer than `min_samples` finished requests predicts the
request's own max_new_tokens (the cold-start prior); after that, a sample from the key's
windowed history conditioned on the tokens already generated. A running request keeps its
sample while it is still ahead of what it generated: a draw from P(l | l > a) that exceeds b is
a draw from P(l | l > b), so keeping it is as good as redrawing, and each iteration only redraws
the few requests that outgrew theirs. Small batches get extra, freshly drawn sample lists (the
peak is checked against each; Past-Future's variance guard).
"""

from __future__ import annotations

import bisect
import collections
import random
from collections.abc import Sequence

import numpy as np

from backend.policy.pastfuture import LengthHistory, PeakTracker, future_peak, num_sample_lists
from backend.policy.types import ReqState

SCALAR_SAMPLES = 32
"""Draws (requests × lists) of one key up to which `LengthModel.sample` takes the scalar path."""


class LengthModel:
    """Output-length predictions per length key, with a cold-start prior."""

    def __init__(self, *, window: int, min_samples: int, seed: int) -> None:
        self.window = window
        self.min_samples = min_samples
        self.rng = np.random.default_rng(seed)
        self.histories: dict[str, LengthHistory] = {}
        self._total: dict[str, int] = {}  # rid -> predicted total output length
        self._from_prior: set[str] = set()  # rids whose prediction is the cold-start prior
        self._lists: dict[str, list[int]] = {}  # key -> sorted history as a list (scalar path)
        self._scalar_rng = random.Random(seed)

    def is_warm(self, key: str) -> bool:
        hist = self.histories.get(key)
        return hist is not None and len(hist) >= self.min_samples

    def observe(self, rid: str, key: str, output_len: int) -> None:
        """A request finished with `output_len` tokens."""
        hist = self.histories.get(key)
        if hist is None:
            hist = self.histories[key] = LengthHistory(self.window)
        hist.add(output_len)
        self._lists.pop(key, None)
        self.forget(rid)

    def replace_history(self, key: str, output_lens: Sequence[int]) -> None:
        """Sets `key`'s history to `output_lens` (oldest first; the newest `window` kept): the
        authoritative copy from the gateway's SQL store, which already holds what this engine
        observed itself."""
        hist = self.histories[key] = LengthHistory(self.window)
        hist.extend(int(n) for n in output_lens)
        self._lists.pop(key, None)

    def forget(self, rid: str) -> None:
        self._total.pop(rid, None)
        self._from_prior.discard(rid)

    def totals(self, reqs: Sequence[ReqState]) -> np.ndarray:
        """Predicted total output length of each request (kept samples, redrawn when stale)."""
        n = len(reqs)
        gen = np.fromiter((r.generated for r in reqs), dtype=np.int64, count=n)
        cache = self._total
        total = np.fromiter((cache.get(r.rid, 0) for r in reqs), dtype=np.int64, count=n)
        stale = total <= gen
        if self._from_prior:
            for i, r in enumerate(reqs):
                if r.rid in self._from_prior and self.is_warm(r.length_key):
                    stale[i] = True
        idx = np.flatnonzero(stale)
        if idx.size:
            fresh = self.sample([reqs[i] for i in idx.tolist()], 1)[0]
            total[idx] = fresh
            for i, value in zip(idx.tolist(), fresh.tolist(), strict=True):
                r = reqs[i]
                cache[r.rid] = value
                if self.is_warm(r.length_key):
                    self._from_prior.discard(r.rid)
                else:
                    self._from_prior.add(r.rid)
        return total

    def sample_one(self, r: ReqState, lists: int) -> list[int]:
        """`lists` fresh predicted totals for one request (the scalar twin of `sample`, without
        numpy's per-call overhead: admission asks this for every candidate)."""
        cap, gen = r.max_new_tokens, r.generated
        floor = min(gen + 1, cap)
        if not self.is_warm(r.length_key):
            return [max(cap, floor)] * lists
        hist = self._sorted_list(r.length_key)
        top = max(cap, hist[-1])
        pos = bisect.bisect_right(hist, gen)
        n_points = len(hist) - pos + 2  # [gen] + hist[pos:] + [top]

        def point(j: int) -> int:
            return gen if j == 0 else top if j == n_points - 1 else hist[pos + j - 1]

        out = []
        for _ in range(lists):
            u = self._scalar_rng.random() * (n_points - 1)
            lo = min(int(u), n_points - 2)
            left, right = point(lo), point(lo + 1)
            total = round(left + (right - left) * (u - lo))
            out.append(min(max(total, floor), max(cap, floor)))
        return out

    def _sorted_list(self, key: str) -> list[int]:
        cached = self._lists.get(key)
        if cached is None:
            cached = self._lists[key] = self.histories[key].sorted_values().tolist()
        return cached

    def sample(self, reqs: Sequence[ReqState], lists: int) -> np.ndarray:
        """Fresh predicted totals, shape (lists, len(reqs)): conditioned on each request's
        generated tokens, clipped to its cap; the prior (the cap) for a cold key."""
        n = len(reqs)
        out = np.empty((lists, n), dtype=np.int64)
        by_key: dict[str, list[int]] = collections.defaultdict(list)
        for i, r in enumerate(reqs):
            by_key[r.length_key].append(i)
        for key, members in by_key.items():
            if len(members) * lists <= SCALAR_SAMPLES and self.is_warm(key) and self.histories[key]:
                self._sample_scalar(reqs, key, members, lists, out)
                continue
            cap = np.array([reqs[i].max_new_tokens for i in members], dtype=np.int64)
            gen = np.array([reqs[i].generated for i in members], dtype=np.int64)
            floor = np.minimum(gen + 1, cap)
            if not self.is_warm(key):
                out[:, members] = np.maximum(cap, floor)
                continue
            hist = self.histories[key]
            draws = hist.sample_total(self.rng, np.broadcast_to(gen, (lists, gen.size)), cap)
            out[:, members] = np.clip(draws, floor, np.maximum(cap, floor))
        return out

    def _sample_scalar(
        self,
        reqs: Sequence[ReqState],
        key: str,
        members: list[int],
        lists: int,
        out: np.ndarray,
    ) -> None:
        """`sample` of a few requests of one warm key without numpy's per-call overhead (most
        plans redraw only the few requests that outgrew their sample): the same draws from the
        same generator in the same order (row-major over (lists, members), as
        `LengthHistory.sample_total` draws them) and the same arithmetic, so the same
        numbers."""
        hist = self._sorted_list(key)
        largest = hist[-1]
        random = self.rng.random
        rows = []
        for i in members:
            r = reqs[i]
            cap, gen = r.max_new_tokens, r.generated
            top = max(cap, largest)
            pos = bisect.bisect_right(hist, gen)
            rows.append((gen, top, pos, len(hist) - pos + 2, min(gen + 1, cap), cap))
        for row in range(lists):
            for i, (gen, top, pos, n_points, floor, cap) in zip(members, rows, strict=True):
                u = random() * (n_points - 1)
                lo = min(int(u), n_points - 2)
                frac = u - lo
                left = gen if lo == 0 else hist[pos + lo - 1]
                right = top if lo + 1 == n_points - 1 else hist[pos + lo]
                total = round(left + (right - left) * frac)
                total = min(max(total, gen), max(top, gen))  # sample_total's clip
                out[row, i] = min(max(total, floor), max(cap, floor))


class RtHeadroom:
    """KV kept free from BE admission for RT requests still to arrive: how far RT usage rose
    above its current level within the last `window_s` (a sliding maximum), between a floor
    and a ceiling (fractions of capacity)."""

    def __init__(self, *, window_s: float, floor_frac: float, max_frac: float = 1.0) -> None:
        self.window_s = window_s
        self.floor_frac = floor_frac
        self.max_frac = max(floor_frac, max_frac)
        self._peaks: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, now_s: float, rt_kv_tokens: int) -> None:
        """Records the RT KV use at `now_s` (monotonic deque: O(1) amortised)."""
        peaks = self._peaks
        while peaks and peaks[-1][1] <= rt_kv_tokens:
            peaks.pop()
        peaks.append((now_s, rt_kv_tokens))
        while peaks[0][0] < now_s - self.window_s:
            peaks.popleft()

    def tokens(self, capacity: int, rt_kv_tokens: int) -> int:
        """The headroom now, tokens."""
        recent = self._peaks[0][1] if self._peaks else 0
        rise = min(recent - rt_kv_tokens, int(self.max_frac * capacity))
        return max(int(self.floor_frac * capacity), rise)


class _Scope:
    """Future-peak state of one admission scope (RT alone, or everything) for one plan.

    Adding a request that holds c tokens and grows for r more raises the future peak by at most
    c + r (its own footprint never exceeds that), so `peak + Σ(c + r) of the admitted` bounds
    the peak from above: while the bound fits, admission is O(1) per candidate. Only when it
    does not are exact `PeakTracker`s built (once per plan) and asked.
    """

    def __init__(self, current: np.ndarray, remaining: list[np.ndarray]) -> None:
        self.current = current
        self.remaining = remaining
        self.bound = [future_peak(current, rem) for rem in remaining]
        self.trackers: list[PeakTracker] | None = None
        self.pending: list[tuple[int, list[int]]] = []

    def fits(self, current: int, rem: list[int], limit: float) -> bool:
        if all(b + current + rem[i] <= limit for i, b in enumerate(self.bound)):
            return True
        if self.trackers is None:
            self.trackers = [PeakTracker.from_arrays(self.current, r) for r in self.remaining]
            for c, rs in self.pending:
                for i, t in enumerate(self.trackers):
                    t.add((c, rs[i]))
            self.pending.clear()
        return all(t.peak_with((current, rem[i])) <= limit for i, t in enumerate(self.trackers))

    def add(self, current: int, rem: list[int]) -> None:
        for i in range(len(self.bound)):
            self.bound[i] += current + rem[i]
        if self.trackers is None:
            self.pending.append((current, rem))
        else:
            for i, t in enumerate(self.trackers):
                t.add((current, rem[i]))


class AdmissionRound:
    """Future-peak admission for one plan. The running set's peak is computed on the first
    question (most iterations admit nothing) and every admission of the plan joins it."""

    def __init__(
        self,
        lengths: LengthModel,
        rt_running: list[ReqState],
        be_running: list[ReqState],
        *,
        page: int,
        rt_limit: float,
        be_limit: float,
    ) -> None:
        self.lengths = lengths
        self.page = page
        self.rt_limit = rt_limit
        self.be_limit = be_limit
        self._rt_running = rt_running
        self._be_running = be_running
        self._rt: _Scope | None = None
        self._all: _Scope | None = None
        self._lists = 1

    def _scopes(self) -> tuple[_Scope, _Scope]:
        if self._rt is None or self._all is None:
            reqs = self._rt_running + self._be_running
            n_rt = len(self._rt_running)
            self._lists = num_sample_lists(len(reqs))
            page = self.page
            current = np.fromiter(
                (r.kv_tokens + r.prefill_len - r.prefilled + page - 1 for r in reqs),
                dtype=np.int64,
                count=len(reqs),
            )
            gen = np.fromiter((r.generated for r in reqs), dtype=np.int64, count=len(reqs))
            rows = [self.lengths.totals(reqs)]
            if self._lists > 1 and reqs:
                rows.extend(self.lengths.sample(reqs, self._lists - 1))
            rem = [np.maximum(1, row - gen) for row in rows]
            self._rt = _Scope(current[:n_rt], [x[:n_rt] for x in rem])
            self._all = _Scope(current, rem)
        return self._rt, self._all

    def _candidate(self, r: ReqState) -> tuple[int, list[int]]:
        totals = self.lengths.sample_one(r, self._lists)
        return r.prefill_len + self.page - 1, [max(1, t - r.generated) for t in totals]

    def admit_rt(self, r: ReqState) -> bool:
        """Admits RT `r` if the RT future peak stays under the RT limit (BE memory counts as
        free: RT may evict BE)."""
        rt, every = self._scopes()
        current, rem = self._candidate(r)
        if not rt.fits(current, rem, self.rt_limit):
            return False
        rt.add(current, rem)
        every.add(current, rem)
        return True

    def admit_be(self, r: ReqState, *, limit: float | None = None) -> bool:
        """Admits BE `r` if the whole future peak stays under the BE limit (or `limit`)."""
        _, every = self._scopes()
        current, rem = self._candidate(r)
        if not every.fits(current, rem, self.be_limit if limit is None else limit):
            return False
        every.add(current, rem)
        return True
