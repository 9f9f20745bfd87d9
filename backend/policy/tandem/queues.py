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

Tenants: each queue keeps one *lane* (its heaps) per tenant and offers the lanes' candidates
interleaved by weighted fair share (backend.policy.fair_share): the next candidate comes from
the tenant with the least virtual token counter among those with one left — each candidate
offered counting its prompt for the rest of the pass, so a window collected before anything is
scheduled is interleaved too — each lane keeping the tier's own order (RT by latest start, BE
by its resume/deadline/caller order). The policy charges the counters with the tokens each
plan schedules. A tenant's lane is backlogged while the WaitingSet holds a request of it.
With one tenant the lane is the whole queue and the order is exactly the single-tenant one.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator

from backend.policy.fair_share import FairShare, interleave
from backend.policy.tandem import slack
from backend.policy.types import ReqState

FULL_SYNC_EVERY = 64
"""Every this many syncs, the known set is checked against the whole list."""

Entry = tuple[float, float, int, str, int]  # (key, tie-break, sequence, rid, epoch)


def _tenant(r: ReqState) -> str:
    return r.tenant_id


def _anonymous(r: ReqState) -> str:
    return ""


def prompt_cost(r: ReqState) -> float:
    """What serving a waiting request's prompt charges its tenant: the tokens still to
    prefill over its weight."""
    return (r.prefill_len - r.prefilled) / r.tenant_weight


class WaitingSet:
    """Which requests of one tier are waiting, as far as the policy knows, and so which
    tenants are backlogged (told to `fair`)."""

    def __init__(self, fair: FairShare | None = None, *, by_tenant: bool = True) -> None:
        self.reqs: dict[str, ReqState] = {}
        """Waiting requests by rid."""
        self.epochs: dict[str, int] = {}
        """The epoch each known request entered in."""
        self.fair = fair if fair is not None else FairShare()
        """The tier's fair-share counters: a tenant is backlogged while it has a request here."""
        self.per_tenant: dict[str, int] = {}
        """tenant → its requests in `reqs` (tenants with none are absent)."""
        self.tenant_of: Callable[[ReqState], str] = _tenant if by_tenant else _anonymous
        """The lane a request waits in: its tenant, or "" for all (fair share off)."""
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
        req = self.reqs.pop(rid, None)
        self.epochs.pop(rid, None)
        if req is not None:
            tenant = self.tenant_of(req)
            left = self.per_tenant[tenant] - 1
            if left:
                self.per_tenant[tenant] = left
            else:
                del self.per_tenant[tenant]
                self.fair.set_idle(tenant)

    def add(self, req: ReqState) -> None:
        """The request is (or, evicted by the plan, will be) waiting: a new epoch."""
        if req.rid not in self.reqs:
            tenant = self.tenant_of(req)
            count = self.per_tenant.get(tenant, 0)
            if not count:
                self.fair.set_backlogged(tenant)
            self.per_tenant[tenant] = count + 1
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


MAX_STEAL_SCAN = 256
"""A hopeless RT request moves forward only while at most this many feasible ones wait (their
slack is checked one by one, every plan); past that the engine is overloaded and there is no
slack to spare anyway."""


