"""What this gateway instance may use of every tenant's limits, kept in step with the others.

`SharedLimits` holds the per-tenant state of one instance (token buckets, in-flight and month
counts, recent demand) and sizes each tenant's buckets and concurrency slots to this instance's
share of the limit. The share comes from `apply_sync`, fed by gateway.quotas.sync with the
figures every instance writes to the database; `sync_out` hands this instance's own demand and
month token counts to that writer. Admission against the shares is `QuotaLimiter`
(gateway.quotas.limiter). Pure: no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gateway.quotas.bucket import TokenBucket
from gateway.quotas.shares import allocate, weights
from gateway.store.types import Quota, Tenant

IDLE_FORGET_S = 600.0
"""A tenant with nothing in flight and no request for this long is forgotten (its state and its
demand row go; it starts afresh, with full buckets, on its next request)."""
_DEMAND_DECAY = 0.5
"""Smoothed demand falls by this factor per sync without traffic (rises at once with it)."""


@dataclass
class DemandReport:
    """One tenant's demand on this instance since the previous sync, per second, smoothed."""

    tenant_id: str
    requests: float
    tokens: float
    concurrency: float
    in_flight: int


@dataclass
class SyncView:
    """What the database says at a sync: live instances and every instance's demand."""

    instances: list[str]
    """Live gateway instances (this one included), in a stable order."""
    demand: dict[str, dict[str, DemandReport]]
    """tenant id → instance id → that instance's latest demand report."""
    monthly_tokens: dict[str, int]
    """tenant id → tokens used this month by all instances (what has been synced)."""
    month: str
    """The month these totals are for, "YYYY-MM"."""
    epoch: int = 0
    """A counter the same on every instance (time // 10 s), rotating ties in slot allocation."""


@dataclass
class _Window:
    requests: int = 0
    tokens: int = 0
    concurrency: int = 0


@dataclass
class TenantState:
    """One tenant's quota state on this instance."""

    quota: Quota
    name: str
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0
    reserved_tokens: int = 0
    spent_since_sync: int = 0
    """Tokens used by requests finished since the last sync (not in `month_used` yet)."""
    pushing: int = 0
    """Tokens handed to a sync still under way (in `month_used` once it has answered)."""
    month_used: int = 0
    """Tokens used this month by all instances, as of the last sync."""
    month: str = ""
    w_requests: float | None = None
    w_tokens: float | None = None
    w_concurrency: dict[str, float] | None = None
    slots: int | None = None
    """Concurrency slots of this instance (None: no max_concurrent), kept with the shares."""
    window: _Window = field(default_factory=_Window)
    smoothed: DemandReport | None = None
    last_seen_s: float = 0.0


