"""Incremental waiting queues, one per tier, kept in step with the engine's waiting lists
without re-sorting (or even re-reading) thousands of requests every iteration.

The engine hands over its waiting list of a tier in arrival order each iteration. New arrivals
are appended at its tail; requests leave it only when a plan admits them (the policy knows
which) or on an abort. So a sync walks the list backwards from the tail until it has found the
newcomers the length difference announces — O(new), not O(n) — and reconciles with the whole
list when the counts do not add up (an abort, or a test handing over arbitrary snapshots).
A reconciliation with the whole list every `FULL_SYNC_EVERY` syncs bounds how long an
unnoticed abort can linger.

Heaps use lazy deletion: an entry is valid while its request is known in the same *epoch* it
was pushed in (a request admitted and later evicted comes back in a new epoch, so its old
entries stay dead). A valid entry whose request still runs (evicted by the plan being built) is
kept but not offered. Candidates popped during a plan but not taken are pushed back by
`restore`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator

from backend.policy.types import ReqState

FULL_SYNC_EVERY = 64
"""Every this many syncs, the known set is checked against the whole list."""

Entry = tuple[float, float, int, str, int]  # (key, tie-break, sequence, rid, epoch)


class WaitingSet:
    """Which requests of one tier are waiting, as far as the policy knows."""

    def __init__(self) -> None:
        self.reqs: dict[str, ReqState] = {}
        """Waiting requests by rid."""
        self.epochs: dict[str, int] = {}
        """The epoch each known request entered in."""
        self._epoch = itertools.count()
        self._syncs = 0

    def sync(self, waiting: list[ReqState]) -> list[ReqState]:
        """The requests of `waiting` not seen before (now known). Fast path: the newcomers
        are the unknown ones at the tail. When the counts do not add up, and every
        `FULL_SYNC_EVERY` syncs, the known set is reconciled with the whole list instead
        (O(n), no heap rebuild: entries of vanished requests die lazily)."""
        self._syncs += 1
        missing = len(waiting) - len(self.reqs)
        if self._syncs % FULL_SYNC_EVERY and missing >= 0:
            new: list[ReqState] = []
            reqs = self.reqs
            for r in reversed(waiting):
                if len(new) == missing:
                    break
                if r.rid not in reqs:
                    new.append(r)
            if len(new) == missing and (new or not waiting or waiting[-1].rid in reqs):
                new.reverse()
                for r in new:
                    self.add(r)
                return new
        return self._reconcile(waiting)

    def _reconcile(self, waiting: list[ReqState]) -> list[ReqState]:
        present = {r.rid for r in waiting}
        for rid in [rid for rid in self.reqs if rid not in present]:
            self.take(rid)  # vanished (an abort, or a plan that was never executed)
        new = [r for r in waiting if r.rid not in self.reqs]
        for r in new:
            self.add(r)
        return new

    def is_current(self, rid: str, epoch: int) -> bool:
        """An entry pushed in `epoch` still stands for a known request."""
        return self.epochs.get(rid) == epoch

    def take(self, rid: str) -> None:
        """The request was admitted by the plan being built."""
        self.reqs.pop(rid, None)
        self.epochs.pop(rid, None)

    def add(self, req: ReqState) -> None:
        """The request is (or, evicted by the plan, will be) waiting: a new epoch."""
        self.reqs[req.rid] = req
        self.epochs[req.rid] = next(self._epoch)


class KeyedHeap:
    """A min-heap of waiting requests by a key, with lazy deletion and pop-then-restore."""

    def __init__(self, known: WaitingSet) -> None:
        self.known = known
        self._heap: list[Entry] = []
        self._popped: list[Entry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, req: ReqState, key: float, tie: float = 0.0) -> None:
        heapq.heappush(self._heap, (key, tie, next(self._seq), req.rid, self.known.epochs[req.rid]))

    def pop_valid(self) -> tuple[float, ReqState] | None:
        """Pops the smallest entry of a waiting request (remembered for `restore`); None when
        there is none."""
        heap, known = self._heap, self.known
        while heap:
            entry = heapq.heappop(heap)
            if not known.is_current(entry[3], entry[4]):
                continue  # dead: admitted since, or superseded by a newer entry
            self._popped.append(entry)
            req = known.reqs[entry[3]]
            if not req.is_running:  # else evicted by this plan: not before the next one
                return entry[0], req
        return None

    def peek_valid(self) -> tuple[float, ReqState] | None:
        """The smallest entry of a waiting request, left in place."""
        heap, known = self._heap, self.known
        while heap:
            entry = heap[0]
            if known.is_current(entry[3], entry[4]):
                req = known.reqs[entry[3]]
                if not req.is_running:
                    return entry[0], req
                self._popped.append(heapq.heappop(heap))
                continue
            heapq.heappop(heap)
        return None

    def drop_popped(self, rid: str) -> None:
        """A popped entry leaves for good (not restored)."""
        self._popped = [e for e in self._popped if e[3] != rid]

    def restore(self) -> None:
        """Puts back the entries popped during this plan that are still current."""
        for entry in self._popped:
            if self.known.is_current(entry[3], entry[4]):
                heapq.heappush(self._heap, entry)
        self._popped.clear()

    def iter_valid(self) -> Iterator[tuple[float, ReqState]]:
        """Valid entries in key order, popping as it goes (call `restore` afterwards)."""
        while (item := self.pop_valid()) is not None:
            yield item


class RtQueue:
    """Waiting RT requests: feasible ones by latest start time (deadline − standalone prefill
    time), then hopeless ones (the TTFT is lost whatever happens) oldest first.

    Serving a hopeless request before a feasible one only turns a second request into a miss
    (EDF's domino effect under overload), so they wait behind every feasible one; they are
    still RT, so they still go before any BE. A request that already emitted tokens (evicted
    mid-decode) is never hopeless: its TPOT can still be met, so it goes first.
    """

    def __init__(self, lst_of: Callable[[ReqState], float]) -> None:
        self.known = WaitingSet()
        self.feasible = KeyedHeap(self.known)
        self.hopeless = KeyedHeap(self.known)
        self._lst_of = lst_of

    def __len__(self) -> int:
        return len(self.known.reqs)

    def sync(self, waiting: list[ReqState]) -> None:
        for r in self.known.sync(waiting):
            self._push(r)

    def _push(self, r: ReqState) -> None:
        key = -math.inf if r.first_token_s is not None else self._lst_of(r)
        self.feasible.push(r, key, r.arrival_s)

    def requeue(self, r: ReqState) -> None:
        """An evicted RT request waits again."""
        self.known.add(r)
        self._push(r)

    def candidates(self, now_s: float) -> Iterator[ReqState]:
        """Waiting RT requests in service order (popping; `restore` afterwards): feasible by
        latest start time, moving the ones found hopeless to the hopeless heap; then those."""
        seen: set[str] = set()
        for lst, r in self.feasible.iter_valid():
            if lst < now_s and r.first_token_s is None:
                self.feasible.drop_popped(r.rid)
                self.hopeless.push(r, r.arrival_s)
                continue
            if r.rid not in seen:
                seen.add(r.rid)
                yield r
        for _, r in self.hopeless.iter_valid():
            if r.rid not in seen:
                seen.add(r.rid)
                yield r

    def take(self, r: ReqState) -> None:
        self.known.take(r.rid)

    def restore(self) -> None:
        self.feasible.restore()
        self.hopeless.restore()


class BeQueue:
    """Waiting BE requests in service order:

    1. resumed — evicted BE requests first, in eviction order (their work resumes, and their
       prefix is likely still cached);
    2. deadline — BE requests with a completion deadline, by latest start time (deadline −
       standalone JCT); one that can no longer make it at the engine's current pace
       (`is_hopeless`) drops to the plain order, so the ones that still can go first;
    3. aged — the oldest request once it has waited `max_wait_s` (bounded wait);
    4. otherwise the caller's order (ReqState.order_key) with probability `order_prob`, else the
       oldest (HyGen's freshness mix: every request reaches the head eventually).
    """

    def __init__(
        self,
        deadline_lst_of: Callable[[ReqState], float],
        is_hopeless: Callable[[ReqState, float], bool],
        *,
        seed: int,
        order_prob: float,
        max_wait_s: float,
    ) -> None:
        self.known = WaitingSet()
        self.resumed = KeyedHeap(self.known)
        self.deadline = KeyedHeap(self.known)
        self.by_order = KeyedHeap(self.known)
        self.by_age = KeyedHeap(self.known)
        self._heaps = (self.resumed, self.deadline, self.by_order, self.by_age)
        self._lst_of = deadline_lst_of
        self._is_hopeless = is_hopeless
        self._rng = random.Random(seed)
        self.order_prob = order_prob
        self.max_wait_s = max_wait_s
        self._evictions = itertools.count()

    def __len__(self) -> int:
        return len(self.known.reqs)

    def sync(self, waiting: list[ReqState]) -> None:
        for r in self.known.sync(waiting):
            self._push(r)

    def _push(self, r: ReqState) -> None:
        if r.deadline_due_s is not None:
            self.deadline.push(r, self._lst_of(r), r.arrival_s)
        self.by_order.push(r, r.order_key, r.arrival_s)
        self.by_age.push(r, r.arrival_s, r.order_key)

    def requeue(self, r: ReqState) -> None:
        """An evicted BE request waits again (it resumes first)."""
        self.known.add(r)
        self.resumed.push(r, float(next(self._evictions)))
        self._push(r)

    def candidates(self, now_s: float) -> Iterator[ReqState]:
        """Waiting BE requests in service order (popping; `restore` afterwards)."""
        seen: set[str] = set()
        for _, r in self.resumed.iter_valid():
            seen.add(r.rid)
            yield r
        for lst, r in self.deadline.iter_valid():
            if lst < now_s or self._is_hopeless(r, now_s):  # plain order from now on
                self.deadline.drop_popped(r.rid)
                continue
            if r.rid not in seen:
                seen.add(r.rid)
                yield r
        while True:
            item = self._next_plain(now_s)
            if item is None:
                return
            if item.rid not in seen:
                seen.add(item.rid)
                yield item

    def _next_plain(self, now_s: float) -> ReqState | None:
        oldest = self.by_age.peek_valid()
        if oldest is not None and now_s - oldest[1].arrival_s > self.max_wait_s:
            popped = self.by_age.pop_valid()
            return None if popped is None else popped[1]
        heap = self.by_order if self._rng.random() < self.order_prob else self.by_age
        popped = heap.pop_valid()
        if popped is None:
            other = self.by_age if heap is self.by_order else self.by_order
            popped = other.pop_valid()
        return None if popped is None else popped[1]

    def take(self, r: ReqState) -> None:
        self.known.take(r.rid)

    def restore(self) -> None:
        for heap in self._heaps:
            heap.restore()