@dataclasses.dataclass(frozen=True)
class PromptPace:
    """How fast the RT phase works through waiting prompts, to tell how much slack the feasible
    ones can spare for a hopeless one (`RtQueue.candidates`). Prompts are taken at
    `chunk_tokens` per iteration of `iteration_s` (the chunk that fits beside the running
    decodes: the rate the phase's urgency test assumes), after `ahead_tokens` of running
    partial prompts; one iteration more covers the rounding to whole iterations."""

    chunk_tokens: int
    iteration_s: float
    ahead_tokens: int = 0
    headroom: float = 1.0
    """A feasible request's first token may be pushed to this fraction of its TTFT target at
    most (`TandemConfig.slo_headroom`: the rest is for the latency model's error)."""
    slots: int | None = None
    """Request slots the waiting RT prompts can take now (free, or held by BE, which gives
    them up); None: no cap. A hopeless request goes before feasible ones only while a slot
    is left for each of them: one taken from a feasible request costs it the wait for a
    running one to finish, far more than a prompt's time (the simulator's slot-bound stream
    with outputs the engine cannot know: an admitted request 10 ms from its deadline took
    the one free slot from one admitted in time, which then came 0.55 s late of 0.5 s)."""

    def seconds(self, tokens: int) -> float:
        """The time the phase takes for `tokens` of prompt."""
        return tokens / max(1, self.chunk_tokens) * self.iteration_s

    def merge(self, feasible: list[ReqState], late: list[ReqState], now_s: float) -> list[ReqState]:
        """`feasible` (in service order) with each of `late` (in its order, which is kept) put
        before the first feasible one from which every feasible request still has, at this
        pace, its prompt's own time to spare once the late one's prompt goes first."""
        spare: list[float] = []
        done = self.ahead_tokens
        for r in feasible:
            done += r.prefill_len - r.prefilled
            deadline = slack.rt_deadline(r)
            if r.first_token_s is None and r.ttft_due_s is not None:
                deadline = r.arrival_s + self.headroom * (r.ttft_due_s - r.arrival_s)
            spare.append(deadline - now_s - self.seconds(done) - self.iteration_s)
        before: list[list[ReqState]] = [[] for _ in range(len(feasible) + 1)]
        start = 0
        moved = 0
        for r in late:
            cost = self.seconds(r.prefill_len - r.prefilled)
            at = len(feasible)  # behind every feasible one: always safe
            least = math.inf
            if self.slots is not None and len(feasible) + moved + 1 > self.slots:
                start = len(feasible)  # no slot to spare: this and every later one go behind
            for i in range(len(feasible) - 1, start - 1, -1):  # the suffix minima of spare
                least = min(least, spare[i])
                if least < cost:
                    break
                at = i
            moved += at < len(feasible)
            before[at].append(r)
            for i in range(at, len(feasible)):
                spare[i] -= cost
            start = at
        out: list[ReqState] = []
        for i, r in enumerate(feasible):
            out.extend(before[i])
            out.append(r)
        out.extend(before[-1])
        return out


def _overdue(late: list[ReqState], now_s: float, bound_frac: float) -> ReqState | None:
    """The request of `late` latest past its TTFT deadline, if it is more than `bound_frac` of
    its TTFT target past it."""
    worst, worst_over = None, bound_frac
    for r in late:
        over = r.ttft_lateness(now_s)
        if over > worst_over:
            worst, worst_over = r, over
    return worst


def _unique(reqs: Iterable[ReqState]) -> Iterator[ReqState]:
    """`reqs` without repeats (a request can stand in both of a lane's heaps)."""
    seen: set[str] = set()
    for r in reqs:
        if r.rid not in seen:
            seen.add(r.rid)
            yield r


