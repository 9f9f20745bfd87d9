"""BE orderings `dfs` and `blend` in the bench: the batch runner's feed, simulated.

The gateway's batch runner (gateway/batch/runner.py) does not dump a batch on the engine: it runs
a pilot sample first, plans the order with the prefix tree (backend/policy/batch_order), and
then feeds lines as earlier ones finish, keeping a bounded amount of work in flight.
`OrderedFeedSource` does exactly that against the simulator, with the same ordering code, so
`tandem bench W4 --policies fcfs,dfs,blend` compares:

* `fcfs`  — the job submitted at once in its own (random) order; the engine's FCFS admits it;
* `dfs`   — the runner's feed in DFS order of the prefix trie (prefix-sharing optimum);
* `blend` — the runner's feed from BlendServe's dual scanner over the ρ-sorted units.

`dfs` and `blend` run on the `fcfs` engine policy: only the order (and the feed) differ.
Prompts are the workload's prefix-block hashes (512 tokens each) plus one element unique to the
request, so every request is its own leaf of the trie.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from backend.policy.batch_order.feed import BatchFeed, FeedSettings
from backend.policy.batch_order.tree import OrderItem
from bench.workloads.base import RequestSpec, SpecSource
from bench.workloads.sampling import BLOCK_TOKENS, stable_hash

BE_ORDERINGS = ("dfs", "blend")
"""Policy names that are BE orderings on the fcfs engine policy (API.md)."""
ENGINE_POLICY = "fcfs"
"""The engine policy under the orderings."""
OVERCOMMIT = 0.8
"""In-flight footprint allowed, × the KV pool (under 1: the engine's FCFS admits without
reserving for outputs, so a fuller feed only buys evictions)."""
MAX_INFLIGHT = 1024
"""Lines in flight at most (the simulated engine's queue bound)."""
PILOT_FRACTION = 0.01
"""Pilot share (the gateway's default)."""
PILOT_MAX_LINES = 64
"""Most pilot lines."""


def order_items(specs: Sequence[RequestSpec]) -> list[OrderItem]:
    """The specs as OrderItems (index = position in `specs`)."""
    return [
        OrderItem(
            index=i,
            path=(*s.prefix_hashes, stable_hash("leaf", s.rid)),
            prompt_len=s.prompt_len,
            max_output_len=s.max_new_tokens,
        )
        for i, s in enumerate(specs)
    ]


class OrderedFeedSource:
    """A SpecSource that feeds one offline job like the gateway's batch runner (module doc)."""

    def __init__(self, specs: Sequence[RequestSpec], settings: FeedSettings) -> None:
        self._specs = list(specs)
        self._pos_of = {s.rid: i for i, s in enumerate(self._specs)}
        self.feed = BatchFeed(order_items(self._specs), settings)
        self._heap: list[tuple[float, int, RequestSpec]] = []
        self._count = 0
        self._fill(0.0)

    def next_arrival_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_s: float) -> list[RequestSpec]:
        due: list[RequestSpec] = []
        while self._heap and self._heap[0][0] <= now_s:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def on_finish(self, rid: str, now_s: float) -> None:
        pos = self._pos_of.get(rid)
        if pos is None:
            return
        self.feed.finished(pos, self._specs[pos].output_len)
        self._fill(now_s)

    @property
    def exhausted(self) -> bool:
        return not self._heap and self.feed.exhausted

    def _fill(self, now_s: float) -> None:
        while (pos := self.feed.next()) is not None:
            spec = replace(self._specs[pos], arrival_s=now_s, order_key=float(self._count))
            heapq.heappush(self._heap, (now_s, self._count, spec))
            self._count += 1


def feed_settings(ordering: str, kv_capacity_tokens: int) -> FeedSettings:
    """The simulated runner's settings: the gateway's defaults, the simulated KV pool."""
    if ordering not in BE_ORDERINGS:
        raise ValueError(f"unknown BE ordering {ordering!r}; valid: {', '.join(BE_ORDERINGS)}")
    return FeedSettings(
        ordering=ordering,  # type: ignore[arg-type]
        memory_tokens=kv_capacity_tokens * OVERCOMMIT,
        max_inflight=MAX_INFLIGHT,
        pilot_fraction=PILOT_FRACTION,
        pilot_max_lines=PILOT_MAX_LINES,
        tokens_per_element=BLOCK_TOKENS,
    )


def ordered_source(ordering: str, source: SpecSource, kv_capacity_tokens: int) -> OrderedFeedSource:
    """Wraps a workload's (offline, BE) source in the simulated runner feed."""
    specs = _drain_now(source)
    if any(s.tier != "be" for s in specs) or any(s.arrival_s != specs[0].arrival_s for s in specs):
        raise ValueError(
            f"{ordering} orders one offline BE job (W4, or a BE trace submitted at "
            f"one time); this workload has RT or timed arrivals"
        )
    return OrderedFeedSource(specs, feed_settings(ordering, kv_capacity_tokens))


def _drain_now(source: SpecSource) -> list[RequestSpec]:
    """Every request of an offline source (all due at its first arrival time)."""
    out: list[RequestSpec] = []
    while (t := source.next_arrival_s()) is not None:
        out.extend(source.pop_due(t))
    return out
