"""Bounded queues per tier: how many interactive requests of each tier may be in flight on one
engine (sent to it and not finished — running there, or waiting in its queue).

Under overload the engine's queues would otherwise grow without bound: every request the gateway
admits waits inside the engine until its turn, however long that is, and the client with it.
With a bound, the request that finds its tier's queue full is refused at once — 429 with
`Retry-After` and the code `tier_queue_full`, the message naming the tier and the bound — so a
client learns in milliseconds that the service is saturated instead of hanging, and nothing that
was accepted is dropped later for lack of room.

    gateway.max_inflight_rt   RT requests in flight per engine (the larger: RT is shed last)
    gateway.max_inflight_be   interactive BE requests in flight per engine

Batch-API lines are not counted and never refused here: the batch runner bounds them itself
(`batch.max_inflight`), pauses them while RT waits on the engine (gateway/batch/runner.py), and a
refusal would only cost a line an attempt. An RT request the SLO admission downgraded counts as
BE (the check runs after it, on the tier the request will run in); the price of that order is
that an RT request refused here was already counted by the SLO check (its verdict on /metrics,
and the watcher's backlog for an iteration or two: a conservative forecast, never a blind one).

A refusal is recorded like a quota's: usage status "rate_limited" (HTTP 429), and
`tandem_quota_rejections{limit="rt_queue"|"be_queue"}` on /metrics.

In a pool of N engines (gateway/engine/pool.py) the admission runs before placement, so the
queues count the pool's requests together against N times each bound.

`TierQueues` is the count (app state `TIER_QUEUES`, one per gateway process), `TierQueueCheck`
the admission check (gateway/pipeline/admission.py runs it last): it takes a `TierSlot` hold that
the record stage releases when the request ends, however it ends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

from common.config import GatewayConfig
from common.wire import Tier
from gateway.metrics import GatewayMetrics
from gateway.pipeline.outcome import Refused
from gateway.pipeline.prepare import EngineRequest
from gateway.store.types import Tenant

TIER_QUEUE_RETRY_AFTER_S = 1
"""`Retry-After` of a refusal, seconds: the engine finishes requests every few iterations, so a
slot is usually free again within a second (a client retrying sooner only adds load)."""


def tier_bounds(config: GatewayConfig, engines: int = 1) -> dict[Tier, int]:
    """Each tier's bound on in-flight requests, from the gateway's config: its per-engine bound
    times *engines* (the pool's engines, which the queue's key stands for together)."""
    return {"rt": config.max_inflight_rt * engines, "be": config.max_inflight_be * engines}


class TierQueues:
    """Interactive requests in flight per (engine, tier), against each tier's bound."""

    def __init__(self, bounds: dict[Tier, int]) -> None:
        for tier, bound in bounds.items():
            if bound < 1:
                raise ValueError(f"the {tier} tier's in-flight bound must be ≥ 1, got {bound}")
        self.bounds = dict(bounds)
        """tier → most requests in flight per engine."""
        self._inflight: Counter[tuple[str, Tier]] = Counter()

    def inflight(self, engine: str, tier: Tier) -> int:
        """Requests of *tier* in flight on *engine* now."""
        return self._inflight[(engine, tier)]

    def try_take(self, engine: str, tier: Tier) -> TierSlot | None:
        """A slot of *tier* on *engine*, or None when its queue is full."""
        if self._inflight[(engine, tier)] >= self.bounds[tier]:
            return None
        self._inflight[(engine, tier)] += 1
        return TierSlot(self, engine, tier)

    def give_back(self, engine: str, tier: Tier) -> None:
        """A request that held a slot of *tier* on *engine* ended."""
        left = self._inflight[(engine, tier)] - 1
        if left < 0:
            raise ValueError(f"no {tier} request in flight on {engine} to give back")
        self._inflight[(engine, tier)] = left


@dataclass
class TierSlot:
    """A request's place in its tier's queue on one engine (an admission `Hold`)."""

    queues: TierQueues
    engine: str
    tier: Tier
    released: bool = False

    def release(self, used_tokens: int) -> None:
        if not self.released:  # exactly once, whatever the caller does
            self.released = True
            self.queues.give_back(self.engine, self.tier)


def tier_queue_full(tier: Tier, bound: int) -> Refused:
    """The 429 of a request whose tier's queue on the engine is full."""
    return Refused(
        kind="rate_limited",
        http_status=429,
        message=(
            f"the {tier.upper()} queue is full: {bound} {tier.upper()} requests are already in "
            f"flight on the engine (gateway.max_inflight_{tier}); retry in "
            f"{TIER_QUEUE_RETRY_AFTER_S} s"
        ),
        code="tier_queue_full",
        retryable=True,
        retry_after_s=TIER_QUEUE_RETRY_AFTER_S,
    )


class Candidate(Protocol):
    """What the check reads of a request admitted so far (admission.py's `Admitted`, which
    imports this module: a protocol keeps the two from importing each other)."""

    @property
    def origin(self) -> str: ...
    @property
    def tenant(self) -> Tenant: ...
    @property
    def request(self) -> EngineRequest: ...
    def holding(self, hold: TierSlot) -> Self: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class TierQueueCheck:
    """The admission check: an interactive request takes a slot of its tier's queue on the
    engine it will be placed on, or is refused (see the module doc)."""

    queues: TierQueues
    engine: str
    """The engine requests are placed on (`EngineHandle.name`)."""
    metrics: GatewayMetrics

    def __call__(self, admitted: C) -> C | Refused:
        if admitted.origin != "api":
            return admitted  # batch lines: the runner's own bound and pause (module doc)
        tier = admitted.request.meta.tier
        slot = self.queues.try_take(self.engine, tier)
        if slot is None:
            self.metrics.quota_rejected(admitted.tenant.id, f"{tier}_queue")
            return tier_queue_full(tier, self.queues.bounds[tier])
        return admitted.holding(slot)
