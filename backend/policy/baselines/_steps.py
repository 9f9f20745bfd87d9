"""Building blocks the baselines share: decode a list of requests, prefill a queue, each within
a token budget and with an optional victim order for when KV runs out."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from backend.policy.common import BatchBuilder, decode_cost, make_room, prefill_cost
from backend.policy.types import ReqState


class LazyOrder:
    """A victim order computed only if some step actually needs to evict."""

    def __init__(self, order: Callable[[], list[ReqState]]) -> None:
        self._order = order
        self._reqs: list[ReqState] | None = None

    def __iter__(self) -> Iterator[ReqState]:
        if self._reqs is None:
            self._reqs = self._order()
        return iter(self._reqs)


def _fit(b: BatchBuilder, req: ReqState, cost: int, victims: Iterable[ReqState] | None) -> bool:
    """Makes `cost` slots available for `req`, evicting from `victims` if given; False when
    it cannot, or when `req` itself had to be evicted (vLLM preempts the request in hand when
    it is the newest)."""
    if cost <= b.kv_avail:
        return True
    if victims is None or not make_room(b, cost, victims):
        return False
    return req.rid not in b.evictions


def decode_all(
    b: BatchBuilder,
    reqs: Iterable[ReqState],
    budget: int,
    victims: Iterable[ReqState] | None = None,
) -> int:
    """Adds a decode for every fully prefilled running request of `reqs` (none of them decoded
    yet in this plan), in order, while the
    token budget lasts (one token each). On KV shortage evicts from `victims`, else stops.
    Returns the budget left."""
    page = b.page
    for r in reqs:
        if budget <= 0:
            break
        if r.prefilled < r.prefill_len or (b.evictions and r.rid in b.evictions):
            continue
        if not b.add_decode(r) and not (
            _fit(b, r, decode_cost(r, page), victims) and b.add_decode(r)
        ):
            break
        budget -= 1
    return budget


def prefill_queue(
    b: BatchBuilder,
    reqs: Iterable[ReqState],
    budget: int,
    victims: Iterable[ReqState] | None = None,
    *,
    chunked: bool = True,
) -> int:
    """Prefills `reqs` in order (running partial ones or waiting ones) while the budget lasts,
    stopping at the first request that does not fit (head of line, as FCFS engines do).
    `chunked`: a prompt may be split across iterations; otherwise only whole prompts (or the
    whole rest) are scheduled. Returns the budget left."""
    for r in reqs:
        left = r.prefill_len - r.prefilled
        if left <= 0 or r.rid in b.chunked or r.rid in b.evictions:
            continue
        want = min(left, budget, b.prefill_left)
        if want < left:
            if not chunked:
                break
            want -= want % b.page
        if want <= 0:
            break
        if not b.add_prefill(r, want) and not (
            _fit(b, r, prefill_cost(r, want, b.page), victims) and b.add_prefill(r, want)
        ):
            break
        budget -= want
    return budget
