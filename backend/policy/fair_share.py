"""Weighted fair share among the tenants of one tier: virtual token counters (VTC, Sheng et al.,
"Fairness in Serving Large Language Models", OSDI '24), weighted.

Every tenant has a counter of the service it received, in weighted tokens::

    charge(tenant, tokens, weight):   counter += tokens / weight      (prompt and output tokens
                                                                       alike, as they are served)
    next tenant to serve:             the backlogged one with the least counter

so over any interval in which two tenants are both backlogged their served tokens stay in the
ratio of their weights (within one request's worth of tokens). A tenant that was not backlogged
gets no credit for the time it idled: when it becomes backlogged again its counter is lifted to
the least counter among the tenants backlogged now (or, when none is, to the counter of the
tenant whose backlog ended last)::

    becomes backlogged:  counter = max(counter, min(counters of the backlogged))

Without the lift a tenant that idled for a minute would come back with a minute of banked
service and take the engine from the others for as long; with it, it starts level with the
least served of them and the shares while both are backlogged follow the weights from there.

"Backlogged" is the caller's notion (the tandem policy: the tenant has a request waiting in
that tier's queue; the batch runner: a batch of the tenant has a line to dispatch). Service is
charged whether or not the tenant is backlogged (a tenant's running decodes count too).

Pure bookkeeping (no clock, no I/O); `interleave` merges per-tenant streams by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")


class FairShare:
    """Weighted virtual token counters of the tenants of one tier."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        """tenant → weighted tokens served (tokens / weight), lifted as described above."""
        self.backlogged: set[str] = set()
        """Tenants that have work waiting now."""
        self._last_idle_counter = 0.0  # counter of the tenant whose backlog ended last

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (0 for a tenant never seen)."""
        return self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, tokens: float, weight: float = 1.0) -> None:
        """`tokens` were served to `tenant` (weight > 0: its share relative to the others)."""
        if weight <= 0:
            raise ValueError(f"tenant {tenant!r}: weight must be > 0, got {weight}")
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / weight

    def set_backlogged(self, tenant: str) -> None:
        """`tenant` has work waiting from now on; when it had none, its counter is lifted to
        the least of the backlogged tenants' (no credit for idle time)."""
        if tenant in self.backlogged:
            return
        floor = (
            min(self.counters.get(t, 0.0) for t in self.backlogged)
            if self.backlogged
            else self._last_idle_counter
        )
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.backlogged.add(tenant)

    def set_idle(self, tenant: str) -> None:
        """`tenant` has no work waiting any more."""
        if tenant in self.backlogged:
            self.backlogged.discard(tenant)
            self._last_idle_counter = self.counters.get(tenant, 0.0)

    def pick(self, tenants: Iterable[str]) -> str | None:
        """Of `tenants`, the one with the least counter (the first such one on a tie); None
        when there is none."""
        best: str | None = None
        best_counter = math.inf
        for t in tenants:
            c = self.counters.get(t, 0.0)
            if c < best_counter:
                best, best_counter = t, c
        return best


def interleave(
    streams: Mapping[str, Iterator[T]],
    fair: FairShare,
    cost: Callable[[T], float],
    offered: dict[str, float] | None = None,
) -> Iterator[T]:
    """Merges per-tenant streams in fair-share order: each next item comes from the stream of
    the tenant with the least counter plus what this merge offered it so far; an item counts
    `cost(item)` (weighted tokens: what serving it would charge) from the moment it is offered.
    So a consumer that collects several items before serving any (a window of candidates)
    still gets them interleaved as serving them would, while the counters themselves are only
    charged with what is actually served. `offered` carries that tally across successive
    merges of one pass (RT's feasible, then hopeless, stage). Each stream's own order is kept;
    ties go to the tenant listed first. One stream is passed through as it is."""
    if len(streams) == 1:
        yield from next(iter(streams.values()))
        return
    extra = offered if offered is not None else {}
    live = dict(streams)
    while live:
        tenant = min(live, key=lambda t: fair.counter(t) + extra.get(t, 0.0))
        item = next(live[tenant], None)
        if item is None:
            del live[tenant]
            continue
        extra[tenant] = extra.get(tenant, 0.0) + cost(item)
        yield item
