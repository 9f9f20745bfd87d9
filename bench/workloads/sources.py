"""Arrival sources: open-loop lists, BE batches submitted one after another, closed-loop clients,
and a merge of several. All implement `SpecSource` (the simulator's ArrivalSource protocol over
RequestSpecs); `SimSource` adapts one to the simulator's SimRequest.

Closed-loop and batch sources stop *submitting* at `stop_s` (the arrival window); what was
submitted before still runs to completion.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bench.workloads.base import RequestSpec, SpecSource


class TimedSource:
    """Requests with fixed arrival times (open loop)."""

    def __init__(self, specs: Iterable[RequestSpec]) -> None:
        self._specs = sorted(specs, key=lambda s: s.arrival_s)
        self._next = 0

    def __len__(self) -> int:
        return len(self._specs)

    def next_arrival_s(self) -> float | None:
        return self._specs[self._next].arrival_s if self._next < len(self._specs) else None

    def pop_due(self, now_s: float) -> list[RequestSpec]:
        start = self._next
        while self._next < len(self._specs) and self._specs[self._next].arrival_s <= now_s:
            self._next += 1
        return self._specs[start : self._next]

    def on_finish(self, rid: str, now_s: float) -> None:
        """Open loop: finishes change nothing."""

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._specs)


class _Feedback:
    """Shared part of the feedback-driven sources: a heap of scheduled specs, the rids in
    flight, and the latest time seen."""

    def __init__(self, stop_s: float) -> None:
        self.stop_s = stop_s
        self._heap: list[tuple[float, int, RequestSpec]] = []
        self._count = 0
        self._in_flight: set[str] = set()
        self._now_s = 0.0

    def _schedule(self, spec: RequestSpec) -> None:
        heapq.heappush(self._heap, (spec.arrival_s, self._count, spec))
        self._count += 1

    def next_arrival_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_s: float) -> list[RequestSpec]:
        self._now_s = max(self._now_s, now_s)
        due: list[RequestSpec] = []
        while self._heap and self._heap[0][0] <= now_s:
            spec = heapq.heappop(self._heap)[2]
            self._in_flight.add(spec.rid)
            due.append(spec)
        return due

    @property
    def exhausted(self) -> bool:
        """Nothing scheduled, and nothing in flight that could still trigger a submission."""
        return not self._heap and (not self._in_flight or self._now_s >= self.stop_s)


class ClosedLoopSource(_Feedback):
    """`clients` clients, each with one request outstanding: a client submits its next request
    the moment the previous one finishes (no think time). Client c's j-th request is
    `make(c, j, arrival_s)`, so the same requests come in the same per-client order whatever
    the policy."""

    def __init__(
        self,
        clients: int,
        make: Callable[[int, int, float], RequestSpec],
        stop_s: float,
        start_s: float = 0.0,
    ) -> None:
        super().__init__(stop_s)
        self._make = make
        self._owner: dict[str, tuple[int, int]] = {}
        for client in range(clients):
            self._submit(client, 0, start_s)

    def _submit(self, client: int, seq: int, now_s: float) -> None:
        spec = self._make(client, seq, now_s)
        self._owner[spec.rid] = (client, seq)
        self._schedule(spec)

    def on_finish(self, rid: str, now_s: float) -> None:
        owner = self._owner.pop(rid, None)
        if owner is None:
            return
        self._in_flight.discard(rid)
        self._now_s = max(self._now_s, now_s)
        if now_s < self.stop_s:
            self._submit(owner[0], owner[1] + 1, now_s)


class BatchSource(_Feedback):
    """BE batches: batch 0 at start_s; batch k+1 is submitted when every request of batch k has
    finished. `make(k, arrival_s)` returns batch k's requests."""

    def __init__(
        self,
        make: Callable[[int, float], Sequence[RequestSpec]],
        stop_s: float,
        start_s: float = 0.0,
    ) -> None:
        super().__init__(stop_s)
        self._make = make
        self._batch = 0
        self._outstanding: set[str] = set()
        self._submit(start_s)

    def _submit(self, now_s: float) -> None:
        for spec in self._make(self._batch, now_s):
            self._outstanding.add(spec.rid)
            self._schedule(spec)
        self._batch += 1

    def on_finish(self, rid: str, now_s: float) -> None:
        if rid not in self._outstanding:
            return
        self._outstanding.discard(rid)
        self._in_flight.discard(rid)
        self._now_s = max(self._now_s, now_s)
        if not self._outstanding and now_s < self.stop_s:
            self._submit(now_s)

    @property
    def batches_submitted(self) -> int:
        return self._batch


class MergedSource:
    """Several sources as one (arrivals interleaved by time; feedback goes to all)."""

    def __init__(self, sources: Sequence[SpecSource]) -> None:
        self._sources = list(sources)

    def next_arrival_s(self) -> float | None:
        times = [t for t in (s.next_arrival_s() for s in self._sources) if t is not None]
        return min(times) if times else None

    def pop_due(self, now_s: float) -> list[RequestSpec]:
        due = [spec for s in self._sources for spec in s.pop_due(now_s)]
        due.sort(key=lambda spec: spec.arrival_s)
        return due

    def on_finish(self, rid: str, now_s: float) -> None:
        for source in self._sources:
            source.on_finish(rid, now_s)

    @property
    def exhausted(self) -> bool:
        return all(s.exhausted for s in self._sources)


def merge(sources: Sequence[SpecSource]) -> SpecSource:
    """One source: the only one, or a MergedSource."""
    return sources[0] if len(sources) == 1 else MergedSource(sources)


def drain(
    source: SpecSource, *, finish_after_s: float | None = 0.0, limit: int = 1_000_000
) -> list[RequestSpec]:
    """Every request a source submits when each request finishes `finish_after_s` after it
    arrives (None: never finishes). For tests and for inspecting a workload."""
    out: list[RequestSpec] = []
    pending: list[tuple[float, str]] = []
    while len(out) < limit:
        candidates = [
            t
            for t in (source.next_arrival_s(), pending[0][0] if pending else None)
            if t is not None
        ]
        if not candidates:
            break
        now = min(candidates)
        while pending and pending[0][0] <= now:
            _, rid = heapq.heappop(pending)
            source.on_finish(rid, now)
        for spec in source.pop_due(now):
            out.append(spec)
            if finish_after_s is not None:
                heapq.heappush(pending, (now + finish_after_s, spec.rid))
    return out


class SimSource:
    """Adapts a SpecSource to the simulator's ArrivalSource (SimRequest objects)."""

    def __init__(self, source: SpecSource, request_type: Callable[..., Any]) -> None:
        self._source = source
        self._make = request_type

    def next_arrival_s(self) -> float | None:
        return self._source.next_arrival_s()

    def pop_due(self, now_s: float) -> list[Any]:
        return [
            self._make(
                rid=s.rid,
                tier=s.tier,
                arrival_s=s.arrival_s,
                prompt_len=s.prompt_len,
                output_len=s.output_len,
                max_new_tokens=s.max_new_tokens,
                ttft_target_s=s.ttft_target_s,
                tpot_target_s=s.tpot_target_s,
                deadline_s=s.deadline_s,
                length_key=s.length_key,
                tenant_id=s.tenant_id,
                tenant_weight=s.tenant_weight,
                on_unattainable=s.on_unattainable,
                order_key=s.order_key,
                prefix_hashes=s.prefix_hashes,
            )
            for s in self._source.pop_due(now_s)
        ]

    def on_finish(self, rid: str, now_s: float) -> None:
        self._source.on_finish(rid, now_s)

    @property
    def exhausted(self) -> bool:
        return self._source.exhausted