class RtQueue:
    """Waiting RT requests, per tenant (interleaved by fair share, see the module docstring):
    feasible ones by latest start time (deadline − standalone prefill time), then hopeless ones
    (the TTFT is lost whatever happens) oldest first.

    Serving a hopeless request before a feasible one that then misses only turns a second
    request into a miss (EDF's domino effect under overload), so a hopeless one goes after
    every feasible one — of every tenant — unless the feasible ones behind it have the slack to
    spare (`PromptPace`, given by the caller): then it goes as early as that slack allows, and a
    request late by a little is not made late by a whole burst. They are still RT, so they
    still go before any BE. A request that already emitted tokens (evicted mid-decode) is never
    hopeless: its TPOT can still be met, so it goes first in its lane.
    """

    def __init__(
        self,
        lst_of: Callable[[ReqState], float],
        fair: FairShare | None = None,
        *,
        by_tenant: bool = True,
    ) -> None:
        self.known = WaitingSet(fair, by_tenant=by_tenant)
        self.fair = self.known.fair
        self.lanes: dict[str, _RtLane] = {}
        """tenant → its heaps."""
        self._lst_of = lst_of

    def __len__(self) -> int:
        return len(self.known.reqs)

    def sync(self, waiting: list[ReqState]) -> list[ReqState]:
        """Takes in the waiting RT requests not seen before; those newcomers."""
        new = self.known.sync(waiting)
        for r in new:
            self._push(r)
        return new

    def _push(self, r: ReqState) -> None:
        tenant = self.known.tenant_of(r)
        lane = self.lanes.get(tenant)
        if lane is None:
            lane = self.lanes[tenant] = _RtLane(self.known)
        key = -math.inf if r.first_token_s is not None else self._lst_of(r)
        lane.feasible.push(r, key, r.arrival_s)

    def requeue(self, r: ReqState) -> None:
        """An evicted RT request waits again."""
        self.known.add(r)
        self._push(r)

    def candidates(
        self,
        now_s: float,
        pace: PromptPace | None = None,
        *,
        late_bound_frac: float | None = None,
    ) -> Iterator[ReqState]:
        """Waiting RT requests in service order (popping; `restore` afterwards): the feasible
        ones of every tenant, interleaved by fair share, each lane by latest start time (moving
        the ones found hopeless to its hopeless heap); then the hopeless ones, likewise — each
        moved forward into the slack the feasible ones can spare at `pace` (None: none moves).
        With `late_bound_frac`, the hopeless one latest past its deadline goes first once its
        wait past it exceeds that fraction of its TTFT target: one each plan, so a request the
        admission let in is served even while the feasible ones never spare a moment (an
        overload that keeps the queue at the admission's limit)."""
        lanes = self._backlogged()
        offered: dict[str, float] = {}
        feasible = interleave(
            {t: lane.feasible_candidates(now_s) for t, lane in lanes.items()},
            self.fair,
            prompt_cost,
            offered,
        )
        # lazy: it pops the hopeless heaps only after the feasible stage has filled them
        late = interleave(
            {t: lane.hopeless_candidates() for t, lane in lanes.items()},
            self.fair,
            prompt_cost,
            offered,
        )
        moves = pace is not None or late_bound_frac is not None
        if not moves or not any(lane.has_hopeless(now_s) for lane in lanes.values()):
            yield from _unique(itertools.chain(feasible, late))
            return
        ahead = list(itertools.islice(feasible, MAX_STEAL_SCAN + 1))
        first_late = list(itertools.islice(late, MAX_STEAL_SCAN))
        overdue = None if late_bound_frac is None else _overdue(first_late, now_s, late_bound_frac)
        if overdue is not None:
            first_late.remove(overdue)
        order: Iterable[ReqState]
        if pace is not None and len(ahead) <= MAX_STEAL_SCAN:  # the whole feasible queue
            if overdue is not None:
                ahead_tokens = pace.ahead_tokens + overdue.prefill_len - overdue.prefilled
                pace = dataclasses.replace(pace, ahead_tokens=ahead_tokens)
            order = pace.merge(ahead, first_late, now_s)
        else:  # too long to check (none moves into the slack), or stealing off
            order = itertools.chain(ahead, feasible, first_late)
        lead = [] if overdue is None else [overdue]
        yield from _unique(itertools.chain(lead, order, late))

    def _backlogged(self) -> dict[str, _RtLane]:
        per_tenant = self.known.per_tenant
        return {t: lane for t, lane in self.lanes.items() if t in per_tenant}

    def take(self, r: ReqState) -> None:
        self.known.take(r.rid)

    def restore(self) -> None:
        for lane in self.lanes.values():
            lane.feasible.restore()
            lane.hopeless.restore()


class _RtLane:
    """One tenant's waiting RT requests: feasible by latest start, then hopeless by age."""

    def __init__(self, known: WaitingSet) -> None:
        self.feasible = KeyedHeap(known)
        self.hopeless = KeyedHeap(known)

    def feasible_candidates(self, now_s: float) -> Iterator[ReqState]:
        """Feasible ones by latest start; a fresh one whose latest start has passed moves to
        the hopeless heap instead."""
        for lst, r in self.feasible.iter_valid():
            if lst < now_s and r.first_token_s is None:
                self.feasible.drop_popped(r.rid)
                self.hopeless.push(r, r.arrival_s)
                continue
            yield r

    def has_hopeless(self, now_s: float) -> bool:
        """A hopeless request waits: in its heap, or still at the head of the feasible one (a
        fresh request whose latest start has passed; one behind an evicted request, which
        heads it, is found once that one is taken)."""
        if self.hopeless.peek_valid() is not None:
            return True
        head = self.feasible.peek_valid()
        return head is not None and -math.inf < head[0] < now_s

    def hopeless_candidates(self) -> Iterator[ReqState]:
        for _, r in self.hopeless.iter_valid():
            yield r