class SharedLimits:
    """Every tenant's state on this instance and its share of their limits (the sync half of
    :class:`gateway.quotas.limiter.QuotaLimiter`)."""

    def __init__(
        self,
        instance_id: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.instance_id = instance_id
        self._clock = clock
        self._wall_clock = wall_clock
        self._tenants: dict[str, TenantState] = {}
        self._instances: list[str] = [instance_id]
        self._epoch = 0
        self._last_sync_s = clock()
        self._unsynced_month: dict[tuple[str, str], int] = {}
        """(tenant id, month) → tokens used here and not yet added to the shared total."""
        self._month_totals: dict[str, int] = {}
        self._view_month = ""
        self._month_cache = ("", -1.0)
        """(month key, clock reading until which it is valid): no calendar work per request."""

    @property
    def instances(self) -> int:
        """Live gateway instances sharing the limits, as of the last sync (this one included)."""
        return len(self._instances)

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per tenant id (tenants with none omitted)."""
        return {t: s.in_flight for t, s in self._tenants.items() if s.in_flight}

    # ---------------------------------------------------------------------- sync

    def sync_out(self) -> tuple[list[DemandReport], dict[tuple[str, str], int]]:
        """This instance's demand per tenant, and the month token counts to add to the shared
        totals (taken out of the limiter: give them back with `sync_failed` if the write fails).
        Forgets idle tenants."""
        now = self._clock()
        elapsed = max(now - self._last_sync_s, 1e-3)
        self._last_sync_s = now
        reports = []
        for tenant_id, state in list(self._tenants.items()):
            if state.in_flight == 0 and now - state.last_seen_s > IDLE_FORGET_S:
                del self._tenants[tenant_id]
                continue
            reports.append(self._smooth(tenant_id, state, elapsed))
        deltas, self._unsynced_month = self._unsynced_month, {}
        for state in self._tenants.values():
            state.pushing += state.spent_since_sync
            state.spent_since_sync = 0
        return reports, deltas

    def sync_failed(self, deltas: dict[tuple[str, str], int]) -> None:
        """Keeps month counts whose write failed, for the next sync."""
        for key, tokens in deltas.items():
            self._unsynced_month[key] = self._unsynced_month.get(key, 0) + tokens
        for state in self._tenants.values():
            state.spent_since_sync += state.pushing
            state.pushing = 0

    def apply_sync(self, view: SyncView) -> None:
        """Sets every tenant's share of its limits from the shared view."""
        self._instances = list(view.instances) or [self.instance_id]
        if self.instance_id not in self._instances:
            self._instances.append(self.instance_id)
        self._epoch = view.epoch
        now = self._clock()
        for tenant_id, state in self._tenants.items():
            demand = view.demand.get(tenant_id, {})
            if state.smoothed is not None:
                demand = {**demand, self.instance_id: state.smoothed}
            state.w_requests = weights(self._instances, {i: d.requests for i, d in demand.items()})[
                self.instance_id
            ]
            state.w_tokens = weights(self._instances, {i: d.tokens for i, d in demand.items()})[
                self.instance_id
            ]
            state.w_concurrency = weights(
                self._instances, {i: d.concurrency for i, d in demand.items()}
            )
            state.month = view.month
            state.month_used = view.monthly_tokens.get(tenant_id, 0)
            state.pushing = 0
            self._resize(state, now)
        self._month_totals = dict(view.monthly_tokens)
        self._view_month = view.month

    # ------------------------------------------------------------------- helpers

    def _state(self, tenant: Tenant, now: float) -> TenantState:
        state = self._tenants.get(tenant.id)
        if state is None:
            state = TenantState(quota=tenant.quota, name=tenant.name, last_seen_s=now)
            if self._view_month == self._month():
                state.month = self._view_month
                state.month_used = self._month_totals.get(tenant.id, 0)
            self._tenants[tenant.id] = state
            self._resize(state, now)
        elif state.quota != tenant.quota:  # changed through the admin API: applies at once
            state.quota = tenant.quota
            self._resize(state, now, limit_changed=True)
        return state

    def _shared_wait(self, wait_s: float, amount: int, per_min: int) -> float:
        """The Retry-After of a bucket: its own wait when this instance is alone; with others,
        at most what the whole limit needs to refill *amount* (the shares move meanwhile)."""
        if wait_s <= 0 or len(self._instances) == 1 or per_min <= 0:
            return wait_s
        return min(wait_s, max(60.0 * amount / per_min, 1e-3))

    def _even(self) -> float:
        return 1.0 / max(len(self._instances), 1)

    def _resize(self, state: TenantState, now: float, limit_changed: bool = False) -> None:
        # a new share (sync) only resizes: growing the level with every share change would let
        # oscillating shares mint tokens; a raised limit (admin) grants its extra burst at once
        quota = state.quota
        state.slots = self._slots(state) if quota.max_concurrent is not None else None
        if quota.requests_per_min is None:
            state.requests = None
        else:
            w = state.w_requests if state.w_requests is not None else self._even()
            state.requests = _sized(state.requests, quota.requests_per_min * w, now, limit_changed)
        if quota.tokens_per_min is None:
            state.tokens = None
        else:
            w = state.w_tokens if state.w_tokens is not None else self._even()
            state.tokens = _sized(state.tokens, quota.tokens_per_min * w, now, limit_changed)

    def _slots(self, state: TenantState) -> int:
        limit = state.quota.max_concurrent or 0
        fractions = state.w_concurrency or {i: self._even() for i in self._instances}
        if self.instance_id not in fractions:
            fractions = {i: self._even() for i in self._instances}
        return allocate(limit, fractions, self._epoch)[self.instance_id]

    def _smooth(self, tenant_id: str, state: TenantState, elapsed_s: float) -> DemandReport:
        win, prev = state.window, state.smoothed
        current = DemandReport(
            tenant_id,
            win.requests / elapsed_s,
            win.tokens / elapsed_s,
            float(max(win.concurrency, state.in_flight)),
            state.in_flight,
        )
        if prev is not None:
            current.requests = max(current.requests, prev.requests * _DEMAND_DECAY)
            current.tokens = max(current.tokens, prev.tokens * _DEMAND_DECAY)
            current.concurrency = max(current.concurrency, prev.concurrency * _DEMAND_DECAY)
        state.smoothed = current
        state.window = _Window()
        return current

    def _month(self) -> str:
        month, valid_until = self._month_cache
        now = self._clock()
        if now >= valid_until:
            month = month_key(self._wall_clock())
            self._month_cache = (month, now + 1.0)
        return month


def month_key(when: datetime) -> str:
    """ "YYYY-MM" of *when* in UTC."""
    return when.astimezone(UTC).strftime("%Y-%m")


def _sized(
    bucket: TokenBucket | None, per_min: float, now: float, grant_growth: bool
) -> TokenBucket:
    if bucket is None:
        return TokenBucket.full(per_min, per_min / 60.0, now)
    bucket.resize(per_min, per_min / 60.0, now, grant_growth=grant_growth)
    return bucket
