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

import collections
from collections.abc import Sequence

import numpy as np

from backend.policy.pastfuture import LengthHistory, PeakTracker, num_sample_lists
from backend.policy.types import ReqState


class LengthModel:
    """Output-length predictions per length key, with a cold-start prior."""

    def __init__(self, *, window: int, min_samples: int, seed: int) -> None:
        self.window = window
        self.min_samples = min_samples
        self.rng = np.random.default_rng(seed)
        self.histories: dict[str, LengthHistory] = {}
        self._total: dict[str, int] = {}  # rid -> predicted total output length
        self._from_prior: set[str] = set()  # rids whose prediction is the cold-start prior

    def is_warm(self, key: str) -> bool:
        hist = self.histories.get(key)
        return hist is not None and len(hist) >= self.min_samples

    def observe(self, rid: str, key: str, output_len: int) -> None:
        """A request finished with `output_len` tokens."""
        hist = self.histories.get(key)
        if hist is None:
            hist = self.histories[key] = LengthHistory(self.window)
        hist.add(output_len)
        self.forget(rid)

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

    def sample(self, reqs: Sequence[ReqState], lists: int) -> np.ndarray:
        """Fresh predicted totals, shape (lists, len(reqs)): conditioned on each request's
        generated tokens, clipped to its cap; the prior (the cap) for a cold key."""
        n = len(reqs)
        out = np.empty((lists, n), dtype=np.int64)
        by_key: dict[str, list[int]] = collections.defaultdict(list)
        for i, r in enumerate(reqs):
            by_key[r.length_key].append(i)
        for key, members in by_key.items():
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


class AdmissionRound:
    """Future-peak admission for one plan. The trackers are built on the first question (most
    iterations admit nothing) and grow with every admission of the plan."""

    def __init__(self, lengths: LengthModel, rt_running: list[ReqState],
                 be_running: list[ReqState], *, page: int, rt_limit: float,
                 be_limit: float) -> None:
        self.lengths = lengths
        self.page = page
        self.rt_limit = rt_limit
        self.be_limit = be_limit
        self._rt_running = rt_running
        self._be_running = be_running
        self._rt: list[PeakTracker] | None = None
        self._all: list[PeakTracker] | None = None
        self._admitted: list[tuple[ReqState, np.ndarray]] = []  # before `_all` was built

    def _trackers(self, reqs: list[ReqState]) -> list[PeakTracker]:
        lists = num_sample_lists(len(reqs))
        page = self.page
        current = np.fromiter((r.kv_tokens + r.prefill_len - r.prefilled + page - 1
                               for r in reqs), dtype=np.int64, count=len(reqs))
        gen = np.fromiter((r.generated for r in reqs), dtype=np.int64, count=len(reqs))
        rows = [self.lengths.totals(reqs)]
        if lists > 1 and reqs:
            rows.extend(self.lengths.sample(reqs, lists - 1))
        return [PeakTracker.from_arrays(current, np.maximum(1, row - gen)) for row in rows]

    def _candidate(self, r: ReqState, lists: int) -> np.ndarray:
        totals = self.lengths.sample([r], lists)[:, 0]
        rem: np.ndarray = np.maximum(1, totals - r.generated)
        return rem

    def admit_rt(self, r: ReqState) -> bool:
        """Admits RT `r` if the RT future peak stays under the RT limit."""
        if self._rt is None:
            self._rt = self._trackers(self._rt_running)
        rem = self._candidate(r, len(self._rt))
        current = r.prefill_len + self.page - 1
        if any(t.peak_with((current, int(rem[i]))) > self.rt_limit
               for i, t in enumerate(self._rt)):
            return False
        for i, t in enumerate(self._rt):
            t.add((current, int(rem[i])))
        self._remember(r, rem)
        return True

    def admit_be(self, r: ReqState, *, limit: float | None = None) -> bool:
        """Admits BE `r` if the whole future peak stays under the BE limit (or `limit`)."""
        trackers = self._all_trackers()
        rem = self._candidate(r, len(trackers))
        current = r.prefill_len + self.page - 1
        cap = self.be_limit if limit is None else limit
        if any(t.peak_with((current, int(rem[i % len(rem)]))) > cap
               for i, t in enumerate(trackers)):
            return False
        for i, t in enumerate(trackers):
            t.add((current, int(rem[i % len(rem)])))
        return True

    def _remember(self, r: ReqState, rem: np.ndarray) -> None:
        if self._all is None:
            self._admitted.append((r, rem))
            return
        for i, t in enumerate(self._all):
            t.add((r.prefill_len + self.page - 1, int(rem[i % len(rem)])))

    def _all_trackers(self) -> list[PeakTracker]:
        if self._all is None:
            self._all = self._trackers(self._rt_running + self._be_running)
            for r, rem in self._admitted:
                for i, t in enumerate(self._all):
                    t.add((r.prefill_len + self.page - 1, int(rem[i % len(rem)])))
            self._admitted.clear()
        return self._all