class BeQueue:
    """Waiting BE requests, per tenant (interleaved by fair share, see the module docstring),
    each lane in service order:

    1. resumed — evicted BE requests first, in eviction order (their work resumes, and their
       prefix is likely still cached);
    2. deadline — BE requests with a completion deadline, by latest start time (deadline −
       standalone JCT); one that can no longer make it at the engine's current pace
       (`is_hopeless`) drops to the plain order, so the ones that still can go first;
    3. aged — the oldest request once it has waited `max_wait_s` (bounded wait);
    4. otherwise the caller's order (ReqState.order_key: a batch's prefix-tree order, so the
       tenant's prefix locality is kept) with probability `order_prob`, else the oldest
       (HyGen's freshness mix: every request reaches the head eventually).
    """

    def __init__(
        self,
        deadline_lst_of: Callable[[ReqState], float],
        is_hopeless: Callable[[ReqState, float], bool],
        *,
        seed: int,
        order_prob: float,
        max_wait_s: float,
        fair: FairShare | None = None,
        by_tenant: bool = True,
    ) -> None:
        self.known = WaitingSet(fair, by_tenant=by_tenant)
        self.fair = self.known.fair
        self.lanes: dict[str, _BeLane] = {}
        """tenant → its heaps."""
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

    def _lane(self, r: ReqState) -> _BeLane:
        tenant = self.known.tenant_of(r)
        lane = self.lanes.get(tenant)
        if lane is None:
            lane = self.lanes[tenant] = _BeLane(self.known)
        return lane

    def _push(self, r: ReqState) -> None:
        lane = self._lane(r)
        if r.deadline_due_s is not None:
            lane.deadline.push(r, self._lst_of(r), r.arrival_s)
        lane.by_order.push(r, r.order_key, r.arrival_s)
        lane.by_age.push(r, r.arrival_s, r.order_key)

    def requeue(self, r: ReqState) -> None:
        """An evicted BE request waits again (it resumes first in its lane)."""
        self.known.add(r)
        self._lane(r).resumed.push(r, float(next(self._evictions)))
        self._push(r)

    def candidates(self, now_s: float) -> Iterator[ReqState]:
        """Waiting BE requests in service order (popping; `restore` afterwards)."""
        per_tenant = self.known.per_tenant
        streams = {
            t: self._lane_candidates(lane, now_s)
            for t, lane in self.lanes.items()
            if t in per_tenant
        }
        yield from interleave(streams, self.fair, prompt_cost)

    def _lane_candidates(self, lane: _BeLane, now_s: float) -> Iterator[ReqState]:
        seen: set[str] = set()
        for _, r in lane.resumed.iter_valid():
            seen.add(r.rid)
            yield r
        for lst, r in lane.deadline.iter_valid():
            if lst < now_s or self._is_hopeless(r, now_s):  # plain order from now on
                lane.deadline.drop_popped(r.rid)
                continue
            if r.rid not in seen:
                seen.add(r.rid)
                yield r
        while True:
            item = self._next_plain(lane, now_s)
            if item is None:
                return
            if item.rid not in seen:
                seen.add(item.rid)
                yield item

    def _next_plain(self, lane: _BeLane, now_s: float) -> ReqState | None:
        oldest = lane.by_age.peek_valid()
        if oldest is not None and now_s - oldest[1].arrival_s > self.max_wait_s:
            popped = lane.by_age.pop_valid()
            return None if popped is None else popped[1]
        heap = lane.by_order if self._rng.random() < self.order_prob else lane.by_age
        popped = heap.pop_valid()
        if popped is None:
            other = lane.by_age if heap is lane.by_order else lane.by_order
            popped = other.pop_valid()
        return None if popped is None else popped[1]

    def take(self, r: ReqState) -> None:
        self.known.take(r.rid)

    def restore(self) -> None:
        for lane in self.lanes.values():
            for heap in lane.heaps:
                heap.restore()


class _BeLane:
    """One tenant's waiting BE requests (the heaps of BeQueue's order)."""

    def __init__(self, known: WaitingSet) -> None:
        self.resumed = KeyedHeap(known)
        self.deadline = KeyedHeap(known)
        self.by_order = KeyedHeap(known)
        self.by_age = KeyedHeap(known)
        self.heaps = (self.resumed, self.deadline, self.by_order, self.by_age)
